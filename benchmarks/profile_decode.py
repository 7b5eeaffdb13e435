"""The decode core's loop on the CPU over each platform's weights, and where its time goes.

SmolLM2-135M-Instruct float32 (the embedded default), batch 1, a cache of 640 slots holding a
512-token prompt (random ids 100..40000, seed 0), greedy, eos ignored. Each variant runs the
decode core's own programs (`linnet_jax.decode`): `extend` (the prompt), then `decode` (the
on-device while_loop) timed over --steps steps, with the weights and products as a hardware plan
(`linnet_jax.backend.Plan`) gives them: this machine's plan (per-layer views and, on one CPU device, the
matrix-vector kernels), per-layer views with XLA's products, or the stacked arrays sliced inside the
program (GPUs' and TPUs'). The variants are interleaved run by run, and
the median is reported. --profile lists the XLA ops of one decode call of each variant, summed by
op name. --products times each of a layer's matrix-vector products alone, read from memory as decode
reads them (cycled through enough copies to miss every cache), with XLA:CPU's default kernels, with
YNNPACK's (`compiler_options`) and with linnet's (`ops.matvec`), and how many cores each keeps busy (CPU time
over wall time).

--quantize int8 runs the model loaded with `quantize="int8"`.

    python benchmarks/profile_decode.py [--steps 64] [--runs 5] [--profile] [--products] [--quantize int8]
"""

import argparse
import collections
import dataclasses
import gzip
import json
import re
import resource
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from harness import median, timed

import linnet_jax
from linnet_jax.decode import choose_first, decode, extend
from linnet_jax.inputs import make_requests, make_sampling, new_slots, stop_id_array
from linnet_jax.models.config import QUANTIZE
from linnet_jax.models.params import unstack_layers
from linnet_jax.ops import matvec

