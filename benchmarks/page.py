"""The benchmark page: run every row this machine can run, then write benchmarks/README.md and its charts.

    python benchmarks/page.py --vllm-venv /work/vllm-cpu    # every section (1.7 hours on 2 cores), then the page
    python benchmarks/page.py --sections serve ...           # one section again; the others' saved rows stay
    python benchmarks/page.py --render-only                  # the page again from benchmarks/results/*.json
    python benchmarks/page.py --quick --out /tmp/page        # tiny random model, one run, no peers (the suite's check)

A section is one of the benchmark scripts (`decode.py`, `speculative.py`, `serve.py` on its mixed workload and on
prompts sharing prefixes, `train.py`), run as it is with `--json`: it
runs each of its systems in a process of its own, and this file saves its rows as `results/<section>.json`
(with rows for the systems it was not asked to run, marked so). The page is rendered from those files only:
the machine and versions each section ran with, the protocol (`protocol.md`), one PNG bar chart per figure
(matplotlib, the best bar red, bars grouped by kind), and the "every number" table with each row's ratio to
the named peer and its distance from the reference. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the benchmark scripts, imported for their registries

import decode  # noqa: E402
import harness  # noqa: E402
import serve  # noqa: E402
import speculative  # noqa: E402
import train  # noqa: E402

QUICK_SKIP = "skipped in quick mode"


# --------------------------------------------------------------------------------------------
# What the page knows about rows: their kind, whether they are linnet_jax's, the peers they answer to.


@dataclasses.dataclass(frozen=True)
class Kind:
    """Where a row goes on the page: its group, whether it is linnet_jax's own, the peers it is measured
    against (the first of them that ran), and the figure that ratio compares."""

    group: str
    ours: bool = False
    peers: tuple[str, ...] = ()
    compares: str = ""


GROUPS = ("JAX", "PyTorch", "llama.cpp", "Speculative decoding", "Serving many requests", "Serving shared prefixes",
          "Fine-tuning", "Other")
DECODE_PEERS = ("llama_cpp_f32", "transformers_compiled", "transformers")
KINDS = {
    ("decode", "linnet_jax"): Kind("JAX", True, DECODE_PEERS, "decode"),
    ("decode", "stablehlo"): Kind("JAX", True, DECODE_PEERS, "decode"),
    ("decode", "jax_source"): Kind("JAX", True, DECODE_PEERS, "decode"),
    ("decode", "linnet_jax_int8"): Kind("JAX", True, ("llama_cpp_q8_0",), "decode"),
    ("decode", "linnet_jax_q8_0"): Kind("JAX", True, ("llama_cpp_q8_0",), "decode"),
    ("decode", "torch_source"): Kind("PyTorch", True, ("transformers",), "decode"),
    ("decode", "torch_source_compiled"): Kind("PyTorch", True, ("transformers_compiled",), "decode"),
    ("decode", "onnx_f32"): Kind("Other", True, ("transformers",), "decode"),
    ("decode", "onnx_f16"): Kind("Other", True, ("transformers",), "decode"),
    ("decode", "transformers"): Kind("PyTorch"),
    ("decode", "transformers_compiled"): Kind("PyTorch"),
    ("decode", "llama_cpp_f32"): Kind("llama.cpp"),
    ("decode", "llama_cpp_f16"): Kind("llama.cpp"),
    ("decode", "llama_cpp_q8_0"): Kind("llama.cpp"),
    ("serve", "linnet_jax_served"): Kind("Serving many requests", True, ("vllm_served", "transformers_batched"),
                                         "serve"),
    ("serve", "generate_sequential"): Kind("Serving many requests", True),
    ("serve", "vllm_served"): Kind("Serving many requests"),
    ("serve", "transformers_batched"): Kind("Serving many requests"),
    ("prefix", "linnet_jax_served"): Kind("Serving shared prefixes", True,
                                          ("vllm_served", "linnet_jax_served_no_prefix_cache"), "prefix"),
    ("prefix", "linnet_jax_served_no_prefix_cache"): Kind("Serving shared prefixes", True),
    ("prefix", "vllm_served"): Kind("Serving shared prefixes"),
    **{("speculative", mode): Kind("Speculative decoding", True, ("plain",) if mode != "plain" else (), "speculative")
       for mode in speculative.MODES},
    ("train", "linnet_jax full"): Kind("Fine-tuning", True, ("transformers full",), "train"),
    ("train", "linnet_jax LoRA r=8"): Kind("Fine-tuning", True, ("transformers LoRA r=8",), "train"),
    ("train", "linnet_jax QLoRA r=8 (int8)"): Kind("Fine-tuning", True, ("transformers LoRA r=8",), "train"),
    ("train", "linnet_jax DPO LoRA r=8"): Kind("Fine-tuning", True, ("TRL DPO LoRA r=8",), "train"),
    ("train", "transformers full"): Kind("Fine-tuning"),
    ("train", "transformers LoRA r=8"): Kind("Fine-tuning"),
    ("train", "TRL DPO LoRA r=8"): Kind("Fine-tuning"),
}
PEER_NAMES = {"llama_cpp_f32": "llama.cpp f32", "llama_cpp_q8_0": "llama.cpp Q8_0", "transformers_compiled": "transformers, compiled",
              "transformers": "transformers eager", "vllm_served": "vLLM",
              "transformers_batched": "transformers batched", "transformers full": "transformers",
              "linnet_jax_served_no_prefix_cache": "--no-prefix-cache", "plain": "plain decoding",
              "transformers LoRA r=8": "transformers + PEFT", "TRL DPO LoRA r=8": "TRL + PEFT"}
REFERENCES = {("decode", "transformers"), ("train", "transformers full"), ("train", "transformers LoRA r=8"),
              ("train", "TRL DPO LoRA r=8")}


def kind(section: str, name: str) -> Kind:
    """A row's kind; a row the page does not know yet goes under "Other" (never dropped)."""
    return KINDS.get((section, name), Kind("Other"))


