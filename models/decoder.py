"""The Llama-family decoder as pure functions over a params pytree and a static KV cache.

Einsum legend: b batch, t new positions, d model width, h query heads, g key/value heads,
k head dim, v vocab.

One `forward` serves a full forward (no cache), prefill and decode. Without a cache the layers
run under `lax.scan` over the stacked weights, so compile time and program size stay flat in
depth. With a cache they are unrolled, each layer reading its own key and value arrays: on every
platform a step then reads each layer's cache where it lies (a slice of a stacked cache is a copy
on XLA:CPU). The weights come stacked (each layer's slice taken inside the program, as GPUs and
TPUs read them) or as per-layer arrays (`unstack_layers`, what XLA:CPU wants: the one plan,
`linnet_jax.backend.Plan`, says which).

The cache holds S slots per row, and slot i holds the row's position i: a row's T new tokens are
written at their own positions, so rows of different lengths, rows that take several tokens in a
step (a prompt's chunk, speculative drafts) and rows that take none share one program. A new token
whose position is negative (padding, an idle row) writes nothing. Masks come from positions: a
query at position q sees slots 0..q (and only the window's, under a sliding window), so an entry a
row wrote past its current length (a rejected draft, an earlier request in the same row) is never
read before the row writes that slot again.
"""

import functools
from collections.abc import Callable

import flax.struct
import jax
import jax.numpy as jnp

from linnet_jax.models.config import Config
from linnet_jax.models.lora import Lora, LoraTable
from linnet_jax.models.params import LayerParams, Params
from linnet_jax.ops import apply_rope, attention, inverse_frequencies, quantized, rms_norm, swiglu


@flax.struct.dataclass
class KVCache:
    """S slots per row, slot i holding position i.

    k: L per-layer keys [N, S, K] and v: L per-layer values [N, K, S], N = B * G rows (row b * G + g:
    batch row b, key/value head g), the layout `attention` takes.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]


def init_cache(config: Config, batch: int, max_len: int, dtype=None) -> KVCache:
    """An empty cache of max_len slots per row, in the params dtype unless told otherwise."""
    rows, layers, dtype = batch * config.num_kv_heads, range(config.num_layers), dtype or config.dtype
    return KVCache(k=tuple(jnp.zeros((rows, max_len, config.head_dim), dtype) for _ in layers),
                   v=tuple(jnp.zeros((rows, config.head_dim, max_len), dtype) for _ in layers))


def project_qkv(h: jax.Array, lp: LayerParams, config: Config, lora: Lora | LoraTable | None = None,
                einsum=jnp.einsum) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Query, key and value heads of one layer: h [B, T, D] → q [B, T, H, K], k and v [B, T, G, K].
    lora: one layer's adapters, added to the biased projections; einsum: how products run (`forward`)."""
    q, k, v = quantized.einsums(einsum, h, [("btd,dhk->bthk", lp.wq), ("btd,dgk->btgk", lp.wk),
                                            ("btd,dgk->btgk", lp.wv)])
    if config.qkv_bias:
        q, k, v = q + lp.bq, k + lp.bk, v + lp.bv
    if lora is not None:
        q, k, v = lora.add(q, "wq", h), lora.add(k, "wk", h), lora.add(v, "wv", h)
    if config.qk_norm:
        q = rms_norm(q, lp.q_norm, config.rms_norm_eps)
        k = rms_norm(k, lp.k_norm, config.rms_norm_eps)
    return q, k, v


def write_slots(positions: jax.Array, heads: int, max_len: int, cache_rows: jax.Array | None = None
                ) -> tuple[jax.Array, jax.Array]:
    """Where T new tokens of each row go: (cache row, slot) index pairs [N, T] for positions [B, T], a slot past
    the cache (dropped by the scatter) where the position is negative. cache_rows: the cache row of each of the N
    rows [N] (past the cache: dropped); None: row n is cache row n."""
    rows = (jnp.arange(positions.shape[0] * heads) if cache_rows is None else cache_rows)[:, None]
    slots = jnp.repeat(jnp.where(positions >= 0, positions, max_len), heads, axis=0)
    return jnp.broadcast_to(rows, slots.shape), slots


