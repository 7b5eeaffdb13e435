"""N-gram speculative decoding on the CPU: batch-1 greedy `linnet_jax.generate` with and without prompt lookup.

Workload: SmolLM2-135M-Instruct (float32, linnet_jax's default model), chat prompts whose answer repeats or edits
a text given in the prompt (repeat a paragraph, fix its typos, copy a function, replace a word), greedy, at most
--new-tokens new tokens (default 256), the model's eos honoured, one cache of --max-len positions (default 640) for
every call. Each mode (plain decoding, then `speculative={"method": "ngram", "num_speculative_tokens": K,
"prompt_lookup_max": 4, "prompt_lookup_min": 2}` for each K of --k) runs every prompt once as a warm-up (compiling),
then --runs rounds (default 3), the modes interleaved within each round.

    python benchmarks/speculative.py                     # K = 4 and 8, 3 rounds, 256 new tokens
    python benchmarks/speculative.py --k 4 --runs 1 --new-tokens 32 --prompts 1   # a quick check

Per prompt and mode: TTFT, the median of a call with max_new_tokens=1 (the same prefill whatever the mode; measured
once per round); decode tok/s = (tokens - 1) / (median full call - median TTFT call), tokens = the new ids (eos
included when the model emitted it). Identical: every mode's ids equal plain decoding's. Acceptance, counted by
wrapping the `verify` that `linnet_jax.generate`'s module calls: accepted drafts / proposed drafts (a row's
emitted count minus one is what it accepted, at most its drafts), and tokens per verify dispatch. The table's
"all" row: total tokens over total decode time.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time

import numpy as np

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


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=256, help="max_new_tokens (default 256)")
    parser.add_argument("--max-len", type=int, default=640, help="cache positions of every call (default 640)")
    parser.add_argument("--runs", type=int, default=3, help="timed rounds after the warm-up (default 3)")
    parser.add_argument("--k", type=lambda s: [int(k) for k in s.split(",")], default=[4, 8],
                        help="num_speculative_tokens values, comma-separated (default 4,8)")
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help="use the first N prompts (default all)")
    return parser.parse_args(argv)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    import linnet_jax

    started = time.perf_counter()
    model = linnet_jax.load(progress=False)
    print(f"loaded in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    prompts = dict(list(PROMPTS.items())[:args.prompts])
    modes = {"plain": None} | {f"ngram k={k}": {"method": "ngram", "num_speculative_tokens": k,
                                                "prompt_lookup_max": 4, "prompt_lookup_min": 2} for k in args.k}

    def call(prompt: str, speculative, new_tokens: int):
        conversation = [{"role": "user", "content": prompt}]
        start = time.perf_counter()
        result = linnet_jax.generate(model, conversation, new_tokens, max_len=args.max_len, speculative=speculative,
                                     return_details=True)
        return time.perf_counter() - start, result

    ttft = {name: [] for name in prompts}
    full = {(name, mode): [] for name in prompts for mode in modes}
    ids, counters = {}, {mode: Counting() for mode in modes}
    for round_ in range(args.runs + 1):  # round 0: the warm-up
        for name, prompt in prompts.items():
            seconds, _ = call(prompt, None, 1)
            if round_:
                ttft[name].append(seconds)
            for mode, speculative in modes.items():
                with counters[mode] if round_ else Counting():
                    seconds, result = call(prompt, speculative, args.new_tokens)
                tokens = result.tokens + ([-1] if result.stop_reason == "eos" else [])  # -1: the eos, counted
                if round_:
                    full[name, mode].append(seconds)
                    if ids.get((name, mode), tokens) != tokens:
                        print(f"! {name}, {mode}: round {round_}'s ids differ from round 1's", file=sys.stderr)
                ids[name, mode] = tokens
        print(f"round {round_} done ({time.perf_counter() - started:.0f} s)", file=sys.stderr)

    print(f"\nSmolLM2-135M-Instruct float32, batch 1, greedy, ≤ {args.new_tokens} new tokens, max_len {args.max_len}, "
          f"median of {args.runs} after a warm-up\n")
    print("| prompt | new tokens | TTFT | " + " | ".join(f"{m} tok/s" for m in modes) + " | "
          + " | ".join(f"{m} ×" for m in list(modes)[1:]) + " | ids identical |")
    print("|---" * (3 + 2 * len(modes)) + "|")
    totals = {mode: [0, 0.0] for mode in modes}
    for name in prompts:
        first = statistics.median(ttft[name])
        n = len(ids[name, "plain"])
        rates = {}
        for mode in modes:
            decode_s = statistics.median(full[name, mode]) - first
            rates[mode] = (len(ids[name, mode]) - 1) / decode_s
            totals[mode][0] += len(ids[name, mode]) - 1
            totals[mode][1] += decode_s
        same = all(ids[name, mode] == ids[name, "plain"] for mode in modes)
        print(f"| {name} | {n} | {first * 1e3:,.0f} ms | " + " | ".join(f"{rates[m]:.1f}" for m in modes) + " | "
              + " | ".join(f"{rates[m] / rates['plain']:.2f}×" for m in list(modes)[1:]) + f" | {'yes' if same else 'NO'} |")
    rates = {mode: tokens / seconds for mode, (tokens, seconds) in totals.items()}
    print(f"| all | {sum(len(ids[n, 'plain']) for n in prompts)} | – | " + " | ".join(f"{rates[m]:.1f}" for m in modes)
          + " | " + " | ".join(f"{rates[m] / rates['plain']:.2f}×" for m in list(modes)[1:]) + " | – |")
    print("\n| mode | verify dispatches | tokens per dispatch | drafts proposed | accepted | acceptance |")
    print("|---|---|---|---|---|---|")
    for mode in list(modes)[1:]:
        c = counters[mode]
        print(f"| {mode} | {c.calls} | {c.emitted / max(c.calls, 1):.2f} | {c.proposed} | {c.accepted} | "
              f"{c.accepted / max(c.proposed, 1):.1%} |")
    print("\n(counts over the timed rounds; prompts' texts in this file)")
    for name in prompts:
        text = model.tokenizer.decode([t for t in ids[name, "plain"] if t >= 0])
        print(f"\n[{name}] {text[:300]!r}{'…' if len(text) > 300 else ''}", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
