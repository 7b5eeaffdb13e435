"""Grouped-query attention with causal, padding and sliding-window masks.

Einsum legend: b batch, t query positions, s key positions, g key/value heads,
r query heads per key/value head (H = G * R), k head dim.

Masks are built from positions, not from array indices: query i sees key j when
0 <= pos_k[j] <= pos_q[i] and (no window, or pos_q[i] - pos_k[j] < window). A negative key
position marks a padding or empty slot. That one rule serves a full forward over padded
rows and a static cache whose slot index is the position.
"""

import jax
import jax.numpy as jnp


def attention_mask(q_positions: jax.Array, k_positions: jax.Array, window: jax.Array | int) -> jax.Array:
    """Which keys each query may see: bool [B, T, S].

    q_positions: [B, T]; k_positions: [B, S] (negative = empty); window: int scalar, 0 for none.
    """
    q = q_positions[:, :, None]
    k = k_positions[:, None, :]
    in_window = (window == 0) | (q - k < window)
    return (k >= 0) & (k <= q) & in_window


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_positions: jax.Array,
    k_positions: jax.Array,
    window: jax.Array | int = 0,
) -> jax.Array:
    """Softmax attention of H query heads over G key/value heads, softmax in float32.

    q: [B, T, H, K]; k, v: [B, G, S, K] (heads before slots: the dots then need no transposes);
    q_positions: [B, T]; k_positions: [B, S]. Returns [B, T, H, K] in q's dtype.
    """
    b, t, h, d = q.shape
    g = k.shape[1]
    q = q.reshape(b, t, g, h // g, d)
    scores = jnp.einsum("btgrk,bgsk->bgrts", q, k, preferred_element_type=jnp.float32) * d**-0.5
    mask = attention_mask(q_positions, k_positions, window)[:, None, None]  # [B, 1, 1, T, S]
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bgrts,bgsk->btgrk", probs, v)
    return out.reshape(b, t, h, d)
