"""Runs sharded cases on 8 fake CPU devices and prints one JSON line of results; tests/test_sharding.py starts it.

    python tests/sharding_worker.py tiny DIR     # a tiny HF directory whose heads divide
    python tests/sharding_worker.py smollm2      # the embedded default model

Each case places the model on a mesh, generates greedily and takes full-forward logits; the
results are compared with the same model on one device by the test.
"""

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

import linnet_jax  # noqa: E402
from batches import right_padded  # noqa: E402
from linnet_jax import sharding  # noqa: E402
from linnet_jax.models.params import flatten_params, param_axes  # noqa: E402

NEW_TOKENS = {"tiny": 12, "smollm2": 8}
PROMPTS = 8  # one per device of the largest data axis


def prompts(vocab: int) -> list[list[int]]:
    """PROMPTS prompts of different lengths (3 to 17 ids)."""
    return [np.random.default_rng(row).integers(0, vocab, 3 + 2 * row).tolist() for row in range(PROMPTS)]


def top2_gap(model, row: list[int]) -> float:
    """The gap between the two largest next-token logits after row (a near tie when tiny)."""
    last = np.sort(np.asarray(linnet_jax.logits(model, row))[0, -1])
    return float(last[-1] - last[-2])


def near_tie(reference, rows, expected, got) -> float | None:
    """At the first step where greedy ids differ: the reference's top-2 logit gap there (None if none differ)."""
    for row, want, have in zip(rows, expected, got):
        for step, (a, b) in enumerate(zip(want, have)):
            if a != b:
                return top2_gap(reference, row + want[:step])
    return None


def placement(model) -> dict[str, dict]:
    """Each weight's logical axes, total bytes and the bytes one device really holds."""
    axes = param_axes(model.config)
    return {name: {"axes": axes[name], "total": int(array.nbytes),
                   "device": int(array.addressable_shards[0].data.nbytes),
                   "devices": len(array.sharding.device_set)}
            for name, array in flatten_params(model.params).items()}


def row_by_row(model, rows) -> np.ndarray:
    """Full-forward logits of each row alone (batch 1), right-padded into one [B, T, V] array."""
    out = np.zeros((len(rows), max(map(len, rows)), model.config.vocab_size), np.float32)
    for i, row in enumerate(rows):
        out[i, :len(row)] = np.asarray(linnet_jax.logits(model, row))[0]
    return out


def run_case(make_model, reference, rows, new_tokens, ref_ids, ref_logits) -> dict:
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = make_model()
        ids = linnet_jax.generate(model, tokens=rows, max_new_tokens=new_tokens, ignore_eos=True)
        out = sharding.host(linnet_jax.logits(model, *right_padded(rows)))
    mask = right_padded(rows)[1].astype(bool)
    return {
        "ids": ids, "equal": ids == ref_ids, "near_tie_gap": near_tie(reference, rows, ref_ids, ids),
        "logit_diff": float(np.abs(out - ref_logits[0])[mask].max()),
        "logit_diff_row_by_row": float(np.abs(out - ref_logits[1])[mask].max()), "params": placement(model),
        "warnings": sorted({str(w.message) for w in caught}), "mesh": dict(model.layout.mesh.shape),
        "seconds": time.perf_counter() - start,
    }


def cases(kind: str, source):
    """name -> a function returning the placed model."""
    if kind == "tiny":
        load = lambda mesh, rules=None: lambda: linnet_jax.load(source, progress=False, mesh=mesh, rules=rules)  # noqa: E731
        return {
            "dp=8": load(sharding.mesh(data=8), "dp"),
            "tp=2": load(sharding.mesh(tensor=2), "tp"),
            "tp=4": load(sharding.mesh(tensor=4), "tp"),
            "fsdp=8": load(sharding.mesh(fsdp=8), "fsdp"),
            "dp=2 x tp=4": load(sharding.mesh(data=2, tensor=4)),
            "jax.make_mesh dp=2 x tp=4": load(jax.make_mesh((2, 4), ("data", "tensor"))),
            "jax.make_mesh fsdp=8": load(jax.make_mesh((8,), ("fsdp",))),
        }
    return {
        "fsdp=8": lambda: linnet_jax.load(progress=False, mesh=sharding.mesh(fsdp=8), rules="fsdp"),
        "tp=2 (9 heads, 3 kv heads)": lambda: linnet_jax.shard(source, sharding.mesh(tensor=2), "tp"),
    }


def main(kind: str, directory: str | None = None) -> None:
    reference = linnet_jax.load(directory, progress=False)
    rows = prompts(reference.config.vocab_size)
    new_tokens = NEW_TOKENS[kind]
    ref_ids = linnet_jax.generate(reference, tokens=rows, max_new_tokens=new_tokens, ignore_eos=True)
    ref_logits = np.asarray(linnet_jax.logits(reference, *right_padded(rows))), row_by_row(reference, rows)
    source = directory if kind == "tiny" else reference
    results = {name: run_case(make, reference, rows, new_tokens, ref_ids, ref_logits)
               for name, make in cases(kind, source).items()}
    batch_vs_rows = float(np.abs(ref_logits[0] - ref_logits[1])[right_padded(rows)[1].astype(bool)].max())
    print(json.dumps({"devices": len(jax.devices()), "reference_ids": ref_ids, "batch_vs_rows": batch_vs_rows,
                      "cases": results}))


if __name__ == "__main__":
    main(*sys.argv[1:])
