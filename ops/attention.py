"""Grouped-query attention with causal, padding and sliding-window masks.

Einsum legend: n cache rows (one per batch row and key/value head, N = B * G, row b * G + g),
i query rows of a cache row (I = R * T: the R = H / G query heads sharing its key/value head, T positions each),
j key slots, c the contracted axis.

Keys come as [N, S, K] and values as [N, K, S], the layout of the KV cache: both products then
contract the minor axis of each operand, which XLA:CPU's kernels take as they are, and the
arrays have no size-1 axis at batch 1, so XLA reads a cache updated in place without first
copying it. The R heads' query rows of a key/value head are one product's rows, so each key and value is
read once for all of them: through the hardware plan's kernel for the products of a few rows (`products`,
`ops.matvec.batched` on XLA:CPU) or jnp.einsum, except a decode step's (T = 1) through jnp.einsum, whose
rows go one matrix-vector product per head, which XLA:CPU runs about twice as fast (benchmarks/RESULTS.md).

Masks are built from positions, not from array indices: query i sees key j when
0 <= pos_k[j] <= pos_q[i] and (no window, or pos_q[i] - pos_k[j] < window). A negative key
position marks a padding or empty slot. That one rule serves a full forward over padded
rows and a static cache whose slot index is the position.
"""

import functools
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
    key_block: int | None = None,
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
    head at once (None: `einsum_products`).
    key_block (static; with neither causal nor products): read only the first key slots that hold every key a
    query sees, the fewest of `key_spans` (a branch of a `jax.lax.switch` each): a prompt's 256-position chunk at
    position 256 of a 640-slot cache reads 512 slots, not 640. None: all S.
    Returns [B, T, H, K] in q's dtype.
    """
    mask = attention_mask(q_positions, k_positions, window, segment_ids)  # [B, T, S]
    t, s = q.shape[1], k.shape[1]
    if not causal:
        spans = [s] if key_block is None or products is not None else key_spans(t, s, key_block)
        if len(spans) > 1:
            return spanned_attention(q, k, v, mask, spans, kv_heads)
        return masked_attention(q, k, v, mask, products, kv_heads)
    blocks = [(start, min(start + CAUSAL_BLOCK, t)) for start in range(0, t, CAUSAL_BLOCK)]
    return jnp.concatenate([masked_attention(q[:, start:end], k[:, :end], v[:, :, :end], mask[:, start:end, :end],
                                             kv_heads=kv_heads)
                            for start, end in blocks], axis=1)


def spanned_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, spans: list[int],
                      kv_heads: int | None = None) -> jax.Array:
    """`masked_attention` over the first key slots only: the fewest of `spans` (ascending, the last S) that hold
    every slot a query sees (`seen_slots`), chosen on the device. q [B, T, H, K], k [N, S, K], v [N, K, S], mask
    bool [B, T, S] → [B, T, H, K]. The slots left out are masked for every query: they add nothing."""

    def read(span: int) -> Callable:
        return lambda q, k, v, mask: masked_attention(q, k[:, :span], v[:, :, :span], mask[:, :, :span],
                                                      kv_heads=kv_heads)

    branch = jnp.sum(jnp.asarray(spans[:-1]) < jnp.max(seen_slots(mask)))  # the first span ≥ every row's slots
    return jax.lax.switch(branch, [read(span) for span in spans], q, k, v, mask)


def key_spans(positions: int, slots: int, key_block: int) -> list[int]:
    """The spans `spanned_attention` compiles for `positions` queries over `slots` key slots: key_block, 2 ·
    key_block, 4 · key_block, .. where more than the queries (a later chunk of a prompt sees more keys than its
    own) and fewer than the slots, then all slots."""
    spans = [key_block << i for i in range(max(slots // key_block, 1).bit_length())]
    return [span for span in spans if positions < span < slots] + [slots]


def seen_slots(mask: jax.Array) -> jax.Array:
    """For a mask bool [B, T, S], each row's slots up to the last one any of its queries sees: int32 [B]."""
    return jnp.max(jnp.where(mask, jnp.arange(1, mask.shape[-1] + 1), 0), axis=(1, 2))


def masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                     products: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
                     kv_heads: int | None = None) -> jax.Array:
    """`attention` with its mask given: q [B, T, H, K], k [N, S, K], v [N, K, S], mask bool [B, T, S] →
    [B, T, H, K]; products, kv_heads: see `attention`."""
    b, t, h, d = q.shape
    s = k.shape[1]
    g = kv_heads or k.shape[0] // b
    n, r = b * g, h // g
    rows = q.reshape(b, t, g, r, d).transpose(0, 2, 3, 1, 4).reshape(n, r * t, d)  # [N, I, K], I = R·T: row r·T + t
    if products is None:  # jnp.einsum's operands: the rows the queries read (`products` reads the first n itself)
        k, v, slots = k[:n], v[:n], None
        products = functools.partial(einsum_products, parts=r if t == 1 else 1)
    else:  # each row's slots up to the last one a query sees: [N]
        slots = jnp.repeat(seen_slots(mask), g)
    scores = products(rows, k, slots, False).reshape(b, g, r, t, s)
    scores = jnp.where(mask[:, None, None], scores * d**-0.5, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype).reshape(n, r * t, s)
    out = products(probs, v, slots, True).astype(v.dtype)  # [N, I, K]
    return out.reshape(b, g, r, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, h, d)


def einsum_products(a: jax.Array, b: jax.Array, slots: jax.Array | None, slots_contracted: bool,
                    parts: int = 1) -> jax.Array:
    """`attention`'s products through jnp.einsum, over all of b's slots (the mask hides the rest): a [N, I, C],
    b [N, J, C] → float32 [N, I, J], as `parts` products of I / parts rows each. One product of the R heads' rows
    runs a prompt's or a training forward's attention up to 2x faster on XLA:CPU than R of them; a decode step's one
    row per head runs faster as R matrix-vector products (benchmarks/RESULTS.md)."""
    del slots, slots_contracted
    return jnp.concatenate([jnp.einsum("nic,njc->nij", part, b, preferred_element_type=jnp.float32)
                            for part in jnp.split(a, parts, axis=1)], axis=1)