# --------------------------------------------------------------------------------------------
# Sections: how each script is run, fully and in quick mode.


@dataclasses.dataclass(frozen=True)
class Section:
    """One benchmark script: its registry of rows (name -> label), the flag that picks rows, its arguments in
    every mode (`protocol`) and those added in quick mode (the model path comes after those), and whether it
    takes --vllm-venv."""

    name: str
    title: str
    script: str
    rows: dict[str, str]
    pick: str
    quick: tuple[str, ...]
    protocol: tuple[str, ...] = ()
    takes_vllm: bool = False

    def arguments(self, args: argparse.Namespace, model: Path | None) -> list[str]:
        """The script's arguments besides the rows and --json."""
        quick = [*self.quick, "--model-path", str(model)] if model else []
        vllm = ["--vllm-venv", str(args.vllm_venv)] if self.takes_vllm and args.vllm_venv else []
        return [*self.protocol, *quick, *vllm, "--no-write"]

    def asked(self, quick: bool) -> list[str]:
        """The rows to run: all, or linnet_jax's own in quick mode."""
        return [name for name in self.rows if not quick or kind(self.name, name).ours]


SECTIONS = {s.name: s for s in (
    Section("decode", "Decode, batch 1", "decode.py", {n: cls.label for n, cls in decode.SYSTEMS.items()},
            "--systems", ("--runs", "1", "--warmups", "0", "--new-tokens", "4", "--prompt-tokens", "16")),
    Section("speculative", "Speculative decoding, batch 1", "speculative.py",
            {mode: speculative.label(mode) for mode in speculative.MODES}, "--modes",
            ("--runs", "1", "--new-tokens", "8", "--prompts", "1")),
    Section("serve", "Serving", "serve.py", {n: serve.label(n, "mixed") for n in serve.WORKLOADS["mixed"].rows},
            "--systems", ("--requests", "2", "--new-tokens", "4", "--concurrency", "2", "--slots", "2",
                          "--max-len", "64", "--prompt-lengths", "16-48"), takes_vllm=True),
    Section("prefix", "Serving prompts that share prefixes", "serve.py",
            {n: serve.label(n, "prefix") for n in serve.WORKLOADS["prefix"].rows}, "--systems",
            ("--requests", "4", "--new-tokens", "4", "--concurrency", "2", "--slots", "2", "--max-len", "192",
             "--prefixes", "1", "--prefix-len", "128", "--suffix-len", "16"),
            protocol=("--workload", "prefix"), takes_vllm=True),
    Section("train", "Fine-tuning", "train.py", {n: n for n in train.ROWS},
            "--rows", ("--steps", "1", "--warmups", "0", "--batch", "1", "--seq-len", "16")),
)}


