"""benchmarks/page.py: quick mode end to end (a tiny random model, one run, no peers, the page written under a
temporary folder), and the page rendered from hand-made results (peers not installed, failed rows)."""

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from linnet_jax.ops import matvec

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "benchmarks" / "page.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
NUMBER = r"\d[\d,]*(\.\d+)?"


def load_page():
    """benchmarks/page.py as a module (it puts benchmarks/ on sys.path for decode.py, serve.py and train.py)."""
    spec = importlib.util.spec_from_file_location("benchmark_page", PAGE)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


page = load_page()


def every_number(readme: str) -> dict[str, dict[str, str]]:
    """The "Every number" table: row label -> {column: cell} (group heading rows left out)."""
    section = readme.split("## Every number", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("| ")]
    header = [c.strip() for c in lines[0].strip("|").split(" | ")]
    rows = {}
    for line in lines[1:]:
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if not cells[0].startswith("**"):
            rows[cells[0]] = dict(zip(header, cells))
    return rows


def measured(cell: str, unit: str) -> bool:
    return re.fullmatch(f"{NUMBER} {re.escape(unit)}", cell) is not None


@pytest.fixture(scope="module")
def quick_page(tmp_path_factory):
    """page.py --quick --out DIR, run once in its own process: DIR."""
    out = tmp_path_factory.mktemp("page")
    done = subprocess.run([sys.executable, str(PAGE), "--quick", "--out", str(out)], capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert done.stdout.strip().endswith(str(out / "README.md"))
    return out


OURS = {  # label -> the figures (column, unit) quick mode must have measured
    "linnet_jax (XLA:CPU)": [("Time to first token", "ms"), ("Decode speed", "tok/s"), ("Load time", "s")],
    "linnet_jax, StableHLO reloaded": [("Time to first token", "ms"), ("Decode speed", "tok/s")],
    "linnet_jax, generated JAX": [("Time to first token", "ms"), ("Decode speed", "tok/s")],
    "linnet_jax served (`linnet-jax serve`)": [("Serving throughput", "tok/s"),
                                               ("Serving time to first token", "ms"), ("Load time", "s")],
    "linnet_jax `generate()`, sequential": [("Serving throughput", "tok/s")],
    "linnet_jax full": [("Fine-tuning throughput", "tok/s")],
    "linnet_jax LoRA r=8": [("Fine-tuning throughput", "tok/s")],
    "linnet_jax QLoRA r=8 (int8)": [("Fine-tuning throughput", "tok/s")],
    "linnet_jax DPO LoRA r=8": [("Fine-tuning throughput", "tok/s")],
    "linnet_jax served (`linnet-jax serve`), shared prefixes": [("Serving throughput, shared prefixes", "tok/s"),
                                                                ("Load time", "s")],
    "linnet_jax served, `--no-prefix-cache`, shared prefixes": [("Serving throughput, shared prefixes", "tok/s")],
}


def test_quick_page_has_linnet_rows_with_numbers(quick_page):
    rows = every_number((quick_page / "README.md").read_text())
    for label, figures in OURS.items():
        row = rows[label.replace("|", "\\|")]
        for column, unit in figures:
            assert measured(row[column], unit), (label, column, row[column])
        assert measured(row["Peak memory (RSS)"], "GiB"), (label, row)
        assert "failed" not in row["Notes"], (label, row["Notes"])


def test_quick_page_has_speculative_and_prefix_cache_rows(quick_page):
    """Speculative rows (one process: no memory figure) give plain decoding's ids with their acceptance; the prefix
    cache's row its hit rate (4 prompts sharing one 128-id prefix: at least the 3 later ones' 128 ids hit) and its
    gain over the same server with --no-prefix-cache, which looks nothing up."""
    rows = every_number((quick_page / "README.md").read_text())
    plain = rows["linnet_jax `generate()`, plain decoding (repeat/edit prompts)"]
    assert measured(plain["Decode speed, repeat/edit prompts"], "tok/s") and plain["Distance from reference"] == (
        "the reference"), plain
    for k in (4, 8):
        row = rows[f"linnet_jax `generate()`, n-gram speculative, k={k} (repeat/edit prompts)"]
        assert measured(row["Decode speed, repeat/edit prompts"], "tok/s"), row
        assert row["Distance from reference"] == "ids identical to plain decoding", row
        assert re.search(rf"acceptance {NUMBER}%", row["Notes"]), row
        assert re.fullmatch(rf"{NUMBER}× plain decoding", row["Against the stack it replaces"]), row
    cached = json.loads((quick_page / "results" / "prefix.json").read_text())["rows"]
    by_name = {row["name"]: row for row in cached}
    assert by_name["linnet_jax_served"]["prefix_hit_rate"] >= 3 * 128 / (4 * 144) - 1e-9
    assert by_name["linnet_jax_served_no_prefix_cache"]["prefix_hit_rate"] is None
    assert any("itself with `--no-prefix-cache`" in note for note in by_name["linnet_jax_served"]["notes"])
    row = rows["linnet_jax served (`linnet-jax serve`), shared prefixes"]
    assert re.search(rf"prefix cache hit rate {NUMBER}%", row["Notes"]) and "equal" in row["Notes"], row
    assert re.fullmatch(rf"{NUMBER}× --no-prefix-cache", row["Against the stack it replaces"]), row


def test_quick_page_marks_every_peer(quick_page):
    rows = every_number((quick_page / "README.md").read_text())
    peers = [label for section in page.SECTIONS.values() for name, label in section.rows.items()
             if not page.kind(section.name, name).ours]
    assert len(peers) >= 9  # transformers ×2, llama.cpp ×3, vLLM ×2, transformers batched, transformers fine-tuning ×2
    for label in peers:
        row = rows[label]
        assert "skipped in quick mode" in row["Notes"], (label, row)
        assert all(row[m.title] == "–" for m in page.METRICS), (label, row)


def test_quick_page_writes_results_and_describes_the_run(quick_page):
    readme = (quick_page / "README.md").read_text()
    for name in page.SECTIONS:
        payload = json.loads((quick_page / "results" / f"{name}.json").read_text())
        assert payload["quick"] is True and payload["rows"], name
    assert readme.count("(quick mode: a tiny random model") == len(page.SECTIONS)
    decode = json.loads((quick_page / "results" / "decode.json").read_text())
    assert 1 < decode["read_bandwidth_gb_s"] < 10_000 and decode["bytes_per_token"] > 0
    assert re.search(rf"Read bandwidth in this run: {NUMBER} GB/s .* can pass {NUMBER} tok/s", readme)
    native = next(row for row in decode["rows"] if row["name"] == "linnet_jax")
    expected = native["decode_median_tok_s"] * decode["bytes_per_token"] / (decode["read_bandwidth_gb_s"] * 1e9)
    assert native["roofline_share"] == pytest.approx(expected)
    kernels = "through linnet's matrix-vector kernels" if matvec.available() else "linnet's kernels are unavailable"
    assert kernels in native["setup"]  # a run where the plan fell back to XLA's products says so
    assert "## Protocol" in readme and "### Serving (`serve.py`)" in readme


def test_quick_page_charts_are_pngs_with_a_red_best_bar(quick_page):
    import matplotlib.image

    readme = (quick_page / "README.md").read_text()
    for metric in page.METRICS:
        path = quick_page / "charts" / f"{metric.key}.png"
        assert path.read_bytes()[:8] == PNG_MAGIC, path
        assert f"](charts/{metric.key}.png)" in readme, metric.key
        image = matplotlib.image.imread(path)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100, image.shape
        red = np.all(np.abs(image[..., :3] - np.array([0xD6, 0x27, 0x28]) / 255) < 0.02, axis=-1)
        assert red.sum() > 20, f"{path.name}: no red best bar"


def payload(section: str, rows: list[dict]) -> dict:
    return {"section": section, "command": f"python benchmarks/{section}.py", "measured": "2026-12-03T12:00",
            "machine": "test machine", "versions": "jax 0.10.2", "code_version": "abc1234", "protocol": {"runs": 1},
            "rows": rows}


def test_page_shows_missing_and_failed_rows_and_ratios(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    decode_rows = [
        {"name": "linnet_jax", "label": "linnet_jax (XLA:CPU)", "ttft_median_s": 0.5, "decode_median_tok_s": 44.0,
         "load_s": 2.0, "rss_gib": 1.5, "distance": 1e-3, "agreement": 8},
        {"name": "llama_cpp_f32", "label": "llama.cpp f32 row", "ttft_median_s": 0.8, "decode_median_tok_s": 40.0,
         "load_s": 0.2, "rss_gib": 0.6},
        {"name": "llama_cpp_f16", "label": "llama.cpp f16 row",
         "error": "not installed (no llama_cpp): pip install llama-cpp-python==0.3.16"},
        {"name": "stablehlo", "label": "StableHLO row", "error": "RuntimeError: export failed\nValueError: bad shape"},
    ]
    (results / "decode.json").write_text(json.dumps(payload("decode", decode_rows)))
    (results / "train.json").write_text(json.dumps(payload("train", [
        {"row": "transformers full", "error": "not installed (no torch): pip install torch"}])))
    readme = page.write_page(tmp_path).read_text()
    rows = every_number(readme)
    assert rows["linnet_jax (XLA:CPU)"]["Against the stack it replaces"] == "1.10× llama.cpp f32"
    assert rows["linnet_jax (XLA:CPU)"]["Distance from reference"] == "0.001"
    install = "**not installed** (no llama_cpp): pip install llama-cpp-python==0.3.16"
    assert install in rows["llama.cpp f16 row"]["Notes"]
    assert "**failed**: ValueError: bad shape" in rows["StableHLO row"]["Notes"]
    assert "**not installed** (no torch): pip install torch" in rows["transformers full"]["Notes"]
    assert "not run yet (`python benchmarks/page.py --sections serve`)" in readme
    assert (tmp_path / "charts" / "decode.png").exists() and not (tmp_path / "charts" / "serve.png").exists()


def test_missing_peers_are_rows_saying_how_to_install(monkeypatch, tmp_path):
    class Absent(page.decode.System):
        label, requires, install = "absent peer", ("linnet_no_such_module",), "pip install linnet-no-such-package"

    monkeypatch.setitem(page.decode.SYSTEMS, "absent", Absent)
    worker = page.decode.Worker("absent", None, tmp_path)  # starts no process: the row says why
    assert worker.process is None
    assert worker.measured.error == "not installed (no linnet_no_such_module): pip install linnet-no-such-package"
    monkeypatch.setitem(page.serve.OFFLINE_REQUIRES, "transformers_batched",
                        (("linnet_no_such_module",), "pip install it"))
    row = page.serve.measure_offline("transformers_batched", page.serve.parse_args([]), tmp_path)
    assert row.error == "not installed (no linnet_no_such_module): pip install it"
    assert page.status_of(row.error) == ("not installed", "(no linnet_no_such_module): pip install it")


def test_committed_page_is_rendered_from_committed_results(tmp_path):
    """benchmarks/README.md is page.py's rendering of benchmarks/results/*.json: edit page.py or protocol.md, then
    run `python benchmarks/page.py --render-only`."""
    committed = ROOT / "benchmarks"
    (tmp_path / "results").mkdir()
    for path in (committed / "results").glob("*.json"):
        (tmp_path / "results" / path.name).write_text(path.read_text())
    assert page.write_page(tmp_path).read_text() == (committed / "README.md").read_text()
    for metric in page.METRICS:
        chart = Path("charts") / f"{metric.key}.png"
        assert (committed / chart).exists() == (tmp_path / chart).exists(), chart


def test_decode_roofline_counts_the_bytes_a_step_reads():
    """SmolLM2 (the default model): its float32 weights (the tied head once) are 538 MB; 640 cache positions of
    30 layers x keys and values x 3 heads x 64 add 29.5 MB; llama.cpp's f16 rows read the weights at half width."""
    from linnet_jax.load import default_model_path

    sizes = page.decode.model_sizes(default_model_path(), 640)
    assert sizes == (134_515_008, 30 * 2 * 3 * 64 * 640)
    assert page.decode.step_bytes(sizes) == pytest.approx(538.06e6 + 29.49e6, rel=1e-4)
    assert page.decode.step_bytes(sizes, page.decode.SYSTEMS["llama_cpp_f16"].weight_bytes) == pytest.approx(
        269.03e6 + 29.49e6, rel=1e-4)


@pytest.mark.parametrize("script, argv, words", [
    ("serve", ["--workload", "prefix", "--new-tokens", "128"], "the longest prompt (544 ids) + --new-tokens 128"),
    ("serve", ["--prefix-len", "0"], "--prefix-len"),
    ("speculative", ["--modes", "ngram_k4"], "with plain among them"),
    ("speculative", ["--modes", "plain,ngram_4"], "ngram_kK"),
])
def test_benchmark_arguments_refuse_what_cannot_run(script, argv, words, capsys):
    """A prefix workload that overflows --max-len, an empty prefix, speculative modes without plain decoding (the
    reference) or with a malformed name: refused when parsed, naming what was wrong."""
    with pytest.raises(SystemExit):
        getattr(page, script).parse_args(argv)
    assert words in capsys.readouterr().err
