"""generate's decode loop on the CPU, scanned against unrolled layers, and where its time goes.

SmolLM2-135M-Instruct float32 (the embedded default), batch 1, a cache of 1024 slots holding a
512-token prompt (random ids 100..40000, seed 0), greedy, eos ignored. Each variant runs
generate's own programs: `_prefill`, then `_decode` (the on-device while_loop, the cache in its
carry) timed over --steps steps; the variants are interleaved run by run, and the median is
reported. --profile lists the XLA ops of one decode call of each variant, summed by op name.

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
import jax.numpy as jnp
import numpy as np

import linnet_jax
from linnet_jax.generate import _decode, _prefill, left_pad, make_sampling, stop_id_array
from linnet_jax.models import init_cache
from linnet_jax.models.decoder import unstack_cache
from linnet_jax.models.params import unstack_layers

PROMPT, CACHE = 512, 1024


def variants(model):
    """name -> (params, a function making a fresh empty cache) for each way of running the layers."""
    fresh = lambda: init_cache(model.config, 1, CACHE, jnp.float32)  # noqa: E731
    return {
        "scanned (stacked params and cache)": (model.params, fresh),
        "unrolled (unstack_layers, unstack_cache)": (unstack_layers(model.params), lambda: unstack_cache(fresh())),
    }


def prefilled(model, params, cache, steps):
    """The decode state after the prompt, as generate makes it."""
    ids = np.random.default_rng(0).integers(100, 40000, PROMPT).tolist()
    tokens, positions = left_pad([ids], PROMPT)
    sampling = make_sampling(1, 0.0, 0, 1.0, 0.0, 1.0, 0)
    stop_ids = stop_id_array(model, [], ignore_eos=True)
    state = _prefill(params, model.config, jnp.asarray(tokens), jnp.asarray(positions), cache, sampling, stop_ids,
                     jnp.int32(steps + 1), 256, None)
    return jax.block_until_ready(state), sampling, stop_ids


def decode_seconds(model, params, make_cache, steps):
    """Wall time of one _decode call of `steps` steps (the state is donated, so a fresh prefill each time)."""
    state, sampling, stop_ids = prefilled(model, params, make_cache(), steps)
    start = time.perf_counter()
    state = _decode(params, model.config, state, sampling, stop_ids, jnp.int32(steps + 1), jnp.int32(steps + 1), None)
    jax.block_until_ready(state)
    assert int(state.step) == steps + 1
    return time.perf_counter() - start


def op_times(model, params, make_cache, steps, top=12):
    """ms per step of the XLA ops of one profiled _decode call, summed by name (numbering dropped)."""
    state, sampling, stop_ids = prefilled(model, params, make_cache(), steps)
    with tempfile.TemporaryDirectory() as directory:
        with jax.profiler.trace(directory, create_perfetto_trace=True):
            state = _decode(params, model.config, state, sampling, stop_ids, jnp.int32(steps + 1),
                            jnp.int32(steps + 1), None)
            jax.block_until_ready(state)
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
    for params, make_cache in runs.values():  # compile
        decode_seconds(model, params, make_cache, args.steps)
    times = {name: [] for name in runs}
    for _ in range(args.runs):
        for name, (params, make_cache) in runs.items():
            times[name].append(decode_seconds(model, params, make_cache, args.steps))
    print(f"decode loop, {args.steps} steps, median of {args.runs} (interleaved):")
    for name, seconds in times.items():
        ms = statistics.median(seconds) / args.steps * 1e3
        print(f"  {name:45s} {ms:6.1f} ms/step  {1e3 / ms:5.1f} tok/s")
    if args.profile:
        for name, (params, make_cache) in runs.items():
            print(f"\n{name}: XLA ops, ms per step (count per step)")
            for op, ms, count in op_times(model, params, make_cache, args.steps):
                print(f"  {ms:7.2f}  ({count:4.0f})  {op}")


if __name__ == "__main__":
    main()