def write_tiny_model(directory: Path) -> Path:
    """A random tiny llama (2 layers, hidden 64) with SmolLM2's vocabulary, tokenizer and special ids, written as
    an HF directory: quick mode's model (prompt ids reach 40000, and serving needs a tokenizer)."""
    import linnet_jax
    from linnet_jax.models.params import flatten_params, param_shapes, unflatten_params

    smollm2 = linnet_jax.load(progress=False)
    config = dataclasses.replace(smollm2.config, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                                 num_kv_heads=2, head_dim=16, layer_windows=())
    rng = np.random.default_rng(0)
    params = unflatten_params({name: (np.ones(shape) if "norm" in name else rng.normal(0, 0.1, shape)).astype(
        np.float32) for name, shape in flatten_params(param_shapes(config)).items()})
    return linnet_jax.export.hf(linnet_jax.Model(config, params, smollm2.tokenizer), directory, progress=False)


def stream(command: list[str], prefix: str, keep: int = 20) -> tuple[int, list[str]]:
    """Run `command`, echoing its output (stdout and stderr) to our stderr; (exit status, its last lines)."""
    tail: collections.deque[str] = collections.deque(maxlen=keep)
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=HERE.parent) as p:
        for line in p.stdout:
            print(f"{prefix} {line}", end="", file=sys.stderr)
            if line.strip():
                tail.append(line.rstrip())
    return p.returncode, list(tail)


def failed_section(section: Section, asked: list[str], command: str, tail: list[str]) -> dict:
    """The payload of a section whose script died before writing its JSON: every asked row failed with its last line."""
    error = tail[-1] if tail else "the script printed nothing"
    return {"section": section.name, "command": command, "measured": datetime.datetime.now().isoformat("T", "minutes"),
            "machine": harness.machine(), "versions": harness.versions(), "code_version": harness.code_version(),
            "protocol": {}, "rows": [{"name": n, "label": section.rows[n], "error": error} for n in asked]}


def run_section(section: Section, args: argparse.Namespace, model: Path | None, results: Path) -> Path:
    """Run one script over its rows (linnet_jax's only in quick mode) and save its payload as results/<name>.json,
    with a row for each system it did not run."""
    asked = section.asked(args.quick)
    raw = results / f".{section.name}.partial.json"
    raw.unlink(missing_ok=True)
    arguments = [*section.arguments(args, model), section.pick, ",".join(asked)]
    shown = harness.command_line(section.script, arguments)  # without --json
    print(f"[page] {section.name}: {shown}", file=sys.stderr)
    duration_s, (status, tail) = harness.timed(
        stream, [sys.executable, str(HERE / section.script), *arguments, "--json", str(raw)], f"[{section.name}]")
    payload = json.loads(raw.read_text()) if status == 0 and raw.exists() else failed_section(
        section, asked, shown, tail)
    raw.unlink(missing_ok=True)
    skipped = QUICK_SKIP if args.quick else "not run"
    payload["rows"] += [{"name": n, "label": label, "error": skipped} for n, label in section.rows.items()
                        if n not in asked]
    payload |= {"section": section.name, "command": shown, "quick": args.quick, "duration_s": duration_s}
    path = results / f"{section.name}.json"
    path.write_text(json.dumps(payload, indent=1, ensure_ascii=False) + "\n")
    print(f"[page] {section.name}: {payload['duration_s']:.0f} s, saved {path}", file=sys.stderr)
    return path


# --------------------------------------------------------------------------------------------
# Entries: every section's rows as the page shows them.


@dataclasses.dataclass(frozen=True)
class Metric:
    """One figure of the page: a column of the table and a chart."""

    key: str
    title: str
    unit: str
    lower_is_better: bool


METRICS = (
    Metric("ttft", "Time to first token", "ms", True),
    Metric("decode", "Decode speed", "tok/s", False),
    Metric("speculative", "Decode speed, repeat/edit prompts", "tok/s", False),
    Metric("serve", "Serving throughput", "tok/s", False),
    Metric("serve-ttft", "Serving time to first token", "ms", True),
    Metric("prefix", "Serving throughput, shared prefixes", "tok/s", False),
    Metric("train", "Fine-tuning throughput", "tok/s", False),
    Metric("load", "Load time", "s", True),
    Metric("memory", "Peak memory (RSS)", "GiB", True),
)


