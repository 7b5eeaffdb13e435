"""benchmarks/gpu.py, the GPU protocol, runs end to end in its tiny CPU mode: every row has numbers."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu.py"


def positive(row: dict, key: str) -> bool:
    value = row.get(key)
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu")
    result = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--no-torch-compile", "--out", str(out)],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr (tail):\n{result.stderr[-4000:]}"
    rows = {row["section"]: row for row in json.loads((out / "gpu.json").read_text())}
    return result.stdout, rows, (out / "gpu.md").read_text()


@pytest.mark.parametrize("section", ["batch1", "stablehlo", "transformers", "torch_source"])
def test_batch1_rows_have_ttft_and_decode(tiny_run, section):
    """The row's fields, not a speed: a 2-layer model's decode is a difference of two short wall times, which a
    loaded machine can make non-positive (that pair is then left out, and with every pair out, decode is None)."""
    _, rows, _ = tiny_run
    row = rows[section]
    assert positive(row, "ttft_ms") and positive(row, "first_call_s"), row
    decode = row["per_run"]["decode_tok_s"]
    assert len(decode) <= 3 and all(isinstance(d, float) and math.isfinite(d) and d > 0 for d in decode), row
    assert positive(row, "decode_tok_s") if decode else row["decode_tok_s"] is None, row
    assert len(row["tokens"]) == 32 and all(isinstance(t, int) for t in row["tokens"])
    assert len(row["per_run"]["ttft_ms"]) == 3


def test_serving_row_has_throughput_and_ttft_percentiles(tiny_run):
    _, rows, _ = tiny_run
    row = rows["serve"]
    for key in ("serve_tok_s", "serve_ttft_p50_ms", "serve_ttft_p99_ms", "serve_tpot_p50_ms"):
        assert positive(row, key), (key, row)
    assert row["serve_ttft_p50_ms"] <= row["serve_ttft_p99_ms"]
    assert "compilations during the timed run: 0" in row["notes"][0]


def test_the_stablehlo_export_decodes_what_generate_decodes(tiny_run):
    _, rows, _ = tiny_run
    assert rows["stablehlo"]["tokens"] == rows["batch1"]["tokens"]


@pytest.mark.parametrize("section", ["batch1", "stablehlo"])
def test_timed_runs_compile_nothing(tiny_run, section):
    _, rows, _ = tiny_run
    assert "compilations during the timed runs: 0" in rows[section]["notes"], rows[section]["notes"]


def test_one_table_with_every_row_and_the_bars(tiny_run):
    stdout, _, markdown = tiny_run
    table = [line for line in stdout.splitlines() if line.startswith("| ")]
    names = ["linnet_jax generate", "linnet_jax serve.Engine", "transformers, static cache, eager",
             "linnet_jax, StableHLO reloaded", "linnet_jax, generated PyTorch, eager"]
    for name in names:
        [line] = [line for line in table if line.startswith(f"| {name} |")]
        assert any(ch.isdigit() for ch in line.split("|")[2] + line.split("|")[4]), line
    assert "decode >= 250 tok/s:" in stdout and "transformers compiled: not measured" in stdout
    assert markdown in stdout


def test_a_failing_section_is_a_row_and_fails_the_run(tmp_path):
    result = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--sections", "batch1", "--budget-s", "1"],
                            capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 1
    assert "| linnet_jax generate | not run: " in result.stdout