PROMPT, CACHE = 512, 640  # benchmarks/decode.py's protocol: 512 prompt ids + 128 new
PRODUCT_BYTES = 256e6  # each product is cycled through this many bytes of copies: none stays in a cache
KERNELS = {"XLA:CPU default": (jax.numpy.einsum, None),  # name: (the product's einsum, XLA compiler options)
           "YNNPACK dots": (jax.numpy.einsum, {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"}),
           "linnet kernels": (matvec.einsum, None)}


def variants(model):
    """name -> (params, plan), for each way the plan can hand the weights and products to the programs."""
    plan = model.plan
    xla = dataclasses.replace(plan, matvec_kernels=False)
    stacked = dataclasses.replace(xla, unstacked_layers=False)
    return {"the plan's (per-layer views, kernels)": (model.decode_params, plan),
            "per-layer views, XLA's products": (unstack_layers(model.params, views=True), xla),
            "stacked (GPU/TPU: sliced in the program)": (model.params, stacked)}


def prefilled(model, params, plan, steps):
    """A one-row decode state holding the prompt and its first token."""
    ids = np.random.default_rng(0).integers(100, 40000, PROMPT).tolist()
    request = make_requests(make_sampling(1, 0.0, 0, 1.0, 0.0, 1.0, 0), stop_id_array(model, [], ignore_eos=True),
                            steps + 1)
    row, one = np.zeros(1, np.int32), np.ones(1, bool)
    slots, logits = extend(params, model.config, new_slots(model, 1, CACHE), row, np.asarray([ids], np.int32), row,
                           np.full(1, PROMPT, np.int32), request, one, plan=plan)
    return jax.block_until_ready(choose_first(slots, row, logits))


def run_decode(model, params, plan, slots, steps):
    slots, emitted = decode(params, model.config, slots, np.int32(steps), steps, plan=plan)
    jax.block_until_ready(emitted)
    assert int(emitted.count[0]) == steps
    return slots


def decode_seconds(model, params, plan, steps):
    """Wall time of one decode call of `steps` steps (the state is donated, so a fresh prefill each time)."""
    return timed(run_decode, model, params, plan, prefilled(model, params, plan, steps), steps)[0]


def op_times(model, params, plan, steps, top=12):
    """ms per step of the XLA ops of one profiled decode call, summed by name (numbering dropped)."""
    slots = prefilled(model, params, plan, steps)
    with tempfile.TemporaryDirectory() as directory:
        with jax.profiler.trace(directory, create_perfetto_trace=True):
            run_decode(model, params, plan, slots, steps)
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


def product_shapes(model) -> dict[str, tuple[int, int]]:
    """Each decode product of one layer, and the lm head, as (inputs, outputs) of one matrix-vector product."""
    config = model.config
    d, h, g, k, f = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim, config.intermediate_size
    return {"wq": (d, h * k), "wk, wv": (d, g * k), "wo": (h * k, d), "w_gate, w_up": (d, f), "w_down": (f, d),
            "lm head (vd)": (d, config.vocab_size)}


def product_time(inputs: int, outputs: int, einsum, options, head: bool) -> tuple[float, float]:
    """(seconds per product, cores busy) of x[1, inputs] @ W over distinct copies of W, in one program.
    W is [inputs, outputs] (our layers' layout) or [outputs, inputs] for the head."""
    copies = max(2, int(PRODUCT_BYTES // (inputs * outputs * 4)))
    shape = (outputs, inputs) if head else (inputs, outputs)
    weights = [jax.numpy.full(shape, 0.01 * (i + 1), jax.numpy.float32) for i in range(copies)]
    spec = "bi,oi->bo" if head else "bi,io->bo"

    @jax.jit(compiler_options=options)
    def chain(x, weights):
        for w in weights:  # each product's input depends on the last: they run one after another
            x = x.at[:, :1].add(einsum(spec, x, w)[:, :1] * 1e-9)
        return x

    x = jax.numpy.ones((1, inputs), jax.numpy.float32)
    jax.block_until_ready(chain(x, weights))
    best = (float("inf"), 0.0)
    for _ in range(5):
        cpu, start = resource.getrusage(resource.RUSAGE_SELF).ru_utime, time.perf_counter()
        jax.block_until_ready(chain(x, weights))
        wall, cpu = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_utime - cpu
        best = min(best, (wall / copies, cpu / wall))
    return best


def print_products(model):
    print("\nmatrix-vector products alone, from memory (best of 5):")
    print(f"  {'product':14s} {'shape':>12s} {'MB':>6s}  " + "  ".join(f"{name:>28s}" for name in KERNELS))
    for name, (inputs, outputs) in product_shapes(model).items():
        mb = inputs * outputs * 4 / 1e6
        cells = []
        for einsum, options in KERNELS.values():
            seconds, cores = product_time(inputs, outputs, einsum, options, head=name.startswith("lm head"))
            cells.append(f"{seconds * 1e6:7.0f} us {mb / 1e3 / seconds:5.1f} GB/s {cores:4.2f} cores")
        print(f"  {name:14s} {f'{inputs}x{outputs}':>12s} {mb:6.2f}  " + "  ".join(f"{c:>28s}" for c in cells))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--products", action="store_true", help="time each product alone (and only that)")
    parser.add_argument("--quantize", default=None, choices=QUANTIZE, help="the model's weights, as load takes it")
    args = parser.parse_args()
    model = linnet_jax.load(progress=False, quantize=args.quantize)
    if args.products:
        return print_products(model)
    runs = variants(model)
    for params, plan in runs.values():  # compile
        decode_seconds(model, params, plan, args.steps)
    times = {name: [] for name in runs}
    for _ in range(args.runs):
        for name, (params, plan) in runs.items():
            times[name].append(decode_seconds(model, params, plan, args.steps))
    print(f"decode loop, {args.steps} steps, median of {args.runs} (interleaved):")
    for name, seconds in times.items():
        ms = median(seconds) / args.steps * 1e3
        print(f"  {name:45s} {ms:6.1f} ms/step  {1e3 / ms:5.1f} tok/s")
    if args.profile:
        for name, (params, plan) in runs.items():
            print(f"\n{name}: XLA ops, ms per step (count per step)")
            for op, ms, count in op_times(model, params, plan, args.steps):
                print(f"  {ms:7.2f}  ({count:4.0f})  {op}")


if __name__ == "__main__":
    main()