@dataclasses.dataclass
class Entry:
    """One row of the page: its figures by metric key, or the reason it has none."""

    section: str
    name: str
    label: str
    values: dict[str, float] = dataclasses.field(default_factory=dict)
    status: str = ""  # "" when measured; else "not installed", "failed", "skipped in quick mode", "not run"
    detail: str = ""  # the install command, or the error's last line
    distance: str = "–"
    notes: list[str] = dataclasses.field(default_factory=list)
    against: str = "–"

    @property
    def kind(self) -> Kind:
        return kind(self.section, self.name)


def status_of(error: str | None) -> tuple[str, str]:
    """(status, detail) from a row's error: not installed (with its install command), skipped, or failed (with the
    error's last line); ("", "") for a measured row."""
    if not error:
        return "", ""
    if error.startswith("not installed"):
        return "not installed", error.removeprefix("not installed").lstrip(": ")
    if error in (QUICK_SKIP, "not run"):
        return error, ""
    return "failed", error.strip().splitlines()[-1].split(" | ")[-1].strip()


def present(values: dict) -> dict[str, float]:
    """The figures that were measured (None and NaN left out)."""
    return {k: float(v) for k, v in values.items() if v is not None and not math.isnan(float(v))}


def significant(value: float, digits: int = 3) -> str:
    """`value` to `digits` significant digits, with thousands separators: 0.0123, 1.23, 123, 12,345."""
    if value == 0 or not math.isfinite(value):
        return f"{value:g}"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(value))))
    return f"{value:,.{decimals}f}"


def distance_text(section: str, name: str, distance: float | None, what: str = "") -> str:
    """The distance cell: "0 (the reference)" for the reference itself, the number, or a dash."""
    if (section, name) in REFERENCES and distance is not None:
        return "0 (the reference)"
    if distance is None or math.isnan(distance):
        return "–"
    return f"{distance:.3g}{what}"


def decode_entry(row: dict, protocol: dict) -> Entry:
    """A decode.py row."""
    entry = Entry("decode", row["name"], row["label"], present({
        "ttft": row.get("ttft_median_s") and row["ttft_median_s"] * 1e3, "decode": row.get("decode_median_tok_s"),
        "load": row.get("load_s"), "memory": row.get("rss_gib")}))
    entry.distance = distance_text("decode", row["name"], row.get("distance"))
    if row.get("distance_rows"):
        entry.notes.append(f"distance over the last {harness.plural(row['distance_rows'], 'prompt position')} only")
    if row.get("agreement") is not None:
        entry.notes.append(f"{row['agreement']}/{protocol.get('new_tokens', '?')} greedy tokens as the reference's")
    if row.get("first_call_s") is not None:
        entry.notes.append(f"first call {significant(row['first_call_s'])} s (compilation included)")
    if row.get("roofline_share") is not None:
        entry.notes.append(f"decode at {row['roofline_share']:.0%} of the run's bandwidth roofline")
    return entry


def serve_entry(row: dict, protocol: dict, section: str = "serve") -> Entry:
    """A serve.py row: of the serve section, or of the prefix section (its throughput a figure of its own, its
    TTFT p50 a note)."""
    ttft_ms = row.get("ttft_p50_s") and row["ttft_p50_s"] * 1e3
    figures = {"serve": row.get("tok_s"), "serve-ttft": ttft_ms} if section == "serve" else {"prefix": row.get("tok_s")}
    entry = Entry(section, row["name"], row["label"], present({**figures, "load": row.get("load_s"),
                                                               "memory": row.get("rss_gib")}))
    entry.distance = "not compared" if entry.values else "–"
    if row.get("check"):
        entry.notes.append(f"greedy check: {row['check']}")
    if section == "prefix" and ttft_ms:
        entry.notes.append(f"TTFT p50 {significant(ttft_ms)} ms")
    if row.get("tpot_p50_s") is not None:
        entry.notes.append(f"TPOT p50 {significant(row['tpot_p50_s'] * 1e3)} ms")
    if row.get("ttft_p99_s") is not None:
        entry.notes.append(f"TTFT p99 {significant(row['ttft_p99_s'] * 1e3)} ms")
    if row.get("prefix_hit_rate") is not None:
        entry.notes.append(f"prefix cache hit rate {row['prefix_hit_rate']:.1%}")
    if entry.values:
        entry.notes += row.get("notes", [])
    return entry


