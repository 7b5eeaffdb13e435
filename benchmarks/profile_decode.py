"""The decode core's loop on the CPU over each platform's weights, and where its time goes.

SmolLM2-135M-Instruct float32 (the embedded default), batch 1, a cache of 1024 slots holding a
512-token prompt (random ids 100..40000, seed 0), greedy, eos ignored. Each variant runs the
decode core's own programs (`linnet_jax.decode`): `prefill` and `insert`, then `decode` (the
on-device while_loop) timed over --steps steps, with the weights as the platform switch
(`models.params.unstacks_layers`) gives them: per-layer views (XLA:CPU's choice) or the stacked
arrays sliced inside the program (GPUs' and TPUs'). The variants are interleaved run by run, and
the median is reported. --profile lists the XLA ops of one decode call of each variant, summed by
op name.

    python benchmarks/profile_decode.py [--steps 64] [--runs 5] [--profile]
"""

import argparse
import collections
import gzip
import json
import re
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

import linnet_jax
from linnet_jax.decode import decode, insert, prefill
from linnet_jax.generate import left_pad, make_requests, make_sampling, new_slots, stop_id_array
from linnet_jax.models.params import unstack_layers

PROMPT, CACHE = 512, 1024


def variants(model):
    """name -> params, for each way the switch can hand the weights to the programs."""
    return {"stacked (GPU/TPU: sliced in the program)": model.params,
            "per-layer views (XLA:CPU, unstack_layers)": unstack_layers(model.params)}


def prefilled(model, params, steps):
    """A one-row decode state holding the prompt and its first token."""
    ids = np.random.default_rng(0).integers(100, 40000, PROMPT).tolist()
    tokens, positions = left_pad([ids], PROMPT)
    request = make_requests(make_sampling(1, 0.0, 0, 1.0, 0.0, 1.0, 0), stop_id_array(model, [], ignore_eos=True),
                            steps + 1)
    slots = insert(prefill(params, model.config, tokens, positions, request, CACHE), new_slots(model, 1, CACHE), 0)
    return jax.block_until_ready(slots)


def run_decode(model, params, slots, steps):
    slots, emitted = decode(params, model.config, slots, np.int32(steps), steps)
    jax.block_until_ready(emitted)
    assert int(emitted.count[0]) == steps
    return slots


def decode_seconds(model, params, steps):
    """Wall time of one decode call of `steps` steps (the state is donated, so a fresh prefill each time)."""
    slots = prefilled(model, params, steps)
    start = time.perf_counter()
    run_decode(model, params, slots, steps)
    return time.perf_counter() - start


def op_times(model, params, steps, top=12):
    """ms per step of the XLA ops of one profiled decode call, summed by name (numbering dropped)."""
    slots = prefilled(model, params, steps)
    with tempfile.TemporaryDirectory() as directory:
        with jax.profiler.trace(directory, create_perfetto_trace=True):
            run_decode(model, params, slots, steps)
        trace = next(Path(directory).rglob("*.trace.json.gz"))
        events = json.load(gzip.open(trace))["traceEvents"]
    totals, counts = collections.Counter(), collections.Counter()
    for event in events:
        name = event.get("name", "")
        if event.get("ph") == "X" and not name.startswith(("$", "end:", "Thunk")) and "PjRt" not in name:
            op = re.sub(r"\.\d+$", "", name)
            totals[op] += event.get("dur", 0)
            counts[op] += 1
    return [(op, us / steps / 1e3, counts[op] / steps) for op, us in totals.most_common(top)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    model = linnet_jax.load(progress=False)
    runs = variants(model)
    for params in runs.values():  # compile
        decode_seconds(model, params, args.steps)
    times = {name: [] for name in runs}
    for _ in range(args.runs):
        for name, params in runs.items():
            times[name].append(decode_seconds(model, params, args.steps))
    print(f"decode loop, {args.steps} steps, median of {args.runs} (interleaved):")
    for name, seconds in times.items():
        ms = statistics.median(seconds) / args.steps * 1e3
        print(f"  {name:45s} {ms:6.1f} ms/step  {1e3 / ms:5.1f} tok/s")
    if args.profile:
        for name, params in runs.items():
            print(f"\n{name}: XLA ops, ms per step (count per step)")
            for op, ms, count in op_times(model, params, args.steps):
                print(f"  {ms:7.2f}  ({count:4.0f})  {op}")


if __name__ == "__main__":
    main()
