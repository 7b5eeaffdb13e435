"""Grouped-query attention with causal, padding and sliding-window masks.

Einsum legend: n cache rows (one per batch row and key/value head, N = B * G, row b * G + g),
t query positions, s key positions, k head dim.

Keys come as [N, S, K] and values as [N, K, S], the layout of the KV cache: both products then
contract the minor axis of each operand, which XLA:CPU's kernels take as they are, and the
arrays have no size-1 axis at batch 1, so XLA reads a cache updated in place without first
copying it. Each of the R = H / G query heads sharing a key/value head gets its own products,
with one row per query position: a decode step is then a batch of matrix-vector products,
which XLA:CPU runs about twice as fast as one product of R rows (benchmarks/RESULTS.md). Where the
caller has a kernel for the products of a few rows (`products`: the hardware plan's, `ops.matvec.batched`
on XLA:CPU), the R heads' rows go through it together, and each key and value is read once for all of them.

Masks are built from positions, not from array indices: query i sees key j when
0 <= pos_k[j] <= pos_q[i] and (no window, or pos_q[i] - pos_k[j] < window). A negative key
position marks a padding or empty slot. That one rule serves a full forward over padded
rows and a static cache whose slot index is the position.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp


def attention_mask(q_positions: jax.Array, k_positions: jax.Array, window: jax.Array | int,
                   segment_ids: jax.Array | None = None) -> jax.Array:
    """Which keys each query may see: bool [B, T, S].

    q_positions: [B, T]; k_positions: [B, S] (negative = empty); window: int scalar, 0 for none.
    segment_ids: optional [B, T] document ids of the tokens when queries and keys are the same
    tokens (no cache, T == S): a query then sees only keys of its own document (packed rows).
    """
    q = q_positions[:, :, None]
    k = k_positions[:, None, :]
    in_window = (window == 0) | (q - k < window)
    mask = (k >= 0) & (k <= q) & in_window
    if segment_ids is not None:
        mask &= segment_ids[:, :, None] == segment_ids[:, None, :]
    return mask


CAUSAL_BLOCK = 128  # query positions per block of a causal `attention`


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_positions: jax.Array,
    k_positions: jax.Array,
    window: jax.Array | int = 0,
    segment_ids: jax.Array | None = None,
    causal: bool = False,
    products: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
    kv_heads: int | None = None,
) -> jax.Array:
    """Softmax attention of H query heads over G key/value heads, softmax in float32.

    q: [B, T, H, K]; k: [N, S, K] and v: [N, K, S] with N = B * G (row b * G + g), or N ≥ B * G where kv_heads
    gives G (a cache of more rows than the queries': its first B * G rows are read);
    q_positions: [B, T]; k_positions: [B, S]; segment_ids: optional [B, T] (see attention_mask).
    causal (static): the queries are the first T keys' tokens, in order (a forward without a cache, or a prompt's
    first chunk), so no query sees a later key: each block of CAUSAL_BLOCK queries reads the keys up to its own end
    only, which skips most of the masked half (at T = 512, 3/8 of the products and of the softmax).
    products: optional (a [N, I, C], b [N, J, C], slots [N], slots_contracted) -> [N, I, J], Σ_c a[n, i, c] ·
    b[n, j, c] over the first slots[n] key slots (`ops.matvec.batched`), taking the R · T query rows of a key/value
    head at once (None: one product per query head through jnp.einsum).
    Returns [B, T, H, K] in q's dtype.
    """
    mask = attention_mask(q_positions, k_positions, window, segment_ids)  # [B, T, S]
    if not causal:
        return masked_attention(q, k, v, mask, products, kv_heads)
    t = q.shape[1]
    blocks = [(start, min(start + CAUSAL_BLOCK, t)) for start in range(0, t, CAUSAL_BLOCK)]
    return jnp.concatenate([masked_attention(q[:, start:end], k[:, :end], v[:, :, :end], mask[:, start:end, :end],
                                             kv_heads=kv_heads)
                            for start, end in blocks], axis=1)


def masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                     products: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
                     kv_heads: int | None = None) -> jax.Array:
    """`attention` with its mask given: q [B, T, H, K], k [N, S, K], v [N, K, S], mask bool [B, T, S] →
    [B, T, H, K]; products, kv_heads: see `attention`."""
    b, t, h, d = q.shape
    s = k.shape[1]
    g = kv_heads or k.shape[0] // b
    n = b * g
    if products is None:  # jnp.einsum's operands: the rows the queries read (`products` reads the first n itself)
        k, v = k[:n], v[:n]
    heads = q.reshape(b, t, g, h // g, d).transpose(3, 0, 2, 1, 4).reshape(h // g, n, t, d)  # [R, N, T, K]
    if products is None:
        scores = jnp.stack([jnp.einsum("ntk,nsk->nts", head, k, preferred_element_type=jnp.float32)
                            for head in heads])
    else:  # each row's slots up to the last one a query sees: [N]
        slots = jnp.repeat(jnp.max(jnp.where(mask, jnp.arange(1, s + 1), 0), axis=(1, 2)), g)
        scores = products(heads.transpose(1, 0, 2, 3).reshape(n, -1, d), k, slots, False)
        scores = scores.reshape(n, -1, t, s).transpose(1, 0, 2, 3)
    scores = jnp.where(mask[:, None], scores.reshape(-1, b, g, t, s) * d**-0.5, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype).reshape(-1, n, t, s)  # [R, N, T, S]
    if products is None:
        out = jnp.stack([jnp.einsum("nts,nks->ntk", p, v) for p in probs])  # [R, N, T, K]
    else:
        out = products(probs.transpose(1, 0, 2, 3).reshape(n, -1, s), v, slots, True).astype(v.dtype)
        out = out.reshape(n, -1, t, d).transpose(1, 0, 2, 3)
    return out.reshape(-1, b, g, t, d).transpose(1, 3, 2, 0, 4).reshape(b, t, h, d)
