"""Batched prefill's two shapes: prompts padded to rows of a bucket, or packed into one row (segment ids).

    python benchmarks/prefill_shapes.py [--tokens 256] [--runs 5]

SmolLM2-135M-Instruct float32, the engine's own `extend` on a 16-slot state of 640 positions. The same number
of tokens (--tokens) goes in as R rows of tokens/R (R = 1, 2, 4: what padded rows cost per real token when
nothing is padding) and as one row of all of them (what a packed row costs, before the attention mask
that keeps its segments apart, which only adds). Median of --runs after a warm-up. If the shapes cost the
same per token, packing can only save the padding of padded rows, and packed rows need each query to read
its own slot's cache (ragged attention) where padded rows read their own row's.
"""

import argparse
import statistics
import time

import jax
import numpy as np

import linnet_jax
from linnet_jax.inputs import extend_rows, new_slots, sampling_options


def timed_extend(model, rows: int, width: int, runs: int) -> float:
    request = sampling_options(model, 1).requests(1)
    ids = np.random.default_rng(0).integers(100, 40000, (rows, width)).tolist()
    slots = new_slots(model, 16, 640)
    times = []
    for _ in range(runs + 1):
        start = time.perf_counter()
        slots = extend_rows(model, slots, list(range(rows)), ids, [0] * rows, [request] * rows, [True] * rows)
        jax.block_until_ready(slots.token)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    model = linnet_jax.load(progress=False)
    print("| shape | seconds | ms per token |\n|---|---|---|")
    for rows in (1, 2, 4):
        seconds = timed_extend(model, rows, args.tokens // rows, args.runs)
        print(f"| {rows} × {args.tokens // rows} | {seconds:.3f} | {seconds / args.tokens * 1e3:.2f} |")


if __name__ == "__main__":
    main()
