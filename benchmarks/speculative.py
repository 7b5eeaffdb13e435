"""N-gram speculative decoding on the CPU: batch-1 greedy `linnet_jax.generate` with and without prompt lookup.

Workload: SmolLM2-135M-Instruct (float32, linnet_jax's default model), chat prompts whose answer repeats or edits
a text given in the prompt (repeat a paragraph, fix its typos, copy a function, replace a word), greedy, at most
--new-tokens new tokens (default 256), the model's eos honoured, one cache of --max-len positions (default 640) for
every call. Each mode (`plain` decoding, and `ngram_kK`: `speculative={"method": "ngram", "num_speculative_tokens": K,
"prompt_lookup_max": 4, "prompt_lookup_min": 2}`) runs every prompt once as a warm-up (compiling), then --runs
rounds (default 3), the modes interleaved within each round.

    python benchmarks/speculative.py                     # plain, K = 4 and 8, 3 rounds, 256 new tokens
    python benchmarks/speculative.py --modes plain,ngram_k4 --runs 1 --new-tokens 32 --prompts 1 --no-write  # quick

Per prompt and mode: TTFT, the median of a call with max_new_tokens=1 (the same prefill whatever the mode; measured
once per round); decode tok/s = (tokens - 1) / (median full call - median TTFT call), tokens = the new ids (eos
included when the model emitted it). Identical: every mode's ids equal plain decoding's. Acceptance, counted by
wrapping the `verify` that `linnet_jax.generate`'s module calls: accepted drafts / proposed drafts (a row's
emitted count minus one is what it accepted, at most its drafts), and tokens per verify dispatch. The table's
"all" row: total tokens over total decode time. It prints markdown tables and rewrites the block between
`<!-- speculative-table:start -->` and `<!-- speculative-table:end -->` in RESULTS.md (`--no-write` only prints;
`--json PATH` also writes one row per mode, which benchmarks/page.py renders; `--model-path` takes another model).
"""

from __future__ import annotations

import argparse
import importlib
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from harness import command_line, fmt, ratio, write_json, write_results

MARKS = ("<!-- speculative-table:start -->", "<!-- speculative-table:end -->")
MODES = ("plain", "ngram_k4", "ngram_k8")

PARAGRAPH = ("The river ran quietly past the old mill, where the miller's daughter kept a small garden of herbs and "
             "late roses. Every morning she carried water up from the river in two wooden buckets, and every evening "
             "she sat on the stone wall to watch the boats drift down towards the town. Travellers who stopped at the "
             "mill were given bread, cheese and a cup of cider, and in return they told her about the places they had "
             "seen: the harbour with its forest of masts, the cathedral whose bells could be heard for ten miles, and "
             "the market where merchants sold silk, pepper and glass from countries she could only imagine.")
TYPOS = ("Teh committee met on Tuesday to dicsuss the new budget for the libary. After a long debate, the members "
         "agreed to increse the funds for childrens books and to open the reading room on Sundya afternoons. The "
         "treasurer warned that the roof would need repairs before winter, and she asked the volunteers to help "
         "organise a fundraising fair in the spring. Everyone agred that the fair should include a book sale, a "
         "bake sale and a concert by the school choir.")
CODE = '''def moving_average(values, window):
    """The mean of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    averages = []
    total = sum(values[:window])
    averages.append(total / window)
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        averages.append(total / window)
    return averages'''
PROMPTS = {
    "repeat": f"Repeat the following paragraph exactly, word for word:\n\n{PARAGRAPH}",
    "fix typos": f"Fix the typos in the following paragraph. Reply with the corrected paragraph only.\n\n{TYPOS}",
    "copy code": f"Copy this Python function exactly, then stop:\n\n```python\n{CODE}\n```",
    "replace word": ("Rewrite the following paragraph, replacing every occurrence of the word \"river\" with \"canal\". "
                     f"Change nothing else.\n\n{PARAGRAPH}"),
}


