"""The decode core: per-slot primitives that `generate` and the serving engine share.

JetStream's engine contract as pure functions, each jitted once per shape:

    prefill(params, config, tokens [1, T], positions [1, T], request, max_len) -> Slots (one row, T slots)
        one request's left-padded prompt through its own cache, its first token chosen
    insert(prefix, slots, slot) -> Slots
        that row into row `slot` of a many-slot decode state (B rows of max_len slots)
    decode(params, config, slots, steps, out_len) -> (Slots, Emitted)
        up to `steps` single-token steps over every busy slot, stopping early when none is left
    free(slots, slot) -> Slots
        the slot emptied

Everything a request owns lives in its row: its sampling parameters and random key, stop ids,
max_new_tokens, sequence length, tokens generated and finish state. Token n of a request is drawn
with its key folded with n, so its tokens depend on its own seed and steps only, never on its
neighbours or when it joined. The cache is a ring with one cursor for every row
(`models.decoder`): a step writes every layer once whatever the number of rows, an idle or
finished row's slots are never written (its new token has position -1), and a row that has filled
its max_len slots finishes with LENGTH: nothing is ever overwritten or clamped.
"""

import functools

import flax.struct
import jax
import jax.numpy as jnp

from linnet_jax.models import KVCache, Params, forward, init_cache
from linnet_jax.models.config import Config
from linnet_jax.ops import SamplingParams, penalize_repeats, sample

FREE, RUNNING, STOP_ID, LENGTH = -1, 0, 1, 2  # a row's finish state
TOP_LOGPROBS = 20  # the most likely tokens reported beside each chosen one (OpenAI's top_logprobs limit)
TRACES = {"prefill": 0, "insert": 0, "decode": 0, "free": 0}  # incremented when a program is traced


@flax.struct.dataclass
class Request:
    """What requests own, one row each ([R] leading axis): how to sample and when to stop."""

    sampling: SamplingParams  # each field [R]; keys [R, 2] uint32
    stop_ids: jax.Array  # [R, STOP_ID_SLOTS] int32, padded with -1
    max_new: jax.Array  # [R] int32, the most tokens to generate


@flax.struct.dataclass
class Slots:
    """A decode state of B rows: the cache and, per row, its request and progress."""

    cache: KVCache  # B rows of S = max_len slots
    request: Request  # [B]
    token: jax.Array  # [B] int32, the last chosen token (fed to the next step)
    logprob: jax.Array  # [B] float32, its log-softmax under the raw logits
    length: jax.Array  # [B] int32, prompt + generated tokens
    count: jax.Array  # [B] int32, tokens generated (the stop token included)
    finish: jax.Array  # [B] int32: FREE, RUNNING, STOP_ID or LENGTH
    seen: jax.Array  # [B, V] bool, prompt and generated tokens (for the repetition penalty)
    top_ids: jax.Array  # [B, TOP_LOGPROBS] int32, the most likely tokens at the last step (when asked for)
    top_logprobs: jax.Array  # [B, TOP_LOGPROBS] float32, their logprobs


@flax.struct.dataclass
class Emitted:
    """What one `decode` call produced: row b's tokens are tokens[b, :count[b]]."""

    tokens: jax.Array  # [B, out_len] int32
    logprobs: jax.Array  # [B, out_len] float32
    count: jax.Array  # [B] int32
    top_ids: jax.Array  # [B, out_len, TOP_LOGPROBS] int32 (zeros unless decode was asked for them)
    top_logprobs: jax.Array  # [B, out_len, TOP_LOGPROBS] float32


def empty_slots(config: Config, batch: int, max_len: int, stop_id_slots: int, dtype) -> Slots:
    """B free rows of max_len slots each."""
    zeros = lambda dtype_: jnp.zeros((batch,), dtype_)  # noqa: E731
    sampling = SamplingParams(temperature=zeros(jnp.float32), top_k=zeros(jnp.int32), top_p=jnp.ones((batch,)),
                              min_p=zeros(jnp.float32), repetition_penalty=jnp.ones((batch,)),
                              keys=jnp.zeros((batch, 2), jnp.uint32))
    request = Request(sampling=sampling, stop_ids=jnp.full((batch, stop_id_slots), -1, jnp.int32),
                      max_new=zeros(jnp.int32))
    return Slots(cache=init_cache(config, batch, max_len, dtype), request=request, token=zeros(jnp.int32),
                 logprob=zeros(jnp.float32), length=zeros(jnp.int32), count=zeros(jnp.int32),
                 finish=jnp.full((batch,), FREE, jnp.int32), seen=jnp.zeros((batch, config.vocab_size), bool),
                 top_ids=jnp.zeros((batch, TOP_LOGPROBS), jnp.int32),
                 top_logprobs=jnp.zeros((batch, TOP_LOGPROBS), jnp.float32))


