"""Speculative decoding by prompt lookup (n-gram) against plain decoding: batch-1 greedy `generate` on SmolLM2.

    python benchmarks/speculative.py [--new 192] [--runs 3] [--k 4,8]

SmolLM2-135M-Instruct float32 (the embedded default), greedy, eos ignored, one prompt at a time. The prompts ask
to repeat or edit a given text (the workload prompt lookup is for: the answer quotes the context). Each prompt
runs plain and with `speculative={"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
"prompt_lookup_min": 2}`, interleaved, the median of --runs after a warm-up call of each. Decode tok/s =
(new - 1) / (the full call - a one-token call), so that prefill is not counted. The tokens must be identical
(the script fails otherwise). The acceptance rate is accepted drafts / proposed drafts, counted by wrapping
`linnet_jax.generate`'s `verify`. Prints a markdown table (the numbers benchmarks/RESULTS.md keeps).
"""

import argparse
import importlib
import statistics
import time

import linnet_jax

PARAGRAPH = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a can of oil and a "
             "cloth for the lens. From the gallery he could see the fishing boats returning to the harbour, their "
             "lanterns bobbing on the dark water, and the long line of cliffs that ran north toward the village.")
PROMPTS = {
    "repeat": f"Repeat the following paragraph exactly, word for word:\n\n{PARAGRAPH}",
    "edit": f"Rewrite the following paragraph in the present tense, changing nothing else:\n\n{PARAGRAPH}",
    "typos": "Fix the spelling mistakes in this text and return the whole corrected text:\n\n"
             + PARAGRAPH.replace("lighthouse", "lighthuose").replace("harbour", "harbuor").replace("village", "vilage"),
}


class DraftCounter:
    """Wraps `linnet_jax.generate`'s verify: drafts proposed and accepted (batch 1: a row emits its accepted
    drafts and one token more)."""

    def __init__(self):
        self.module = importlib.import_module("linnet_jax.generate")
        self.verify, self.proposed, self.accepted = self.module.verify, 0, 0
        self.module.verify = self.counted

    def counted(self, params, config, slots, drafts, n_drafts, *args, **kwargs):
        slots, emitted = self.verify(params, config, slots, drafts, n_drafts, *args, **kwargs)
        self.proposed += int(n_drafts.sum())
        self.accepted += int(emitted.count.sum()) - int((n_drafts >= 0).sum())
        return slots, emitted


def timed(model, prompt: str, new: int, speculative) -> tuple[float, list[int]]:
    start = time.perf_counter()
    result = linnet_jax.generate(model, prompt, max_new_tokens=new, ignore_eos=True, return_details=True,
                                 speculative=speculative)
    return time.perf_counter() - start, result.tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new", type=int, default=192, help="new tokens per call (default 192)")
    parser.add_argument("--runs", type=int, default=3, help="timed runs per setting (default 3)")
    parser.add_argument("--k", default="4,8", help="num_speculative_tokens to try (default 4,8)")
    args = parser.parse_args()
    model = linnet_jax.load(progress=False)
    settings = {"plain": None} | {f"ngram k={k}": {"method": "ngram", "num_speculative_tokens": int(k),
                                                   "prompt_lookup_max": 4, "prompt_lookup_min": 2}
                                  for k in args.k.split(",")}
    counter = DraftCounter()
    print("| prompt | setting | decode tok/s | speed-up | acceptance | identical tokens |\n|---|---|---|---|---|---|")
    for name, prompt in PROMPTS.items():
        rates, tokens, acceptance = {}, {}, {}
        for setting, speculative in settings.items():
            timed(model, prompt, args.new, speculative), timed(model, prompt, 1, speculative)  # warm-up
        for setting, speculative in settings.items():
            counter.proposed = counter.accepted = 0
            runs = []
            for _ in range(args.runs):
                full, tokens[setting] = timed(model, prompt, args.new, speculative)
                one, _ = timed(model, prompt, 1, speculative)
                runs.append((args.new - 1) / (full - one))
            rates[setting] = statistics.median(runs)
            acceptance[setting] = counter.accepted / counter.proposed if counter.proposed else None
        for setting in settings:
            same = tokens[setting] == tokens["plain"]
            assert same, f"{name}, {setting}: tokens differ from plain decoding"
            rate = acceptance[setting]
            print(f"| {name} | {setting} | {rates[setting]:.1f} | {rates[setting] / rates['plain']:.2f}× | "
                  f"{'–' if rate is None else f'{rate:.0%}'} | {same} |")


if __name__ == "__main__":
    main()