class Counting:
    """Wraps the `verify` that linnet_jax.generate's module calls: proposed and accepted drafts, dispatches."""

    def __init__(self):
        self.module = importlib.import_module("linnet_jax.generate")
        self.verify = self.module.verify
        self.proposed = self.accepted = self.calls = self.emitted = 0

    def __enter__(self) -> Counting:
        def counted(params, config, slots, drafts, n_drafts, *args, **kwargs):
            slots, emitted = self.verify(params, config, slots, drafts, n_drafts, *args, **kwargs)
            counts, n = np.asarray(emitted.count), np.asarray(n_drafts)
            self.calls += 1
            self.proposed += int(n.sum())
            self.accepted += int(np.minimum(np.maximum(counts - 1, 0), n).sum())
            self.emitted += int(counts.sum())
            return slots, emitted

        self.module.verify = counted
        return self

    def __exit__(self, *exc) -> None:
        self.module.verify = self.verify


def speculative_config(mode: str) -> dict | None:
    """A mode's `speculative=` argument: None for plain, the n-gram config with K drafts for ngram_kK."""
    if mode == "plain":
        return None
    return {"method": "ngram", "num_speculative_tokens": int(mode.removeprefix("ngram_k")), "prompt_lookup_max": 4,
            "prompt_lookup_min": 2}


def label(mode: str) -> str:
    """A mode's row label on the page."""
    what = "plain decoding" if mode == "plain" else f"n-gram speculative, k={mode.removeprefix('ngram_k')}"
    return f"linnet_jax `generate()`, {what} (repeat/edit prompts)"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=256, help="max_new_tokens (default 256)")
    parser.add_argument("--max-len", type=int, default=640, help="cache positions of every call (default 640)")
    parser.add_argument("--runs", type=int, default=3, help="timed rounds after the warm-up (default 3)")
    parser.add_argument("--modes", type=lambda s: list(dict.fromkeys(s.split(","))), default=list(MODES),
                        help=f"comma-separated: plain (needed: the reference) and ngram_kK for K drafts "
                             f"(default {','.join(MODES)})")
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help="use the first N prompts (default all)")
    parser.add_argument("--model-path", type=Path, help="a GGUF file or HF directory (default: SmolLM2's GGUF)")
    parser.add_argument("--no-write", action="store_true", help="print the tables only; leave RESULTS.md alone")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write one row per mode as JSON to PATH")
    args = parser.parse_args(argv)
    if "plain" not in args.modes or any(not re.fullmatch(r"plain|ngram_k[1-9]\d*", m) for m in args.modes):
        parser.error(f"--modes wants plain and ngram_kK (K ≥ 1) names, with plain among them, not {args.modes}")
    if args.runs < 1 or args.new_tokens < 2:
        parser.error("need --runs ≥ 1 and --new-tokens ≥ 2")
    return args


