"""The Llama-family decoder as pure functions over a params pytree and a static KV cache.

Einsum legend: b batch, t new positions, s cache slots, d model width, h query heads,
g key/value heads, k head dim, v vocab.

One `forward` serves a full forward (no cache), prefill and decode. Layers run under
`lax.scan` over the stacked weights, with the whole cache in the scan carry, so compile time
and program size stay flat in depth. Given params whose layers are a tuple (`unstack_layers`)
and a cache unstacked alike (`unstack_cache`), the layers are unrolled instead: on XLA:CPU a
layer's weights sliced out of the stacked arrays are copied before each product, which costs
more than the products themselves in decode, while per-layer arrays are read where they lie
(benchmarks/RESULTS.md). `generate` decodes that way.

The cache keeps keys and values per row of (batch row, key/value head), beside the position of
every slot (-1 = empty or padding) and how many slots each batch row has used. A row's T new
tokens go to its next T slots, whatever their positions: masks come from the stored positions,
so left- or right-padded rows and rows at different lengths share one program.
"""

from collections.abc import Callable

import flax.struct
import jax
import jax.numpy as jnp

from linnet_jax.models.config import Config
from linnet_jax.models.lora import Lora
from linnet_jax.models.params import LayerParams, Params
from linnet_jax.ops import apply_rope, attention, inverse_frequencies, rms_norm, swiglu


@flax.struct.dataclass
class KVCache:
    """A static cache of S slots per row.

    k: [L, N, S, K] and v: [L, N, K, S], N = B * G rows (row b * G + g: batch row b, key/value
    head g), the layout `attention` takes; or, unstacked for the unrolled forward, tuples of L
    per-layer [N, S, K] and [N, K, S] arrays. positions: [B, S] int32, the position held by each
    slot (-1 = none); lengths: [B] int32, the slots each batch row has used.
    """

    k: jax.Array
    v: jax.Array
    positions: jax.Array
    lengths: jax.Array

    @property
    def max_len(self) -> int:
        return self.positions.shape[1]


def init_cache(config: Config, batch: int, max_len: int, dtype=None) -> KVCache:
    """An empty cache of max_len slots per row, in the params dtype unless told otherwise."""
    rows = batch * config.num_kv_heads
    return KVCache(
        k=jnp.zeros((config.num_layers, rows, max_len, config.head_dim), dtype or config.dtype),
        v=jnp.zeros((config.num_layers, rows, config.head_dim, max_len), dtype or config.dtype),
        positions=jnp.full((batch, max_len), -1, jnp.int32),
        lengths=jnp.zeros((batch,), jnp.int32),
    )


def unstack_cache(cache: KVCache) -> KVCache:
    """The same cache with k and v as tuples of per-layer arrays, for the unrolled forward."""
    return cache.replace(k=tuple(cache.k), v=tuple(cache.v))


def project_qkv(h: jax.Array, lp: LayerParams, config: Config, lora: Lora | None = None
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Query, key and value heads of one layer: h [B, T, D] → q [B, T, H, K], k and v [B, T, G, K].
    lora: one layer's adapters, added to the biased projections."""
    q = jnp.einsum("btd,dhk->bthk", h, lp.wq)
    k = jnp.einsum("btd,dgk->btgk", h, lp.wk)
    v = jnp.einsum("btd,dgk->btgk", h, lp.wv)
    if config.qkv_bias:
        q, k, v = q + lp.bq, k + lp.bk, v + lp.bv
    if lora is not None:
        q, k, v = lora.add(q, "wq", h), lora.add(k, "wk", h), lora.add(v, "wv", h)
    if config.qk_norm:
        q = rms_norm(q, lp.q_norm, config.rms_norm_eps)
        k = rms_norm(k, lp.k_norm, config.rms_norm_eps)
    return q, k, v


def write_rows(cache: jax.Array, new: jax.Array, starts: jax.Array, slot_axis: int, at: tuple = ()) -> jax.Array:
    """Write each batch row's new entries into its next slots, in place.

    cache: [*A, N, S, K] keys (slot_axis -2) or [*A, N, K, S] values (slot_axis -1); at: indices
    into the leading axes A (the layer of a stacked cache); new: [N, T, K] or [N, K, T];
    starts: [B], each batch row's first slot. One dynamic_update_slice per batch row: on XLA:CPU
    a vmapped (scatter) write measured ~6x slower per step.
    """
    new = new.astype(cache.dtype)
    heads = new.shape[0] // starts.shape[0]
    for row in range(starts.shape[0]):
        index = [row * heads, 0, 0]
        index[slot_axis] = starts[row]
        block = new[row * heads : (row + 1) * heads]
        cache = jax.lax.dynamic_update_slice(cache, block[(None,) * len(at)], (*at, *index))
    return cache


def update_cache(cache: KVCache, layer: int | jax.Array, keys: jax.Array, values: jax.Array
                 ) -> tuple[KVCache, jax.Array, jax.Array]:
    """Write one layer's new keys [N, T, K] and values [N, K, T] into each row's next T slots.

    Returns the cache and the layer's keys [N, S, K] and values [N, K, S]. layer: a Python int
    for an unstacked cache, else an index into the stacked one.
    """
    starts = cache.lengths - keys.shape[1]  # positions were appended before the layers
    if isinstance(cache.k, tuple):
        k = write_rows(cache.k[layer], keys, starts, -2)
        v = write_rows(cache.v[layer], values, starts, -1)
        return cache.replace(k=(*cache.k[:layer], k, *cache.k[layer + 1:]),
                             v=(*cache.v[:layer], v, *cache.v[layer + 1:])), k, v
    cache = cache.replace(k=write_rows(cache.k, keys, starts, -2, at=(layer,)),
                          v=write_rows(cache.v, values, starts, -1, at=(layer,)))
    k = jax.lax.dynamic_index_in_dim(cache.k, layer, keepdims=False)
    v = jax.lax.dynamic_index_in_dim(cache.v, layer, keepdims=False)
    return cache, k, v


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
    layer: int | jax.Array,
    cache: KVCache | None,
    segment_ids: jax.Array | None = None,
    lora: Lora | None = None,
) -> tuple[jax.Array, KVCache | None]:
    """One pre-norm block: x + attention(norm(x)), then + swiglu(norm(x)). x: [B, T, D].
    segment_ids, lora: see `forward` (lora: this layer's slices)."""
    rope_positions = jnp.maximum(positions, 0)
    inv_freq = inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
    with jax.named_scope("attention"):
        q, k, v = project_qkv(rms_norm(x, lp.attn_norm, config.rms_norm_eps), lp, config, lora)
        q = apply_rope(q, rope_positions, inv_freq)
        k = apply_rope(k, rope_positions, inv_freq)
        b, t, g, d = k.shape
        keys = jnp.swapaxes(k, 1, 2).reshape(b * g, t, d)  # [N, T, K]
        values = jnp.transpose(v, (0, 2, 3, 1)).reshape(b * g, d, t)  # [N, K, T]
        own = lambda: attention(q, keys, values, rope_positions, positions, window, segment_ids)  # noqa: E731
        if cache is None:
            mixed = own()
        else:
            cache, cached_keys, cached_values = update_cache(cache, layer, keys, values)
            cached = lambda: attention(q, cached_keys, cached_values, rope_positions, cache.positions, window)  # noqa: E731
            # Tokens written into an empty cache (a prefill) see only each other: skip the empty slots.
            mixed = cached() if t == 1 else jax.lax.cond(jnp.all(cache.lengths == t), own, cached)
        out = jnp.einsum("bthk,hkd->btd", mixed, lp.wo)
        out = out + lp.bo if config.o_bias else out
        x = x + (out if lora is None else lora.add(out, "wo", mixed))
    with jax.named_scope("mlp"):
        x = x + swiglu(rms_norm(x, lp.mlp_norm, config.rms_norm_eps), lp.w_gate, lp.w_up, lp.w_down,
                       None if lora is None else lora.add)
    return x, cache