def choose(slots: Slots, logits: jax.Array, max_len: int, top: bool) -> Slots:
    """Each running row's next token from its logits [B, V], drawn with its key folded with its count.
    top: also record the TOP_LOGPROBS most likely tokens and their logprobs."""
    request = slots.request
    chosen = sample(penalize_repeats(logits, slots.seen, request.sampling.repetition_penalty), request.sampling,
                    slots.count)
    logprobs = jax.nn.log_softmax(logits)
    logprob = jnp.take_along_axis(logprobs, chosen[:, None], axis=-1)[:, 0]
    if top:
        top_logprobs, top_ids = jax.lax.top_k(logprobs, TOP_LOGPROBS)
        slots = slots.replace(top_ids=top_ids.astype(jnp.int32), top_logprobs=top_logprobs)
    running = slots.finish == RUNNING
    count, length = slots.count + running, slots.length + running
    finish = jnp.where(running & jnp.any(chosen[:, None] == request.stop_ids, axis=1), STOP_ID, slots.finish)
    finish = jnp.where((finish == RUNNING) & ((count >= request.max_new) | (length >= max_len)), LENGTH, finish)
    rows = jnp.arange(chosen.shape[0])
    return slots.replace(
        token=jnp.where(running, chosen, slots.token),
        logprob=jnp.where(running, logprob, slots.logprob),
        length=length,
        count=count,
        finish=finish,
        seen=slots.seen.at[rows, chosen].set(slots.seen[rows, chosen] | running),
    )


@functools.partial(jax.jit, static_argnums=(1, 5, 6, 7))
def prefill(params: Params, config: Config, tokens: jax.Array, positions: jax.Array, request: Request,
            max_len: int, constrain=None, plan=None) -> Slots:
    """One request's prompt, left-padded to a bucket T (tokens, positions [1, T]; position -1 at padding),
    through a cache of its own T slots; its first token chosen (with its top logprobs). max_len: the slots of the state it will
    join (a prompt that fills them finishes at once with LENGTH). constrain: forward's sharding constraints;
    plan: the hardware plan (`linnet_jax.backend.Plan`) the params were made for (`Model.plan`)."""
    TRACES["prefill"] += 1
    length = tokens.shape[1]
    cache = init_cache(config, 1, length, params.embed.dtype)
    logits, cache = forward(params, config, tokens, positions, cache, logits_at=jnp.full((1,), length - 1),
                            constrain=constrain, plan=plan)
    seen = jnp.zeros((1, config.vocab_size), bool).at[0, tokens[0]].max(positions[0] >= 0)
    prompt = jnp.sum(positions >= 0, axis=1).astype(jnp.int32)
    zero = jnp.zeros((1,), jnp.int32)
    slots = Slots(cache=cache, request=request, token=zero, logprob=jnp.zeros((1,)), length=prompt, count=zero,
                  finish=zero + RUNNING, seen=seen, top_ids=jnp.zeros((1, TOP_LOGPROBS), jnp.int32),
                  top_logprobs=jnp.zeros((1, TOP_LOGPROBS)))
    return choose(slots, logits[:, 0], max_len, top=True)


def ring_row(prefix: jax.Array, slots: int, shift: jax.Array, axis: int, fill) -> jax.Array:
    """A prefix's T entries along `axis` as a row of `slots` entries, entry i at slot (shift + i) mod slots.

    Entries beyond the row's capacity (T > slots) are the leading padding of a left-padded prompt: dropped."""
    length = prefix.shape[axis]
    if length > slots:
        prefix = jax.lax.slice_in_dim(prefix, length - slots, length, axis=axis)
    pad = [(0, 0)] * prefix.ndim
    pad[axis] = (0, slots - prefix.shape[axis])
    return jnp.roll(jnp.pad(prefix, pad, constant_values=fill), shift, axis=axis)


