"""Multi-LoRA serving throughput on the CPU: the same requests through `Engine` on the base model alone, and with
`--adapters` random rank-`--rank` adapters (all seven projections) loaded, the requests spread round-robin over the
base and every adapter (one batch mixing them all). The goal is ≥ 0.8× the base alone.

    python benchmarks/multilora.py                          # SmolLM2-135M-Instruct float32, 32 requests
    python benchmarks/multilora.py --requests 8 --new-tokens 16

Requests: `--prompt-len` random ids (numpy default_rng(0), ids in [100, 40000)), `--new-tokens` greedy tokens with
eos ignored, all submitted at once to an engine of `--slots` slots, warmed up first (untimed). Generated tok/s =
completion tokens / the time from the first submission to the last completion. Prints one JSON line per engine
and the ratio.
"""

import argparse
import json
import time

import jax
import numpy as np

import linnet_jax
from linnet_jax.compilation import enable_compilation_cache
from linnet_jax.inputs import bucket
from linnet_jax.serve import Engine
from linnet_jax.train import LoraConfig, init_lora


def random_adapters(model, count: int, rank: int) -> dict:
    """{name: Lora}: `count` adapters of rank `rank` on all seven projections, A as PEFT initializes it and B
    random (so each changes the outputs)."""
    adapters = {}
    for i in range(count):
        lora = init_lora(model.config, LoraConfig(rank=rank, alpha=2 * rank), jax.random.key(i))
        b = {name: 0.01 * jax.random.normal(jax.random.key(100 + i), w.shape, w.dtype) for name, w in lora.b.items()}
        adapters[f"lora{i}"] = lora.replace(b=b)
    return adapters


def run(model, prompts: list[list[int]], new_tokens: int, slots: int, adapters: dict | None, rank: int) -> dict:
    """Warm an engine up, submit every prompt at once (round-robin over the base and the adapters), wait."""
    names = [None, *(adapters or {})]
    with Engine(model, slots=slots, max_len=len(prompts[0]) + new_tokens, prefill_chunk=bucket(len(prompts[0])),
                loras=adapters, max_loras=max(len(adapters or {}), 1), max_lora_rank=rank) as engine:
        start = time.perf_counter()
        engine.warmup()
        warmup_s = time.perf_counter() - start
        start = time.perf_counter()
        handles = [engine.submit(tokens=prompt, max_tokens=new_tokens, ignore_eos=True, lora=names[i % len(names)])
                   for i, prompt in enumerate(prompts)]
        tokens = sum(len(handle.result().tokens) for handle in handles)
        elapsed = time.perf_counter() - start
        return {"adapters": len(adapters or {}), "requests": len(prompts), "generated_tokens": tokens,
                "seconds": round(elapsed, 2), "tok_s": round(tokens / elapsed, 1), "warmup_s": round(warmup_s, 1),
                "compiles_after_warmup": engine.compiles_after_warmup}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    enable_compilation_cache()
    model = linnet_jax.load(args.model, progress=False)
    rng = np.random.default_rng(0)
    prompts = rng.integers(100, 40000, (args.requests, args.prompt_len)).tolist()
    base = run(model, prompts, args.new_tokens, args.slots, None, args.rank)
    print(json.dumps(base), flush=True)
    mixed = run(model, prompts, args.new_tokens, args.slots, random_adapters(model, args.adapters, args.rank),
                args.rank)
    print(json.dumps(mixed), flush=True)
    print(json.dumps({"multilora_over_base": round(mixed["tok_s"] / base["tok_s"], 3)}))


if __name__ == "__main__":
    main()