def forward(
    params: Params,
    config: Config,
    tokens: jax.Array,
    positions: jax.Array,
    cache: KVCache | None = None,
    logits_at: jax.Array | None = None,
    constrain: Callable[[jax.Array, tuple[str, ...]], jax.Array] | None = None,
    *,
    segment_ids: jax.Array | None = None,
    lora: Lora | None = None,
    remat: bool = False,
) -> tuple[jax.Array, KVCache | None]:
    """Logits of the next token at each new position, and the updated cache.

    tokens, positions: [B, T] int; a negative position marks padding, never attended to. With a
    cache, the tokens go to each row's next T slots, which the caller makes sure exist
    (`dynamic_update_slice` would clamp). logits_at: optional [B] indices into T; then only
    those positions' logits are computed ([B, 1, V]). constrain(array, logical axes): applied to
    the activations at every block boundary and to the logits (sharding constraints,
    `linnet_jax.sharding.Layout.constrain`); None for none.
    For training (no cache only): segment_ids [B, T] int, the document of each token in packed
    rows, so attention never crosses documents; lora, adapters on the projections (stacked on [L]);
    remat, recompute each layer's activations in the backward pass (`jax.checkpoint`).
    Returns (float32 logits [B, T, V] or [B, 1, V], cache).
    """
    if cache is not None and (segment_ids is not None or remat):
        raise ValueError("segment_ids and remat are for the full forward: pass cache=None")
    constrain = constrain or (lambda array, axes: array)
    unrolled = isinstance(params.layers, tuple)  # then window and layer are Python ints: static under remat
    layer_fn = jax.checkpoint(decoder_layer, static_argnums=(2, 4, 5) if unrolled else 2) if remat else decoder_layer
    activation = ("batch", "seq", "embed")  # the logical axes of x
    x = constrain(jnp.take(params.embed, tokens, axis=0), activation)
    if cache is not None:
        cache = append_positions(cache, positions)
    if unrolled:
        for layer, lp in enumerate(params.layers):
            adapters = None if lora is None else jax.tree.map(lambda w: w[layer], lora)  # noqa: B023
            x, cache = layer_fn(x, lp, config, positions, config.layer_windows[layer], layer, cache, segment_ids,
                                adapters)
            x = constrain(x, activation)
    else:
        if cache is not None and isinstance(cache.k, tuple):
            raise ValueError("an unstacked cache (unstack_cache) needs unstacked params (unstack_layers)")

        def body(carry, layer_inputs):
            x, cache = carry
            lp, window, layer, adapters = layer_inputs
            x, cache = layer_fn(x, lp, config, positions, window, layer, cache, segment_ids, adapters)
            return (constrain(x, activation), cache), None

        windows = jnp.asarray(config.layer_windows, jnp.int32)
        layer_ids = jnp.arange(config.num_layers)
        (x, cache), _ = jax.lax.scan(body, (x, cache), (params.layers, windows, layer_ids, lora))
    x = rms_norm(x, params.final_norm, config.rms_norm_eps)
    if logits_at is not None:
        x = jnp.take_along_axis(x, logits_at[:, None, None], axis=1)
    head = params.embed if params.lm_head is None else params.lm_head
    logits = jnp.einsum("btd,vd->btv", x, head, preferred_element_type=jnp.float32)
    return constrain(logits, ("batch", "seq", "vocab")), cache
