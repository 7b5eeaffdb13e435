"""Issue 45 planning measurement, not a page section: one decode step of 16 sequences of ~300 tokens on SmolLM2
(float32), the slot cache's forward at max_len 640 and 8192 against paged_forward with pages of 16 and 64 (table
columns a bucket of the longest sequence), on the stacked weights with XLA's products and on the plan's (per-layer
weights, linnet's CPU kernels: what the engine's step runs). Best of 5 after one call: `python benchmarks/paged_step.py`."""

import time

import jax
import jax.numpy as jnp

import linnet_jax
from linnet_jax.models.decoder import forward, init_cache
from linnet_jax.models.paged import StepLayout, init_pages, paged_forward
from linnet_jax.ops import quantized

ROWS, LENGTH = 16, 300


def best(step, *args, runs: int = 5) -> float:
    """The fastest of `runs` calls of step(*args), after one to compile, in seconds."""
    jax.block_until_ready(step(*args))
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(step(*args))
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    model = linnet_jax.load(progress=False)
    config = model.config
    slot_step = jax.jit(lambda p, t, pos, c: forward(p, config, t, pos, c, plan=model.plan)[0])
    tokens, positions = jnp.zeros((ROWS, 1), jnp.int32), jnp.full((ROWS, 1), LENGTH, jnp.int32)
    for max_len in (640, 8192):
        seconds = best(slot_step, model.decode_params, tokens, positions, init_cache(config, ROWS, max_len))
        print(f"slot cache max_len {max_len}: {seconds * 1e3:.1f} ms")
    for page, params, einsum, label in ((16, model.params, quantized.einsum, "stacked weights, XLA's products"),
                                        (64, model.params, quantized.einsum, "stacked weights, XLA's products"),
                                        (64, model.decode_params, model.plan.einsum, "the plan's weights and products")):
        paged_step = jax.jit(lambda p, t, c, layout, einsum=einsum: paged_forward(p, config, t, c, layout,
                                                                                  jnp.arange(ROWS), einsum=einsum)[0])
        columns = 1 << (-(-(LENGTH + 1) // page) - 1).bit_length()
        layout = StepLayout(kv_lens=jnp.full((ROWS,), LENGTH + 1, jnp.int32),
                            page_indices=jnp.arange(ROWS * columns, dtype=jnp.int32).reshape(ROWS, columns),
                            cu_q_lens=jnp.arange(ROWS + 1, dtype=jnp.int32), num_seqs=jnp.asarray([ROWS], jnp.int32))
        seconds = best(paged_step, params, tokens[:, 0], init_pages(config, ROWS * columns, page), layout)
        print(f"paged, pages of {page} ({columns} columns), {label}: {seconds * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
