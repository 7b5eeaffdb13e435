"""The repository's promises: CI runs the README's test command, the CLI runs end to end."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ci_runs_exactly_the_readme_test_command():
    command = ROOT.joinpath(".ci/run").read_text().strip().splitlines()[-1]
    readme = ROOT.joinpath("README.md").read_text()
    assert command.startswith("pip install -e \".[test]\"") and command.endswith("python -m pytest -q -n 2 --dist loadfile")
    assert f"```bash\n{command}\n```" in readme


def test_cli_generate_end_to_end(tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path), "PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin",
           "HOME": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-m", "linnet_jax", "generate", "What is the capital of France?", "--max-new-tokens", "16"],
        capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "Model(LlamaForCausalLM" in result.stderr
    assert any((tmp_path / "linnet_jax" / "jax").iterdir())  # the compilation cache was written


def test_cli_chat_end_to_end(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "linnet_jax", "chat", "--no-compilation-cache", "--max-new-tokens", "12",
         "--system", "Answer in one word."],
        input="What is the capital of France?\n\n", capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