def update_cache(cache: KVCache, layer: int, keys: jax.Array, values: jax.Array, positions: jax.Array,
                 cache_rows: jax.Array | None = None) -> tuple[KVCache, jax.Array, jax.Array]:
    """Write layer `layer`'s new keys [N, T, K] and values [N, K, T] at their positions [B, T] (none where
    negative), into cache rows `cache_rows` [N] (`write_slots`). Returns the cache and the layer's keys and values,
    all the cache's rows ([N', S, K] and [N', K, S])."""
    rows, slots = write_slots(positions, keys.shape[0] // positions.shape[0], cache.max_len, cache_rows)
    k = cache.k[layer].at[rows, slots].set(keys.astype(cache.k[layer].dtype), mode="drop", unique_indices=True)
    v = cache.v[layer].at[rows, :, slots].set(jnp.swapaxes(values, 1, 2).astype(cache.v[layer].dtype), mode="drop",
                                              unique_indices=True)
    replaced = lambda arrays, new: (*arrays[:layer], new, *arrays[layer + 1:])  # noqa: E731
    return cache.replace(k=replaced(cache.k, k), v=replaced(cache.v, v)), k, v


def take_rows(array: jax.Array, rows: jax.Array) -> jax.Array:
    """array's rows [R] along its first axis; a row past its end (padding) reads zeros."""
    return jnp.take(array, rows, axis=0, mode="fill", fill_value=0)


def attended(cached_keys: jax.Array, cached_values: jax.Array, keys: jax.Array, values: jax.Array, fresh: bool,
             cache_rows: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """The keys [N, S, K] and values [N, K, S] a layer's queries attend to, from its cache's (`update_cache`'s, its
    new keys [N, T, K] and values [N, K, T] written): without cache_rows, the cache's rows as they are (its first N
    are the queries'); with them, a fresh chunk's own keys and values (its slots 0 .. T - 1, nothing else to read),
    or else the cache_rows' gathered (`forward`'s cache_rows)."""
    if cache_rows is None:
        return cached_keys, cached_values
    if fresh:
        return keys.astype(cached_keys.dtype), values.astype(cached_values.dtype)
    return take_rows(cached_keys, cache_rows), take_rows(cached_values, cache_rows)


def residual_block(x: jax.Array, lp: LayerParams, config: Config, positions: jax.Array,
                   attend: Callable[[jax.Array, jax.Array, jax.Array], jax.Array], lora: Lora | LoraTable | None = None,
                   einsum=jnp.einsum) -> jax.Array:
    """One pre-norm block: x + wo(attend(q, k, v)), then + swiglu(norm(x)). x: [B, T, D]; positions [B, T] (negative:
    padding, roped as 0); attend(q [B, T, H, K], k and v [B, T, G, K], all roped) -> [B, T, H, K], the attention
    over whatever cache the caller keeps; lora: this layer's adapters; einsum: how the projections run."""
    rope_positions = jnp.maximum(positions, 0)
    inv_freq = inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
    with jax.named_scope("attention"):
        q, k, v = project_qkv(rms_norm(x, lp.attn_norm, config.rms_norm_eps), lp, config, lora, einsum)
        mixed = attend(apply_rope(q, rope_positions, inv_freq), apply_rope(k, rope_positions, inv_freq), v)
        out = einsum("bthk,hkd->btd", mixed, lp.wo)
        out = out + lp.bo if config.o_bias else out
        x = x + (out if lora is None else lora.add(out, "wo", mixed))
    with jax.named_scope("mlp"):
        return x + swiglu(rms_norm(x, lp.mlp_norm, config.rms_norm_eps), lp.w_gate, lp.w_up, lp.w_down,
                          None if lora is None else lora.add, einsum)


def decoder_layer(
    x: jax.Array,
    lp: LayerParams,
    config: Config,
    positions: jax.Array,
    window: jax.Array,
    layer: int,
    cache: KVCache | None,
    segment_ids: jax.Array | None = None,
    lora: Lora | LoraTable | None = None,
    *,
    einsum=jnp.einsum,
    fresh: bool = False,
    products=None,
    key_block: int | None = None,
    cache_rows: jax.Array | None = None,
) -> tuple[jax.Array, KVCache | None]:
    """One block (`residual_block`) over the slot cache. x: [B, T, D].
    segment_ids, lora, fresh, cache_rows: see `forward` (lora: this layer's slices); einsum: how the projections run;
    products: how attention's products run with a cache (`ops.attention`'s; None: jnp.einsum); key_block: how much
    of the cache attention reads (`ops.attention`'s)."""
    rope_positions = jnp.maximum(positions, 0)
    updated = [cache]

    def attend(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        b, t, g, head_dim = k.shape
        keys = jnp.swapaxes(k, 1, 2).reshape(b * g, t, head_dim)  # [N, T, K]
        values = jnp.transpose(v, (0, 2, 3, 1)).reshape(b * g, head_dim, t)  # [N, K, T]
        if cache is None:  # the backward pass recomputes the probabilities rather than keeping them [B, H, T, T]
            return jax.checkpoint(functools.partial(attention, causal=True))(q, keys, values, rope_positions,
                                                                        positions, window, segment_ids)
        updated[0], cached_keys, cached_values = update_cache(cache, layer, keys, values, positions, cache_rows)
        keys, values = attended(cached_keys, cached_values, keys, values, fresh, cache_rows)
        slot_positions = jnp.broadcast_to(jnp.arange(keys.shape[1]), (b, keys.shape[1]))  # slot i: position i
        return attention(q, keys, values, rope_positions, slot_positions, window, causal=fresh, products=products,
                         kv_heads=g, key_block=key_block)

    x = residual_block(x, lp, config, positions, attend, lora, einsum)
    return x, updated[0]


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
    lora: Lora | LoraTable | None = None,
    remat: bool = False,
    plan=None,
    fresh: bool = False,
    cache_rows: jax.Array | None = None,
) -> tuple[jax.Array, KVCache | None]:
    """Logits of the next token at each new position, and the updated cache.

    tokens, positions: [B, T] int; a negative position marks padding, never attended to nor written
    to the cache. With a cache, each token goes to the slot of its position (< S), and attends to
    the row's slots up to its position, which the caller makes sure hold that row's earlier tokens. logits_at: optional [B] indices into T;
    then only those positions' logits are computed ([B, 1, V]). constrain(array, logical axes):
    applied to the activations at every block boundary and to the logits (sharding constraints,
    `linnet_jax.sharding.Layout.constrain`); None for none.
    lora: adapters on the projections, the same for every row (`Lora`, stacked on [L]: training's) or each
    row's own (a `LoraTable` with its rows' entries set, `LoraTable.rows`: serving's).
    For training (no cache only): segment_ids [B, T] int, the document of each token in packed
    rows, so attention never crosses documents; remat, recompute each layer's activations in the backward
    pass (`jax.checkpoint`).
    plan: the hardware plan (`linnet_jax.backend.Plan`, hashable: static under jit); its einsum is what the
    products run through (`ops.matvec.einsum` for decode on XLA:CPU). None: `ops.quantized.einsum`.
    fresh (with a cache): each row's tokens are its positions 0, 1, .. in order (a prompt's first chunk; padding
    after them), so its attention runs causal over them (`ops.attention`'s causal), as a forward without a cache does.
    cache_rows (with a cache): [B * G], the cache row of each row's key/value head g at b * G + g (past the cache
    for a padding row: it writes nothing), for a cache of other rows than the tokens' (a serving state's
    slots): the new keys and values are written there and nowhere else, and attention reads those rows (a fresh
    chunk only its own keys). None: row b's are cache rows b * G ...
    The embedding, the head and the projections may be quantized (`models.params.quantize_params`).
    Returns (float32 logits [B, T, V] or [B, 1, V], cache).
    """
    if cache is not None and (segment_ids is not None or remat):
        raise ValueError("segment_ids and remat are for the full forward: pass cache=None")
    constrain = constrain or (lambda array, axes: array)
    activation = ("batch", "seq", "embed")  # the logical axes of x
    x = constrain(quantized.take_rows(params.embed, tokens), activation)
    t = tokens.shape[1]
    einsum = quantized.einsum if plan is None else plan.step_einsum(t)
    products = None if plan is None else plan.attention_products(config.num_heads // config.num_kv_heads * t, t)
    key_block = None if plan is None else plan.attention_key_block(t)
    layer_fn = functools.partial(decoder_layer, einsum=einsum, fresh=fresh, products=products, key_block=key_block,
                                 cache_rows=cache_rows)
    if cache is not None or isinstance(params.layers, tuple) or not (lora is None or lora.layer_major):
        layer_fn = jax.checkpoint(layer_fn, static_argnums=(2, 4, 5)) if remat else layer_fn  # unrolled: static ints
        for layer in range(config.num_layers):
            adapters = None if lora is None else lora.layer(layer)
            x, cache = layer_fn(x, layer_params(params, layer), config, positions, config.layer_windows[layer],
                                layer, cache, segment_ids, adapters)
            x = constrain(x, activation)
    else:
        layer_fn = jax.checkpoint(layer_fn, static_argnums=(2, 5)) if remat else layer_fn

        def body(x, layer_inputs):
            lp, window, adapters = layer_inputs
            x, _ = layer_fn(x, lp, config, positions, window, 0, None, segment_ids, adapters)
            return constrain(x, activation), None

        x, _ = jax.lax.scan(body, x, (params.layers, jnp.asarray(config.layer_windows, jnp.int32), lora))
    x = rms_norm(x, params.final_norm, config.rms_norm_eps)
    if logits_at is not None:
        x = jnp.take_along_axis(x, logits_at[:, None, None], axis=1)
    head = params.embed if params.lm_head is None else params.lm_head
    head_einsum = einsum if plan is None else plan.step_einsum(x.shape[1])  # logits_at: a decode step's products
    logits = head_einsum("btd,vd->btv", x, head, preferred_element_type=jnp.float32)
    return constrain(logits, ("batch", "seq", "vocab")), cache


def layer_params(params: Params, layer: int) -> LayerParams:
    """One layer's weights: an entry of unstacked layers, or a slice of the stacked ones (inside a program)."""
    if isinstance(params.layers, tuple):
        return params.layers[layer]
    return jax.tree.map(lambda stacked: stacked[layer], params.layers)
