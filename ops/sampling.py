"""Choosing the next token from logits, per row, with every parameter an array (no retrace).

Order as transformers applies them: repetition penalty, then temperature, top-k, top-p, min-p
(each filter renormalising what the previous one kept). A row with temperature 0 is greedy.
"""

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class SamplingParams:
    """Per-row sampling settings, each [B]. top_k 0 = off, top_p 1 = off, min_p 0 = off, penalty 1 = off."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    repetition_penalty: jax.Array
    keys: jax.Array  # [B, 2] uint32: each row's own random stream


def penalize_repeats(logits: jax.Array, seen: jax.Array, penalty: jax.Array) -> jax.Array:
    """transformers' repetition penalty: seen tokens' positive logits divided by it, negative multiplied.

    logits: [B, V] float32; seen: [B, V] bool; penalty: [B].
    """
    p = penalty[:, None]
    return jnp.where(seen, jnp.where(logits > 0, logits / p, logits * p), logits)


def filtered_logits(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """Tempered logits with every token outside the top-k / top-p / min-p set at -inf. [B, V] → [B, V].

    The most likely token is always kept (a top_p that float32 flushes to zero keeps it alone). The [B, V] sort
    runs only when some row filters."""
    scaled = logits / jnp.where(params.temperature > 0, params.temperature, 1.0)[:, None]
    filtering = jnp.any((params.top_k > 0) | (params.top_p < 1) | (params.min_p > 0))
    return jax.lax.cond(filtering, lambda: outside_filters_dropped(scaled, params), lambda: scaled)


def outside_filters_dropped(scaled: jax.Array, params: SamplingParams) -> jax.Array:
    """`scaled` [B, V] with every token outside the top-k / top-p / min-p set at -inf."""
    ranked = -jnp.sort(-scaled, axis=-1)  # descending, [B, V]
    rank = jnp.arange(scaled.shape[-1])
    ranked = jnp.where((params.top_k[:, None] == 0) | (rank < params.top_k[:, None]), ranked, -jnp.inf)
    probs = jax.nn.softmax(ranked, axis=-1)
    in_nucleus = (rank == 0) | (jnp.cumsum(probs, axis=-1) - probs < params.top_p[:, None])
    ranked = jnp.where(in_nucleus, ranked, -jnp.inf)
    probs = jax.nn.softmax(ranked, axis=-1)
    ranked = jnp.where(probs >= params.min_p[:, None] * probs[:, :1], ranked, -jnp.inf)
    kept = jnp.maximum(jnp.sum(jnp.isfinite(ranked), axis=-1), 1)  # the kept set is a prefix of the ranking
    threshold = jnp.take_along_axis(ranked, (kept - 1)[:, None], axis=-1)
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)


def sample(logits: jax.Array, params: SamplingParams, step: jax.Array | int) -> jax.Array:
    """The next token of each row: int32 [B]. logits: [B, V] float32; step: [B] or one for every row,
    folded into each row's key (a row's draw depends on its own key and step only)."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw():
        steps = jnp.broadcast_to(jnp.asarray(step, jnp.int32), greedy.shape)
        keys = jax.vmap(jax.random.fold_in)(params.keys, steps)
        drawn = jax.vmap(jax.random.categorical)(keys, filtered_logits(logits, params)).astype(jnp.int32)
        return jnp.where(params.temperature > 0, drawn, greedy)

    return jax.lax.cond(jnp.any(params.temperature > 0), draw, lambda: greedy)