def train_entry(row: dict, protocol: dict) -> Entry:
    """A train.py row (named by its "row")."""
    name = row.get("name") or row["row"]
    entry = Entry("train", name, row.get("label", name), present({
        "train": row.get("tokens_per_s"), "memory": row.get("peak_rss_mib") and row["peak_rss_mib"] / 1024}))
    entry.distance = distance_text("train", name, row.get("loss_distance"), " (|Δ first loss|)")
    if row.get("step_s") is not None:
        entry.notes.append(f"step {significant(row['step_s'])} s")
    return entry


def speculative_entry(row: dict, protocol: dict) -> Entry:
    """A speculative.py row (one mode)."""
    entry = Entry("speculative", row["name"], row["label"], present({"speculative": row.get("decode_tok_s")}))
    if row["name"] == "plain":
        entry.distance = "the reference"
    elif "identical" in row:
        entry.distance = "ids identical to plain decoding" if row["identical"] else "ids DIFFER from plain decoding"
    if row.get("acceptance") is not None:
        entry.notes += [f"acceptance {row['acceptance']:.1%}",
                        f"{row['tokens_per_dispatch']:.2f} tokens per verify dispatch"]
    return entry


ENTRIES = {"decode": decode_entry, "speculative": speculative_entry, "serve": serve_entry,
           "prefix": lambda row, protocol: serve_entry(row, protocol, "prefix"), "train": train_entry}


def entries_of(payload: dict) -> list[Entry]:
    """A section's rows as entries, with their status."""
    made = []
    for row in payload["rows"]:
        entry = ENTRIES[payload["section"]](row, payload.get("protocol", {}))
        entry.status, entry.detail = status_of(row.get("error"))
        made.append(entry)
    return made


def ordered(entries: list[Entry]) -> list[Entry]:
    """Grouped by kind (GROUPS' order), each group in its sections' registry order."""
    def key(e: Entry) -> tuple[int, int, int]:
        registry = list(SECTIONS[e.section].rows) if e.section in SECTIONS else []
        return (GROUPS.index(e.kind.group), list(SECTIONS).index(e.section) if e.section in SECTIONS else 99,
                registry.index(e.name) if e.name in registry else len(registry))
    return sorted(entries, key=key)


def against(entry: Entry, measured: dict[tuple[str, str], Entry]) -> str:
    """"1.05× llama.cpp f32": the row's figure over its first peer's that was measured, or a dash."""
    metric = entry.kind.compares
    if metric not in entry.values:
        return "–"
    for peer in entry.kind.peers:
        other = measured.get((entry.section, peer))
        if other and other.values.get(metric):
            return f"{entry.values[metric] / other.values[metric]:.2f}× {PEER_NAMES.get(peer, other.label)}"
    return "–"


def with_ratios(entries: list[Entry]) -> list[Entry]:
    """The entries with their "against" cells filled in."""
    measured = {(e.section, e.name): e for e in entries if not e.status}
    for e in entries:
        e.against = against(e, measured)
    return entries


# --------------------------------------------------------------------------------------------
# Charts.


def best_index(values: list[float], lower_is_better: bool) -> int:
    """The index of the best value (the first one on a tie)."""
    return values.index(min(values) if lower_is_better else max(values))


def chart_rows(entries: list[Entry], key: str) -> list[tuple[str, str, float]]:
    """(group, label, value) of the entries that have the figure, in page order (labels without markdown's `)."""
    return [(e.kind.group, e.label.replace("`", ""), e.values[key]) for e in entries if key in e.values]


def bar_layout(rows: list[tuple[str, str, float]]) -> tuple[list[float], list[str], list[tuple[float, str]]]:
    """Bar positions and labels from the top, with a heading line before each group: (bar y, bar labels,
    [(heading y, group)])."""
    ys, labels, headings, y, group = [], [], [], 0.0, None
    for row_group, label, _ in rows:
        if row_group != group:
            headings.append((y, row_group))
            group, y = row_group, y + 1
        ys.append(y)
        labels.append(label)
        y += 1
    return ys, labels, headings


