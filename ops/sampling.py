"""Choosing the next token from logits, per row, with every parameter an array (no retrace).

Order as transformers applies them: repetition penalty, then OpenAI's presence and frequency penalties, the
logit bias, the grammar's mask, then temperature, top-k, top-p, min-p (each filter renormalising what the
previous one kept). A row with temperature 0 is greedy; another draws by the inverse CDF of one uniform number
(`inverse_cdf_draw`).

Axes: B rows, V vocabulary ids, W = ceil(V / 32) words of a token bitmask (bit v % 32 of word v // 32 is
token v), N logit bias entries per row.
"""

import flax.struct
import jax
import jax.numpy as jnp

DRAW_BLOCK = 256  # tokens per block of the two-level inverse-CDF draw

@flax.struct.dataclass
class SamplingParams:
    """Per-row sampling settings, each [B]. top_k 0 = off, top_p 1 = off, min_p 0 = off, penalty 1 = off."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    repetition_penalty: jax.Array
    presence_penalty: jax.Array  # 0 = off
    frequency_penalty: jax.Array  # 0 = off
    bias_ids: jax.Array  # [B, N] int32: the ids of the logit bias (padding: id 0, bias 0)
    bias: jax.Array  # [B, N] float32: added to those ids' logits
    keys: jax.Array  # [B, 2] uint32: each row's own random stream


def penalize_repeats(logits: jax.Array, seen: jax.Array, penalty: jax.Array) -> jax.Array:
    """transformers' repetition penalty: seen tokens' positive logits divided by it, negative multiplied.

    logits: [B, V] float32; seen: [B, V] bool; penalty: [B].
    """
    p = penalty[:, None]
    return jnp.where(seen, jnp.where(logits > 0, logits / p, logits * p), logits)


def penalize_counts(logits: jax.Array, counts: jax.Array, presence: jax.Array, frequency: jax.Array) -> jax.Array:
    """OpenAI's presence and frequency penalties: logit - presence * (count > 0) - frequency * count.

    logits: [B, V] float32; counts: [B, V] int32, how often each token was generated; presence, frequency: [B].
    """
    return logits - presence[:, None] * (counts > 0) - frequency[:, None] * counts


def add_bias(logits: jax.Array, ids: jax.Array, bias: jax.Array) -> jax.Array:
    """logits [B, V] with bias [B, N] added at ids [B, N] (a row's ids distinct but for padding, which adds 0)."""
    return logits.at[jnp.arange(logits.shape[0])[:, None], ids].add(bias)


def penalized(logits: jax.Array, seen: jax.Array, counts: jax.Array, params: SamplingParams) -> jax.Array:
    """The logits [B, V] after the repetition penalty (seen: [B, V] bool, prompt and generated tokens), the
    presence and frequency penalties (counts: [B, V], generated tokens) and the logit bias, in that order."""
    logits = penalize_repeats(logits, seen, params.repetition_penalty)
    logits = penalize_counts(logits, counts, params.presence_penalty, params.frequency_penalty)
    return add_bias(logits, params.bias_ids, params.bias)


def bitmask_words(vocab: int) -> int:
    """W: the uint32 words of a bitmask over `vocab` tokens."""
    return (vocab + 31) // 32


def unpack_bitmask(bitmask: jax.Array, vocab: int) -> jax.Array:
    """[B, W] uint32 → [B, V] bool: whether each token's bit is set."""
    ids = jnp.arange(vocab, dtype=jnp.uint32)
    return (bitmask[:, ids // 32] >> (ids % 32)) & 1 == 1


def masked(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """logits [B, V] with each token whose bit is clear in bitmask [B, W] at -inf."""
    return jnp.where(unpack_bitmask(bitmask, logits.shape[-1]), logits, -jnp.inf)


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


def inverse_cdf_draw(logits: jax.Array, uniform: jax.Array) -> jax.Array:
    """One token per row with probability softmax(logits): the first whose cumulative mass passes uniform × the
    row's mass. logits: [B, V] float32 (-inf: never drawn); uniform: [B] in [0, 1) → int32 [B].

    Two levels, N = ceil(V / DRAW_BLOCK) blocks: the block whose cumulative mass passes the target, then the token
    inside it, so the cumulative sums run over N and DRAW_BLOCK entries rather than V; one random number per row
    where a Gumbel draw (`jax.random.categorical`) takes V of them (40 vs 1.3 ms for [16, 49152] on the CPU)."""
    batch, vocab = logits.shape
    blocks = -(-vocab // DRAW_BLOCK)
    padded = jnp.pad(logits, ((0, 0), (0, blocks * DRAW_BLOCK - vocab)), constant_values=-jnp.inf)
    weights = jnp.exp(padded - jnp.max(logits, axis=-1, keepdims=True)).reshape(batch, blocks, DRAW_BLOCK)
    block_mass = jnp.sum(weights, axis=-1)  # [B, N]
    passed = jnp.cumsum(block_mass, axis=-1)  # [B, N]; the row's mass ≥ 1 (its largest weight is 1)
    tiny = jnp.finfo(jnp.float32).tiny
    target = jnp.maximum(uniform * passed[:, -1], tiny)  # [B], in (0, mass)
    block = first_reaching(passed, target)
    residual = target - (take(passed, block) - take(block_mass, block))  # the target's mass inside the block
    inner = jnp.cumsum(jnp.take_along_axis(weights, block[:, None, None], axis=1)[:, 0], axis=-1)  # [B, DRAW_BLOCK]
    token = block * DRAW_BLOCK + first_reaching(inner, jnp.clip(residual, tiny, inner[:, -1]))
    never = take(padded, token) == -jnp.inf  # only where float rounding broke the cumulative sums' order
    return jnp.where(never, first_max_index(logits), token).astype(jnp.int32)


def first_max_index(x: jax.Array) -> jax.Array:
    """Per row, the first index of its largest value, as jnp.argmax gives it for rows without NaN: [B, N] → int32
    [B]. One max and one min reduction, which XLA:CPU vectorizes, where argmax's (value, index) reduction runs
    element by element (0.6 against 2.2 ms for [16, 49152] on an AMD Zen 4 core)."""
    top = jnp.max(x, axis=-1, keepdims=True)
    return jnp.min(jnp.where(x == top, jnp.arange(x.shape[-1], dtype=jnp.int32), x.shape[-1]), axis=-1)


def first_reaching(cumulative: jax.Array, target: jax.Array) -> jax.Array:
    """Per row, the first index whose cumulative value reaches target (the last one at most). [B, N], [B] → [B]."""
    return jnp.minimum(jnp.sum(cumulative < target[:, None], axis=-1), cumulative.shape[-1] - 1)


def take(rows: jax.Array, index: jax.Array) -> jax.Array:
    """rows[b, index[b]] for each b. [B, N], [B] → [B]."""
    return jnp.take_along_axis(rows, index[:, None], axis=-1)[:, 0]


def sample(logits: jax.Array, params: SamplingParams, step: jax.Array | int) -> jax.Array:
    """The next token of each row: int32 [B]. logits: [B, V] float32; step: [B] or one for every row,
    folded into each row's key (a row's draw depends on its own key and step only)."""
    greedy = first_max_index(logits)

    def draw():
        steps = jnp.broadcast_to(jnp.asarray(step, jnp.int32), greedy.shape)
        uniform = jax.vmap(lambda key, n: jax.random.uniform(jax.random.fold_in(key, n)))(params.keys, steps)
        drawn = inverse_cdf_draw(filtered_logits(logits, params), uniform)
        return jnp.where(params.temperature > 0, drawn, greedy)

    return jax.lax.cond(jnp.any(params.temperature > 0), draw, lambda: greedy)