@functools.partial(jax.jit, donate_argnums=(1,))
def insert(prefix: Slots, slots: Slots, slot: jax.Array) -> Slots:
    """Row 0 of `prefix` (prefill's result) into row `slot` of `slots`, its cache entries ending just before
    the shared cursor. Every other row is left as it was."""
    TRACES["insert"] += 1
    cache, max_len = slots.cache, slots.cache.max_len
    heads = cache.k[0].shape[0] // cache.positions.shape[0]
    shift = (cache.cursor - prefix.cache.max_len) % max_len

    def put_rows(layer: jax.Array, new: jax.Array, axis: int) -> jax.Array:  # new: [G, ...] rows of one layer
        return jax.lax.dynamic_update_slice(layer, ring_row(new, max_len, shift, axis, 0).astype(layer.dtype),
                                            (slot * heads, 0, 0))

    cache = cache.replace(
        k=tuple(put_rows(layer, new, 1) for layer, new in zip(cache.k, prefix.cache.k)),
        v=tuple(put_rows(layer, new, 2) for layer, new in zip(cache.v, prefix.cache.v)),
        positions=jax.lax.dynamic_update_slice(
            cache.positions, ring_row(prefix.cache.positions, max_len, shift, 1, -1), (slot, 0)),
    )
    rows = jax.tree.map(lambda whole, row: jax.lax.dynamic_update_index_in_dim(whole, row[0], slot, 0),
                        slots.replace(cache=None), prefix.replace(cache=None))
    finish = jnp.where((rows.finish == RUNNING) & (rows.length >= max_len), LENGTH, rows.finish)
    return rows.replace(cache=cache, finish=finish)


@functools.partial(jax.jit, static_argnums=(1, 4, 5, 6, 7), donate_argnums=(2,))
def decode(params: Params, config: Config, slots: Slots, steps: jax.Array, out_len: int,
           constrain=None, top: bool = False, plan=None) -> tuple[Slots, Emitted]:
    """Up to `steps` (≤ out_len) single-token steps over every running row, until none is running.

    Each step feeds every running row its last token at position length - 1; other rows feed position
    -1, which writes nothing and is masked. Returns the state and what each row emitted (with each
    token's TOP_LOGPROBS most likely alternatives when `top`). plan: as `prefill`'s."""
    TRACES["decode"] += 1
    batch = slots.token.shape[0]
    start = slots.count

    def step(carry):
        slots, out, i = carry
        running = slots.finish == RUNNING
        positions = jnp.where(running, slots.length - 1, -1)[:, None]
        logits, cache = forward(params, config, slots.token[:, None], positions, slots.cache, constrain=constrain,
                                plan=plan)
        slots = choose(slots.replace(cache=cache), logits[:, 0], slots.cache.max_len, top)
        columns = (slots.token, slots.logprob, slots.top_ids, slots.top_logprobs)
        out = tuple(jax.lax.dynamic_update_index_in_dim(buffer, column, i, 1) for buffer, column in zip(out, columns))
        return slots, out, i + 1

    def going(carry):
        slots, _, i = carry
        return (i < steps) & jnp.any(slots.finish == RUNNING)

    top_shape = (batch, out_len, TOP_LOGPROBS)
    empty = (jnp.zeros((batch, out_len), jnp.int32), jnp.zeros((batch, out_len), jnp.float32),
             jnp.zeros(top_shape, jnp.int32), jnp.zeros(top_shape, jnp.float32))
    slots, out, _ = jax.lax.while_loop(going, step, (slots, empty, jnp.zeros((), jnp.int32)))
    tokens, logprobs, top_ids, top_logprobs = out
    return slots, Emitted(tokens=tokens, logprobs=logprobs, count=slots.count - start, top_ids=top_ids,
                          top_logprobs=top_logprobs)


@functools.partial(jax.jit, donate_argnums=(0,))
def free(slots: Slots, slot: jax.Array) -> Slots:
    """Row `slot` emptied: FREE, and its slots hold no position (its keys and values are left, masked)."""
    TRACES["free"] += 1
    positions = jax.lax.dynamic_update_slice(slots.cache.positions,
                                             jnp.full((1, slots.cache.max_len), -1, jnp.int32), (slot, 0))
    return slots.replace(cache=slots.cache.replace(positions=positions),
                         finish=slots.finish.at[slot].set(FREE), count=slots.count.at[slot].set(0))