def draw_chart(metric: Metric, rows: list[tuple[str, str, float]], path: Path) -> None:
    """A horizontal bar chart of one figure, grouped by kind, each bar labelled with its value, the best one red."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = [value for _, _, value in rows]
    best = best_index(values, metric.lower_is_better)
    ys, labels, headings = bar_layout(rows)
    fig, ax = plt.subplots(figsize=(9, 0.9 + 0.32 * (len(ys) + len(headings))))
    colors = ["#d62728" if i == best else "#5b7fa6" for i in range(len(values))]
    ax.barh(ys, values, color=colors, edgecolor=colors, linewidth=4, height=0.7)  # the edge: a bar too short to see
    for y, value in zip(ys, values):
        ax.text(value, y, f" {significant(value)} {metric.unit}", va="center", fontsize=8)
    for y, group in headings:
        ax.text(0, y, group, va="center", ha="left", fontsize=9, fontweight="bold")
    ax.set_yticks(ys, labels, fontsize=8)
    ax.set_ylim(max(ys) + 0.7, -0.7)
    ax.set_xlim(0, max(values) * 1.3)
    ax.set_xlabel(metric.unit)
    better = "lower" if metric.lower_is_better else "higher"
    ax.set_title(f"{metric.title}: {metric.unit}, {better} is better; the best bar is red", fontsize=10)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_charts(entries: list[Entry], charts: Path) -> dict[str, Path]:
    """One PNG per figure that some row has (a stale one of a figure no row has is removed): key -> path."""
    charts.mkdir(parents=True, exist_ok=True)
    written = {}
    for metric in METRICS:
        path = charts / f"{metric.key}.png"
        rows = chart_rows(entries, metric.key)
        if rows:
            draw_chart(metric, rows, path)
            written[metric.key] = path
        else:
            path.unlink(missing_ok=True)
    return written


# --------------------------------------------------------------------------------------------
# The page.


def cell(text: str) -> str:
    """Text made safe for one markdown table cell."""
    return " ".join(str(text).split()).replace("|", "\\|")


def status_cell(entry: Entry) -> str:
    """What a row without figures says instead: not installed (and how to install it), failed (and why), skipped."""
    if entry.status == "not installed":
        return f"**not installed** {entry.detail}"
    if entry.status == "failed":
        return f"**failed**: {entry.detail}"
    return f"*{entry.status}*"


def table_row(entry: Entry) -> str:
    """One line of the every-number table."""
    figures = [f"{significant(entry.values[m.key])} {m.unit}" if m.key in entry.values else "–" for m in METRICS]
    notes = "; ".join(([status_cell(entry)] if entry.status else []) + entry.notes)
    return "| " + " | ".join(cell(c) for c in [entry.label, *figures, entry.against, entry.distance, notes]) + " |"


def every_number(entries: list[Entry]) -> list[str]:
    """The table of every row and every figure, a heading row before each group."""
    header = ["Method", *(m.title for m in METRICS), "Against the stack it replaces", "Distance from reference",
              "Notes"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    group = None
    for entry in entries:
        if entry.kind.group != group:
            group = entry.kind.group
            lines.append(f"| **{group}** |" + " |" * (len(header) - 1))
        lines.append(table_row(entry))
    return lines


def headline(entries: list[Entry]) -> list[str]:
    """linnet_jax's rows against the stack they replace, one line each."""
    return [f"- {e.label}: **{e.against}** ({next(m.title.lower() for m in METRICS if m.key == e.kind.compares)})"
            for e in entries if e.kind.ours and e.against != "–"]


def protocol_line(protocol: dict) -> str:
    """The parameters a section ran with, short (rows and unset options left out)."""
    shown = {k: v for k, v in protocol.items() if v not in (None, False) and k not in ("systems", "rows")}
    def text(value) -> str:
        return ",".join(map(str, value)) if isinstance(value, list) else str(value)
    return ", ".join(f"{k.replace('_', '-')} {text(v)}" for k, v in shown.items())


def where_and_with_what(payloads: list[dict]) -> list[str]:
    """Per section: when, on what machine, with which versions and commit, how long, with what command."""
    lines = []
    for p in payloads:
        quick = " (quick mode: a tiny random model, one run; **its numbers mean nothing**)" if p.get("quick") else ""
        took = f", took {p['duration_s'] / 60:.1f} min" if p.get("duration_s") else ""
        lines += [f"- **{SECTIONS[p['section']].title}**{quick}: measured {p['measured']} on {p['machine']}{took}; "
                  f"{p['versions']}; linnet_jax at {p['code_version']}.",
                  f"  Command: `{p['command']}`" + (f"; {protocol_line(p['protocol'])}." if p.get("protocol") else ""),
                  *([roofline_text(p)] if p.get("read_bandwidth_gb_s") else []),
                  *([f"  These rows were {p['source']}."] if p.get("source") else [])]
    return lines


