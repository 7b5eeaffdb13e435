"""Running an export where linnet_jax cannot be imported: a fresh python whose sys.modules blocks it (and more),
leaving its results in files. Shared by the export tests (test_export_xla, test_export_torch_onnx)."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

BLOCKED = ("linnet_jax", "flax")


def imported_modules(source: str) -> set[str]:
    """The top-level modules a Python source imports."""
    tree = ast.parse(source)
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    return imported | {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}


def run_python(script: str, directory: Path, env: dict[str, str] | None = None) -> None:
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                            cwd=directory, env=env)
    assert result.returncode == 0, result.stderr[-6000:]


def run_standalone(script: str, directory: Path, env: dict[str, str] | None = None,
                   blocked: tuple[str, ...] = BLOCKED) -> tuple[list[int], np.ndarray]:
    """Run script in a fresh python where importing any of `blocked` fails. The script leaves the new ids in
    ids.json and their logits [N, V] in logits.npy, in directory."""
    prefix = "import sys\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in blocked)
    run_python(prefix + script, directory, env)
    return json.loads((directory / "ids.json").read_text()), np.load(directory / "logits.npy")
