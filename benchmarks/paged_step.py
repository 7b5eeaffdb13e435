"""Issue 45 planning measurement, not a page section: one decode step of 16 sequences of ~300 tokens on SmolLM2 (float32): the slot cache's forward at max_len 8192
and 640, against paged_forward with pages of 16 and 64 (table columns a bucket of the longest sequence)."""
import time, numpy as np, jax, jax.numpy as jnp
import linnet_jax
from linnet_jax.models.decoder import forward, init_cache
from linnet_jax.models.paged import StepLayout, init_pages, paged_forward
model = linnet_jax.load(progress=False)
params, config = model.decode_params, model.config
B, L = 16, 300
def best(f, *a, n=5):
    f(*a); ts = []
    for _ in range(n):
        t = time.perf_counter(); jax.block_until_ready(f(*a)); ts.append(time.perf_counter() - t)
    return min(ts)
for max_len in (640, 8192):
    cache = init_cache(config, B, max_len)
    step = jax.jit(lambda p, t, pos, c: forward(p, config, t, pos, c, plan=model.plan)[0])
    print(f"slot cache max_len {max_len}: {best(step, params, jnp.zeros((B, 1), jnp.int32), jnp.full((B, 1), L, jnp.int32), cache) * 1e3:.1f} ms")
for page in (16, 64):
    cols = 1 << (-(-(L + 1) // page) - 1).bit_length()
    pool = init_pages(config, B * cols, page)
    layout = StepLayout(kv_lens=jnp.full((B,), L + 1, jnp.int32), page_indices=jnp.arange(B * cols, dtype=jnp.int32).reshape(B, cols),
                        cu_q_lens=jnp.arange(B + 1, dtype=jnp.int32), num_seqs=jnp.asarray([B], jnp.int32))
    step = jax.jit(lambda p, t, c, l: paged_forward(p, config, t, c, l, jnp.arange(B))[0])
    print(f"paged, pages of {page} ({cols} columns): {best(step, model.params, jnp.zeros((B,), jnp.int32), pool, layout) * 1e3:.1f} ms")
