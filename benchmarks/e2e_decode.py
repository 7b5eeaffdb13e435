"""End-to-end generate() timing on SmolLM2-135M float32: 512 random prompt ids, 128 new tokens, batch 1.

decode tok/s = 127 / (median time of max_new_tokens=128 − median time of max_new_tokens=1);
TTFT = median time of max_new_tokens=1. Run: python benchmarks/e2e_decode.py [runs]
"""

import statistics
import sys
import time

import numpy as np

import linnet_jax


def timed(model, ids, new, runs):
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        linnet_jax.generate(model, tokens=[ids], max_new_tokens=new, ignore_eos=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(runs: int = 5):
    model = linnet_jax.load(progress=False)
    ids = np.random.default_rng(0).integers(100, 40000, 512).tolist()
    for new in (1, 128):  # warm-up: compile both programs
        linnet_jax.generate(model, tokens=[ids], max_new_tokens=new, ignore_eos=True)
    first, total = [], []
    for _ in range(runs):  # interleaved, so drift hits both alike
        first.append(timed(model, ids, 1, 1))
        total.append(timed(model, ids, 128, 1))
    ttft, full = statistics.median(first), statistics.median(total)
    step = (full - ttft) / 127
    print(f"TTFT {ttft * 1e3:.0f} ms; decode {step * 1e3:.1f} ms/step = {1 / step:.1f} tok/s (median of {runs})")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
