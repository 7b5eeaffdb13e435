"""The Llama-family decoder as pure functions over a params pytree and a static KV cache.

Einsum legend: b batch, t new positions, s cache slots, d model width, h query heads,
g key/value heads, k head dim, v vocab.

One `forward` serves a full forward (no cache), prefill and decode. Layers run under
`lax.scan` over the stacked weights, with the whole cache in the scan carry, so compile time
and program size stay flat in depth.

The cache keeps, beside keys and values, the position of every slot (-1 = empty or padding)
and how many slots each row has used. A row's T new tokens go to its next T slots, whatever
their positions: masks come from the stored positions, so left- or right-padded rows and rows
at different lengths share one program.
"""

import flax.struct
import jax
import jax.numpy as jnp

from linnet_jax.models.config import Config
from linnet_jax.models.params import LayerParams, Params
from linnet_jax.ops import apply_rope, attention, inverse_frequencies, rms_norm, swiglu


@flax.struct.dataclass
class KVCache:
    """A static cache of S slots per row.

    k, v: [L, B, G, S, K]; positions: [B, S] int32, the position held by each slot (-1 = none);
    lengths: [B] int32, the slots each row has used.
    """

    k: jax.Array
    v: jax.Array
    positions: jax.Array
    lengths: jax.Array

    @property
    def max_len(self) -> int:
        return self.k.shape[3]


def init_cache(config: Config, batch: int, max_len: int, dtype=None) -> KVCache:
    """An empty cache of max_len slots per row, in the params dtype unless told otherwise."""
    shape = (config.num_layers, batch, config.num_kv_heads, max_len, config.head_dim)
    return KVCache(
        k=jnp.zeros(shape, dtype or config.dtype),
        v=jnp.zeros(shape, dtype or config.dtype),
        positions=jnp.full((batch, max_len), -1, jnp.int32),
        lengths=jnp.zeros((batch,), jnp.int32),
    )


def project_qkv(h: jax.Array, lp: LayerParams, config: Config) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Query, key and value heads of one layer: h [B, T, D] → q [B, T, H, K], k and v [B, T, G, K]."""
    q = jnp.einsum("btd,dhk->bthk", h, lp.wq)
    k = jnp.einsum("btd,dgk->btgk", h, lp.wk)
    v = jnp.einsum("btd,dgk->btgk", h, lp.wv)
    if config.qkv_bias:
        q, k, v = q + lp.bq, k + lp.bk, v + lp.bv
    if config.qk_norm:
        q = rms_norm(q, lp.q_norm, config.rms_norm_eps)
        k = rms_norm(k, lp.k_norm, config.rms_norm_eps)
    return q, k, v


def write_rows(cache: jax.Array, layer: jax.Array, new: jax.Array, starts: jax.Array) -> jax.Array:
    """Write each row's new entries into one layer of the cache, in place.

    cache: [L, B, G, S, K]; layer: int scalar; new: [B, G, T, K]; starts: [B] first slot per row.
    One dynamic_update_slice per row: on XLA:CPU a vmapped (scatter) write measured ~6x slower per step.
    """
    new = new.astype(cache.dtype)
    for row in range(new.shape[0]):
        cache = jax.lax.dynamic_update_slice(cache, new[None, row : row + 1], (layer, row, 0, starts[row], 0))
    return cache


def append_positions(cache: KVCache, positions: jax.Array) -> KVCache:
    """Record the positions of T new tokens in each row's next T slots. positions: [B, T]."""
    write = jax.vmap(lambda row, new, start: jax.lax.dynamic_update_slice(row, new, (start,)))
    return cache.replace(
        positions=write(cache.positions, positions.astype(jnp.int32), cache.lengths),
        lengths=cache.lengths + positions.shape[1],
    )


def decoder_layer(
    x: jax.Array,
    lp: LayerParams,
    config: Config,
    positions: jax.Array,
    window: jax.Array,
    layer: jax.Array,
    cache: KVCache | None,
) -> tuple[jax.Array, KVCache | None]:
    """One pre-norm block: x + attention(norm(x)), then + swiglu(norm(x)). x: [B, T, D]."""
    rope_positions = jnp.maximum(positions, 0)
    inv_freq = inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
    with jax.named_scope("attention"):
        q, k, v = project_qkv(rms_norm(x, lp.attn_norm, config.rms_norm_eps), lp, config)
        q = apply_rope(q, rope_positions, inv_freq)
        k = jnp.swapaxes(apply_rope(k, rope_positions, inv_freq), 1, 2)  # [B, G, T, K]
        v = jnp.swapaxes(v, 1, 2)
        if cache is None:
            keys, values, key_positions = k, v, positions
        else:
            starts = cache.lengths - positions.shape[1]  # positions were appended before the layers
            cache = cache.replace(k=write_rows(cache.k, layer, k, starts), v=write_rows(cache.v, layer, v, starts))
            keys = jax.lax.dynamic_index_in_dim(cache.k, layer, keepdims=False)
            values = jax.lax.dynamic_index_in_dim(cache.v, layer, keepdims=False)
            key_positions = cache.positions
        mixed = attention(q, keys, values, rope_positions, key_positions, window)
        out = jnp.einsum("bthk,hkd->btd", mixed, lp.wo)
        x = x + (out + lp.bo if config.o_bias else out)
    with jax.named_scope("mlp"):
        x = x + swiglu(rms_norm(x, lp.mlp_norm, config.rms_norm_eps), lp.w_gate, lp.w_up, lp.w_down)
    return x, cache


def forward(
    params: Params,
    config: Config,
    tokens: jax.Array,
    positions: jax.Array,
    cache: KVCache | None = None,
    logits_at: jax.Array | None = None,
) -> tuple[jax.Array, KVCache | None]:
    """Logits of the next token at each new position, and the updated cache.

    tokens, positions: [B, T] int; a negative position marks padding, never attended to. With a
    cache, the tokens go to each row's next T slots, which the caller makes sure exist
    (`dynamic_update_slice` would clamp). logits_at: optional [B] indices into T; then only
    those positions' logits are computed ([B, 1, V]).
    Returns (float32 logits [B, T, V] or [B, 1, V], cache).
    """
    x = jnp.take(params.embed, tokens, axis=0)
    windows = jnp.asarray(config.layer_windows, jnp.int32)
    if cache is not None:
        cache = append_positions(cache, positions)

    def body(carry, layer_inputs):
        x, cache = carry
        lp, window, layer = layer_inputs
        return decoder_layer(x, lp, config, positions, window, layer, cache), None

    layer_ids = jnp.arange(config.num_layers)
    (x, cache), _ = jax.lax.scan(body, (x, cache), (params.layers, windows, layer_ids))
    x = rms_norm(x, params.final_norm, config.rms_norm_eps)
    if logits_at is not None:
        x = jnp.take_along_axis(x, logits_at[:, None, None], axis=1)
    head = params.embed if params.lm_head is None else params.lm_head
    return jnp.einsum("btd,vd->btv", x, head, preferred_element_type=jnp.float32), cache