def measure(args: argparse.Namespace, model) -> tuple[dict, dict, dict, dict]:
    """Every prompt in every mode, a warm-up round then --runs rounds: (TTFT seconds by prompt, full-call seconds
    by (prompt, mode), ids by (prompt, mode), Counting by mode)."""
    import linnet_jax

    prompts = dict(list(PROMPTS.items())[:args.prompts])

    def call(prompt: str, speculative, new_tokens: int):
        conversation = [{"role": "user", "content": prompt}]
        start = time.perf_counter()
        result = linnet_jax.generate(model, conversation, new_tokens, max_len=args.max_len, speculative=speculative,
                                     return_details=True)
        return time.perf_counter() - start, result

    ttft = {name: [] for name in prompts}
    full = {(name, mode): [] for name in prompts for mode in args.modes}
    ids, counters = {}, {mode: Counting() for mode in args.modes}
    started = time.perf_counter()
    for round_ in range(args.runs + 1):  # round 0: the warm-up
        for name, prompt in prompts.items():
            seconds, _ = call(prompt, None, 1)
            if round_:
                ttft[name].append(seconds)
            for mode in args.modes:
                with counters[mode] if round_ else Counting():
                    seconds, result = call(prompt, speculative_config(mode), args.new_tokens)
                tokens = result.tokens + ([-1] if result.stop_reason == "eos" else [])  # -1: the eos, counted
                if round_:
                    full[name, mode].append(seconds)
                    if ids.get((name, mode), tokens) != tokens:
                        print(f"! {name}, {mode}: round {round_}'s ids differ from round 1's", file=sys.stderr)
                ids[name, mode] = tokens
        print(f"round {round_} done ({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    return ttft, full, ids, counters


def decode_rates(args, ttft, full, ids) -> dict[str, dict[str, tuple[int, float]]]:
    """(decoded tokens, decode seconds) by prompt and by mode: a prompt's median full call minus its median TTFT."""
    return {name: {mode: (len(ids[name, mode]) - 1, statistics.median(full[name, mode]) - statistics.median(times))
                   for mode in args.modes} for name, times in ttft.items()}


def rows(args, ids, counters, decoded) -> list[dict]:
    """One JSON row per mode: decode tok/s over all prompts, its ratio to plain, identity and acceptance."""
    rate = {mode: sum(decoded[n][mode][0] for n in decoded) / sum(decoded[n][mode][1] for n in decoded)
            for mode in args.modes}
    made = []
    for mode in args.modes:
        c = counters[mode]
        row = {"name": mode, "label": label(mode), "decode_tok_s": rate[mode],
               "speedup": ratio(rate[mode], rate["plain"]), "identical": all(ids[n, mode] == ids[n, "plain"] for n in decoded)}
        if mode != "plain":
            row |= {"acceptance": c.accepted / max(c.proposed, 1), "tokens_per_dispatch": c.emitted / max(c.calls, 1),
                    "verify_dispatches": c.calls, "drafts_proposed": c.proposed, "drafts_accepted": c.accepted}
        made.append(row)
    return made


def markdown_row(cells: list) -> str:
    return "| " + " | ".join(map(str, cells)) + " |"


def report(args, ttft, ids, decoded, made: list[dict], command: str) -> str:
    """The markdown: per prompt and overall decode tok/s by mode, then each speculative mode's acceptance."""
    speculative = [row for row in made if row["name"] != "plain"]
    header = ["prompt", "new tokens", "TTFT", *(f"{m} tok/s" for m in args.modes),
              *(f"{row['name']} ×" for row in speculative), "ids identical"]
    lines = [f"SmolLM2-135M-Instruct float32, batch 1, greedy, ≤ {args.new_tokens} new tokens, max_len {args.max_len}, "
             f"median of {args.runs} after a warm-up. Command: `{command}`", "", markdown_row(header),
             "|---" * len(header) + "|"]
    for name, by_mode in decoded.items():
        rates = {mode: tokens / seconds for mode, (tokens, seconds) in by_mode.items()}
        same = all(ids[name, mode] == ids[name, "plain"] for mode in args.modes)
        lines.append(markdown_row([name, len(ids[name, "plain"]), f"{statistics.median(ttft[name]) * 1e3:,.0f} ms",
                                   *(f"{rates[m]:.1f}" for m in args.modes),
                                   *(fmt(ratio(rates[row["name"]], rates["plain"]), "{:.2f}×") for row in speculative),
                                   "yes" if same else "NO"]))
    lines.append(markdown_row(["all", sum(len(ids[n, "plain"]) for n in decoded), "–",
                               *(f"{row['decode_tok_s']:.1f}" for row in made),
                               *(fmt(row["speedup"], "{:.2f}×") for row in speculative),
                               "yes" if all(row["identical"] for row in made) else "NO"]))
    lines += ["", "| mode | verify dispatches | tokens per dispatch | drafts proposed | accepted | acceptance |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {row['name']} | {row['verify_dispatches']} | {row['tokens_per_dispatch']:.2f} | "
              f"{row['drafts_proposed']} | {row['drafts_accepted']} | {row['acceptance']:.1%} |" for row in speculative]
    return "\n".join([*lines, "", "(counts over the timed rounds; prompts' texts in benchmarks/speculative.py)"])


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    import linnet_jax

    started = time.perf_counter()
    model = linnet_jax.load(args.model_path, progress=False)
    print(f"loaded in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    ttft, full, ids, counters = measure(args, model)
    decoded = decode_rates(args, ttft, full, ids)
    made = rows(args, ids, counters, decoded)
    command = command_line("speculative.py", argv)
    section = report(args, ttft, ids, decoded, made, command)
    print(section)
    for name in decoded:
        text = model.tokenizer.decode([t for t in ids[name, "plain"] if t >= 0])
        print(f"\n[{name}] {text[:300]!r}{'…' if len(text) > 300 else ''}", file=sys.stderr)
    if args.json:
        write_json(args.json, "speculative", made, args, command)
    if not args.no_write:
        write_results(f"## Speculative decoding, batch 1\n\n{section}", marks=MARKS)


if __name__ == "__main__":
    main(sys.argv[1:])
