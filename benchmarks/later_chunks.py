"""A prompt's later chunks: attention over the slots the chunk sees (the plan's `key_block`) against all max_len.

    python benchmarks/later_chunks.py [--max-len 640] [--rows 4] [--widths 64,192,256] [--starts 128,256] [--runs 7]

SmolLM2-135M-Instruct float32, the engine's own `extend_rows` on a state of --rows slots of --max-len positions:
--rows chunks of `width` tokens (the last 8 of them padding) continuing prompts at `start`, through the CPU plan
(attention over the fewest of 128, 256, 512, .. slots that hold the chunk's keys, `ops.attention.key_spans`) and
through the same plan without key_block (all slots), alternating, one process. Median of --runs after a first call
that compiles (its time is printed: a key_block program compiles one branch per span).
"""

import argparse
import dataclasses
import statistics
import time

import jax
import numpy as np

import linnet_jax
from linnet_jax.inputs import extend_rows, new_slots, sampling_options
from linnet_jax.ops.attention import key_spans


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-len", type=int, default=640)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--widths", default="64,192,256")
    parser.add_argument("--starts", default="128,256")
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    spanned = linnet_jax.load(progress=False)
    every = dataclasses.replace(spanned)  # a fresh Model, its plan (a cached property) preset to read all slots
    every.__dict__["plan"] = dataclasses.replace(spanned.plan, key_block=None)
    variants = {"spans": spanned, "all slots": every}
    states = {name: new_slots(model, args.rows, args.max_len) for name, model in variants.items()}
    request = sampling_options(spanned, 1).requests(1)
    rng = np.random.default_rng(0)

    def timed(name: str, width: int, start: int) -> float:
        chunks = rng.integers(100, 40000, (args.rows, width - 8)).tolist()
        began = time.perf_counter()
        states[name] = extend_rows(variants[name], states[name], list(range(args.rows)), chunks, [start] * args.rows,
                                   [request] * args.rows, [False] * args.rows, args.rows, width)
        jax.block_until_ready(states[name])
        return time.perf_counter() - began

    print("| chunk | start | spans compiled | first call, spans / all | spans | all slots | ratio |")
    print("|---|---|---|---|---|---|---|")
    for width in map(int, args.widths.split(",")):
        for start in map(int, args.starts.split(",")):
            first = {name: timed(name, width, start) for name in variants}
            times = {name: [] for name in variants}
            for _ in range(args.runs):
                for name in variants:
                    times[name].append(timed(name, width, start))
            spans, whole = (statistics.median(times[name]) for name in variants)
            print(f"| {args.rows} × {width} | {start} | {key_spans(width, args.max_len, spanned.plan.key_block)} | "
                  f"{first['spans']:.1f} / {first['all slots']:.1f} s | {1e3 * spans:.0f} ms | {1e3 * whole:.0f} ms | "
                  f"**{whole / spans:.2f}×** |", flush=True)


if __name__ == "__main__":
    main()
