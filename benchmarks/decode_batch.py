"""The decode core at batch 1, 4, 16 and 64: decode-program compile time, step time and tokens/s.

    python benchmarks/decode_batch.py [--batches 1,4,16,64] [--prompt 128] [--new 64] [--temperature 0]
                                      [--quantize int8]

SmolLM2 float32 (the embedded default model), every row a random prompt of --prompt ids, no eos; greedy, or
sampled at --temperature with no top-k/top-p/min-p (what an OpenAI client that sends no sampling fields gets).
Each batch: B prompts prefilled (one `extend`) into a B-slot state of bucket(prompt + new) slots, then one
`decode` call of new - 1 steps (the loop on the device), timed after a warm-up call on the same shapes.
Prints a markdown table (the numbers benchmarks/RESULTS.md keeps).
"""

import argparse

import jax
import numpy as np
from harness import timed

import linnet_jax
from linnet_jax.decode import decode, decode_program
from linnet_jax.inputs import bucket, extend_rows, make_requests, make_sampling, new_slots, stop_id_array
from linnet_jax.models.config import QUANTIZE


def filled_state(model, batch: int, prompt: int, new: int, max_len: int, temperature: float):
    """A state whose B rows each hold a random prompt and its first token (computed: the timing that follows
    must not include it)."""
    rng = np.random.default_rng(batch)
    request = make_requests(make_sampling(1, temperature, 0, 1.0, 0.0, 1.0, 0), stop_id_array(model, None, True),
                            new)
    prompts = [rng.integers(0, model.config.vocab_size, prompt).tolist() for _ in range(batch)]
    return jax.block_until_ready(extend_rows(model, new_slots(model, batch, max_len), list(range(batch)), prompts,
                                             [0] * batch, [request] * batch, [True] * batch))


def measure(model, batch: int, prompt: int, new: int, temperature: float) -> dict:
    max_len, steps = bucket(prompt + new), new - 1
    slots = filled_state(model, batch, prompt, new, max_len, temperature)
    run = lambda: decode(model.decode_params, model.config, slots, np.int32(steps), bucket(steps),  # noqa: E731
                         plan=model.plan)
    compile_s, _ = timed(decode_program(model.plan.decode_options(batch)).lower(model.decode_params, model.config, slots, np.int32(steps), bucket(steps),
                                      plan=model.plan).compile)
    jax.block_until_ready(run())
    slots = filled_state(model, batch, prompt, new, max_len, temperature)  # the warm-up consumed (donated) the first
    wall, (slots, emitted) = timed(lambda: jax.block_until_ready(run()))
    assert (np.asarray(emitted.count) == steps).all()
    return {"batch": batch, "compile_s": compile_s, "step_ms": 1e3 * wall / steps, "tok_s": batch * steps / wall}


def main() -> None:
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("--batches", default="1,4,16,64")
    options.add_argument("--prompt", type=int, default=128)
    options.add_argument("--new", type=int, default=64)
    options.add_argument("--temperature", type=float, default=0.0)
    options.add_argument("--quantize", default=None, choices=QUANTIZE, help="the model's weights, as load takes it")
    args = options.parse_args()
    model = linnet_jax.load(progress=False, quantize=args.quantize)
    rows = [measure(model, int(b), args.prompt, args.new, args.temperature) for b in args.batches.split(",")]
    base = rows[0]
    how = f"sampled at temperature {args.temperature}" if args.temperature else "greedy"
    print(f"SmolLM2 {args.quantize or 'float32'}, prompt {args.prompt} ids, {args.new} new tokens, {how}; {jax.devices()[0].platform}")
    print("| batch | decode compile | vs batch 1 | step | tokens/s | vs batch 1 |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['compile_s']:.2f} s | {r['compile_s'] / base['compile_s']:.2f}× | "
              f"{r['step_ms']:.1f} ms | {r['tok_s']:.1f} | {r['tok_s'] / base['tok_s']:.2f}× |")


if __name__ == "__main__":
    main()