def roofline_text(payload: dict) -> str:
    """The decode section's ceiling: the run's read bandwidth over the bytes a batch-1 step reads."""
    bandwidth, per_token = payload["read_bandwidth_gb_s"], payload["bytes_per_token"]
    return (f"  Read bandwidth in this run: {bandwidth:.1f} GB/s (a jitted sum over 1 GiB), so no batch-1 decode "
            f"reading {per_token / 1e6:.0f} MB a token can pass {bandwidth * 1e9 / per_token:.1f} tok/s.")


def chart_lines(charts: dict[str, Path], page: Path) -> list[str]:
    """The charts, embedded with links relative to the page."""
    lines = []
    for metric in METRICS:
        if metric.key in charts:
            lines += [f"![{metric.title}]({charts[metric.key].relative_to(page.parent).as_posix()})", ""]
    return lines


def render(payloads: list[dict], charts: dict[str, Path], entries: list[Entry], page: Path) -> str:
    """The whole page, as markdown."""
    missing = [name for name in SECTIONS if name not in {p["section"] for p in payloads}]
    return "\n".join([
        "# Benchmarks",
        "",
        "<!-- Written by benchmarks/page.py from benchmarks/results/*.json: edit page.py or protocol.md, "
        "not this file. -->",
        "",
        "Every row this machine can run, each system in a process of its own, in one table and as charts; the "
        "protocol is at the end, and what each change bought is in [RESULTS.md](RESULTS.md). Regenerate with "
        f"`python benchmarks/page.py` (`--sections {','.join(SECTIONS)}`, `--render-only`, `--quick --out DIR`).",
        "",
        "## Where and with what",
        "",
        *where_and_with_what(payloads),
        *[f"- **{SECTIONS[name].title}**: not run yet (`python benchmarks/page.py --sections {name}`)."
          for name in missing],
        "",
        "## Linnet against the stack it replaces",
        "",
        "A row's speed over its named peer's, in the same run; above 1× is faster.",
        "",
        *(headline(entries) or ["- no linnet_jax row has a measured peer in these results"]),
        "",
        "## Charts",
        "",
        *chart_lines(charts, page),
        "## Every number",
        "",
        *every_number(entries),
        "",
        "Figures to three significant digits. A dash: not measured for that row (or that kind of row).",
        "",
        "## Protocol",
        "",
        (HERE / "protocol.md").read_text().strip(),
        "",
    ])


def load_payloads(results: Path) -> list[dict]:
    """The saved sections, in SECTIONS' order."""
    return [json.loads((results / f"{name}.json").read_text()) for name in SECTIONS
            if (results / f"{name}.json").exists()]


def write_page(out: Path) -> Path:
    """README.md and charts/*.png under `out`, from out/results/*.json."""
    payloads = load_payloads(out / "results")
    entries = with_ratios(ordered([e for p in payloads for e in entries_of(p)]))
    page = out / "README.md"
    charts = write_charts(entries, out / "charts")
    page.write_text(render(payloads, charts, entries, page))
    return page


# --------------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sections", type=lambda s: s.split(","), default=list(SECTIONS),
                        help=f"comma-separated, from {','.join(SECTIONS)} (default: all)")
    parser.add_argument("--render-only", action="store_true", help="run nothing: the page from the saved results")
    parser.add_argument("--quick", action="store_true",
                        help="a tiny random model, one run, few tokens, no peers "
                             "(default --out: a new temporary folder)")
    parser.add_argument("--out", type=Path, help=f"where results/, charts/ and README.md go (default {HERE})")
    parser.add_argument("--vllm-venv", type=Path, help="the vllm-cpu venv, handed to serve.py")
    args = parser.parse_args(argv)
    if unknown := [s for s in args.sections if s not in SECTIONS]:
        parser.error(f"unknown section(s) {unknown}; known: {list(SECTIONS)}")
    return args


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    out = args.out or (Path(tempfile.mkdtemp(prefix="linnet-page-")) if args.quick else HERE)
    (out / "results").mkdir(parents=True, exist_ok=True)
    if not args.render_only:
        with tempfile.TemporaryDirectory(prefix="linnet-page-") as scratch:
            model = write_tiny_model(Path(scratch) / "tiny") if args.quick else None
            for name in args.sections:
                run_section(SECTIONS[name], args, model, out / "results")
    print(write_page(out))


if __name__ == "__main__":
    main(sys.argv[1:])
