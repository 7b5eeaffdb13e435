"""Structured output's cost in the serving engine: decode tok/s with every slot under a JSON schema against none.

    python benchmarks/structured.py [--slots 8] [--requests 16] [--new 128] [--runs 2]

SmolLM2 float32 (the embedded default model) in an `Engine` of --slots slots, warmed up; each run submits
--requests chat requests at once, greedy, and waits for all of them: free ones (eos ignored, --new tokens each),
then the same prompts under a bounded nested JSON schema (`structured={"json": SCHEMA}`, at most --new tokens; each
stops when its object is complete). Every engine step is one token of each decoding request (the host computes a
constrained request's next mask with llguidance between steps). tok/s = tokens generated / wall time of the run (its
prefill included, the same for both); the best of --runs. Also: dispatches per token, and the host's mask time
per constrained token, and how many constrained outputs are complete JSON. Prints a markdown table.
"""

import argparse
import json
import time

import jax
import numpy as np

import linnet_jax
from linnet_jax.serve import Engine
from linnet_jax.structured import Constraint

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "species": {"enum": ["cat", "dog", "bird", "fish"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "toys": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "owner": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                   "city": {"type": "string", "maxLength": 20}},
                  "required": ["name", "city"], "additionalProperties": False},
    },
    "required": ["name", "species", "age", "toys", "owner"],
    "additionalProperties": False,
}
TOPICS = ["a cat", "a dog", "a parrot", "a goldfish", "a hamster", "a rabbit", "a turtle", "a horse"]


def run(engine: Engine, requests: list[dict], mask_time: list[float]) -> dict:
    """Every request submitted at once; tokens, wall seconds, dispatches and mask seconds of the run."""
    mask_time[0], logged = 0.0, len(engine.step_log)
    start = time.perf_counter()
    results = [handle.result(timeout=3600) for handle in [engine.submit(**request) for request in requests]]
    wall = time.perf_counter() - start
    tokens = sum(len(result.tokens) for result in results)
    dispatches = sum(step.decoding > 0 for step in list(engine.step_log)[logged:])
    return {"tokens": tokens, "wall": wall, "dispatches": dispatches, "mask_s": mask_time[0], "results": results}


def timed_masks(mask_time: list[float]):
    """Constraint.mask, adding its seconds to mask_time[0]."""
    compute = Constraint.mask

    def mask(self):
        start = time.perf_counter()
        try:
            return compute(self)
        finally:
            mask_time[0] += time.perf_counter() - start

    return mask


def main() -> None:
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("--slots", type=int, default=8)
    options.add_argument("--requests", type=int, default=16)
    options.add_argument("--new", type=int, default=128)
    options.add_argument("--runs", type=int, default=2)
    args = options.parse_args()
    model = linnet_jax.load(progress=False)
    prompts = [[{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} as a JSON object."}]
               for i in range(args.requests)]
    modes = {"free": [dict(prompt=p, max_tokens=args.new, ignore_eos=True) for p in prompts],
             "JSON schema": [dict(prompt=p, max_tokens=args.new, structured={"json": SCHEMA}) for p in prompts]}
    mask_time = [0.0]
    Constraint.mask = timed_masks(mask_time)
    rows = {}
    with Engine(model, slots=args.slots, max_len=256) as engine:
        engine.warmup()
        for mode, requests in modes.items():
            runs = [run(engine, requests, mask_time) for _ in range(args.runs)]
            rows[mode] = max(runs, key=lambda r: r["tokens"] / r["wall"])
        assert engine.compiles_after_warmup == 0
    print(f"SmolLM2 float32, {args.slots} slots, {args.requests} chat requests, greedy, ≤ {args.new} new tokens "
          f"each; {jax.devices()[0].platform}")
    print("| slots constrained | tokens | wall | tok/s | vs free | dispatches / token | mask ms / token |")
    print("|---|---|---|---|---|---|---|")
    free = rows["free"]["tokens"] / rows["free"]["wall"]
    for mode, r in rows.items():
        tok_s = r["tokens"] / r["wall"]
        masks = f"{1e3 * r['mask_s'] / r['tokens']:.2f}" if mode != "free" else "-"
        print(f"| {'all' if mode != 'free' else 'none'} | {r['tokens']} | {r['wall']:.2f} s | {tok_s:.1f} | "
              f"{tok_s / free:.2f}× | {r['dispatches'] / r['tokens']:.3f} | {masks} |")
    constrained = rows["JSON schema"]["results"]
    complete = sum(result.stop_reason == "stop" and json.loads(result.text) is not None for result in constrained)
    print(f"\nconstrained outputs: {complete} of {len(constrained)} complete JSON objects, "
          f"{np.mean([len(result.tokens) for result in constrained]):.1f} tokens on average; first: "
          f"{constrained[0].text}")


if __name__ == "__main__":
    main()
