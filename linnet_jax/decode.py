"""The decode core: per-slot primitives that `generate` and the serving engine share.

Pure functions over a decode state of B rows (`Slots`), each jitted once per shape:

    extend(params, config, slots, rows [R], tokens [R, C], start [R], count [R], request, last [R])
        -> (Slots, logits [R, V])
        a chunk of a prompt for each of R rows: row r's count[r] tokens at positions start[r]..,
        written into its cache; where it ends its prompt (last), the row runs
    choose_first(slots, rows [R], logits [R, V]) -> Slots
        the first token of each row that `extend` made run, from its chunk's last logits (a program of its own,
        compiled once per R rather than once per chunk shape)
    decode(params, config, slots, steps, out_len) -> (Slots, Emitted)
        up to `steps` single-token steps over every running row, stopping early when none is left
    verify(params, config, slots, drafts [B, K], n_drafts [B]) -> (Slots, Emitted)
        one forward over each running row's last token and its drafts; the row keeps the longest run
        of drafts that equal what it would have chosen, and one token more
    free(slots, slot) -> Slots
        the slot emptied

All three rest on one step: several tokens of a row, each at its own position (`forward` writes a
token at the cache slot of its position), so a prompt's chunk, a decode step and a speculative
verification are the same forward with different widths.

Everything a request owns lives in its row: its sampling parameters and random key, stop ids,
max_new_tokens, its adapter (an entry of a `LoraTable` that every program takes whole; 0 for the base),
sequence length, tokens generated and finish state, and the tokens its grammar allows next (`allowed`, a bitmask
the host replaces between dispatches: every token for an unconstrained row, so that constrained and free rows run
in one program). Token n of a request is drawn with its key folded with n, so its tokens depend on its own seed
and steps only, never on its neighbours, on how its prompt was chunked or on how many drafts were verified at
once. A row that fills its max_len slots finishes with LENGTH: nothing is ever overwritten or clamped.
"""

import functools
from collections.abc import Callable

import flax.struct
import jax
import jax.numpy as jnp

from linnet_jax.models import KVCache, Params, forward, init_cache
from linnet_jax.models.config import Config
from linnet_jax.models.decoder import take_rows
from linnet_jax.models.lora import LoraTable
from linnet_jax.ops import SamplingParams, bitmask_words, masked, penalized, sample

FREE, RUNNING, STOP_ID, LENGTH = -1, 0, 1, 2  # a row's finish state
TOP_LOGPROBS = 20  # the most likely tokens reported beside each chosen one (OpenAI's top_logprobs limit)
# incremented when a program is traced
TRACES = {"extend": 0, "choose_first": 0, "decode": 0, "verify": 0, "free": 0, "scrub": 0, "put_lora": 0,
          "packed_step": 0}
BIAS_SLOTS = 300  # logit bias entries per row (OpenAI's limit), padded
ALL_ALLOWED = 0xFFFFFFFF  # a bitmask word that allows its 32 tokens


@flax.struct.dataclass
class Request:
    """What requests own, one row each ([R] leading axis): how to sample and when to stop."""

    sampling: SamplingParams  # each field [R]; keys [R, 2] uint32
    stop_ids: jax.Array  # [R, STOP_ID_SLOTS] int32, padded with -1
    max_new: jax.Array  # [R] int32, the most tokens to generate
    adapter: jax.Array  # [R] int32, the row's entry in the adapter table (0: the base model)


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
    generated: jax.Array  # [B, V] int32, how often each token was generated (presence and frequency penalties)
    allowed: jax.Array  # [B, W] uint32, the tokens the row may choose next (a bitmask, `ops.sampling.unpack_bitmask`)
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
                              presence_penalty=zeros(jnp.float32), frequency_penalty=zeros(jnp.float32),
                              bias_ids=jnp.zeros((batch, BIAS_SLOTS), jnp.int32),
                              bias=jnp.zeros((batch, BIAS_SLOTS), jnp.float32), keys=jnp.zeros((batch, 2), jnp.uint32))
    request = Request(sampling=sampling, stop_ids=jnp.full((batch, stop_id_slots), -1, jnp.int32),
                      max_new=zeros(jnp.int32), adapter=zeros(jnp.int32))
    return Slots(cache=init_cache(config, batch, max_len, dtype), request=request, token=zeros(jnp.int32),
                 logprob=zeros(jnp.float32), length=zeros(jnp.int32), count=zeros(jnp.int32),
                 finish=jnp.full((batch,), FREE, jnp.int32), seen=jnp.zeros((batch, config.vocab_size), bool),
                 generated=jnp.zeros((batch, config.vocab_size), jnp.int32),
                 allowed=jnp.full((batch, bitmask_words(config.vocab_size)), ALL_ALLOWED, jnp.uint32),
                 top_ids=jnp.zeros((batch, TOP_LOGPROBS), jnp.int32),
                 top_logprobs=jnp.zeros((batch, TOP_LOGPROBS), jnp.float32))


def choose(slots: Slots, logits: jax.Array, max_len: int, top: bool, active: jax.Array | None = None) -> Slots:
    """Each running row's next token from its logits [B, V], penalized (`ops.penalized`) and masked to the tokens
    it allows, drawn with its key folded with its count. top: also record the TOP_LOGPROBS most likely tokens and
    their logprobs (under the raw logits); active: [B] bool, the rows that choose (None: every running row)."""
    request = slots.request
    adjusted = masked(penalized(logits, slots.seen, slots.generated, request.sampling), slots.allowed)
    chosen = sample(adjusted, request.sampling, slots.count)
    logprobs = jax.nn.log_softmax(logits)
    logprob = jnp.take_along_axis(logprobs, chosen[:, None], axis=-1)[:, 0]
    if top:
        top_logprobs, top_ids = jax.lax.top_k(logprobs, TOP_LOGPROBS)
        slots = slots.replace(top_ids=top_ids.astype(jnp.int32), top_logprobs=top_logprobs)
    running = slots.finish == RUNNING if active is None else (slots.finish == RUNNING) & active
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
        generated=slots.generated.at[rows, chosen].add(running.astype(jnp.int32)),
    )


def row_adapters(lora: LoraTable | None, request: Request) -> LoraTable | None:
    """The adapter table with each row's entry (None: no table, the base model's programs)."""
    return None if lora is None else lora.rows(request.adapter)


def row_cache(cache: KVCache, rows: jax.Array, heads: int) -> jax.Array:
    """The cache rows [R * G] of state rows [R] (row b * G + g); a row past the state (padding) maps past it."""
    return (rows[:, None] * heads + jnp.arange(heads)).reshape(-1)


@functools.partial(jax.jit, static_argnums=(1, 9, 10, 11), donate_argnums=(2,))
def extend(params: Params, config: Config, slots: Slots, rows: jax.Array, tokens: jax.Array, start: jax.Array,
           count: jax.Array, request: Request, last: jax.Array, constrain=None, plan=None, fresh: bool = False,
           lora: LoraTable | None = None) -> tuple[Slots, jax.Array]:
    """A chunk of a prompt for each of R rows of the state, in one forward; returns the state and each row's logits
    at its chunk's last token [R, V] (float32), which `choose_first` turns into the first tokens of the rows it ends.

    rows: [R] int32, the state rows (a row ≥ B is padding: it reads zeros and writes nothing); tokens: [R, C],
    row r's first count[r] entries its prompt's tokens at positions start[r] ..; request: the rows' requests
    ([R]); last: [R] bool, the chunk ends the row's prompt: it runs (`choose_first` then chooses its first token),
    else it waits (FREE) for its next chunk. A chunk starting at 0 begins a new prompt; a later one continues the
    row's cache. constrain: forward's sharding constraints; plan: the hardware plan (`linnet_jax.backend.Plan`)
    the params were made for (`Model.plan`); fresh: every chunk begins its prompt (start 0), so its attention reads
    its own C keys only, causal over them (`forward`'s fresh), not its row's max_len slots. Each row's new keys and
    values are written into its cache slots and nowhere else (`forward`'s cache_rows).
    lora: the adapter table (each row uses its request's entry), or None."""
    TRACES["extend"] += 1
    columns = jnp.arange(tokens.shape[1])
    valid = columns < count[:, None]
    positions = jnp.where(valid, start[:, None] + columns, -1)
    logits, cache = forward(params, config, tokens, positions, slots.cache, logits_at=jnp.maximum(count - 1, 0),
                            constrain=constrain, lora=row_adapters(lora, request), plan=plan, fresh=fresh,
                            cache_rows=row_cache(slots.cache, rows, config.num_kv_heads))
    part = rows_of(slots, rows)
    seen = jnp.where((start == 0)[:, None], False, part.seen)
    seen = seen.at[jnp.arange(rows.shape[0])[:, None], tokens].max(valid)
    part = part.replace(request=request, seen=seen, generated=jnp.zeros_like(part.generated), length=start + count,
                        count=jnp.zeros_like(count), finish=jnp.where(last, RUNNING, FREE).astype(jnp.int32))
    return with_rows(slots.replace(cache=None), rows, part).replace(cache=cache), logits[:, 0]


@functools.partial(jax.jit, donate_argnums=(0,))
def choose_first(slots: Slots, rows: jax.Array, logits: jax.Array) -> Slots:
    """The first token of each of R rows that `extend` made run (with its top logprobs; among the tokens its
    `allowed` mask lets through), from its logits [R, V]; rows: [R] int32, as extend's (≥ B: padding). A program of
    its own: the sampler compiles once per R, not once per extend shape."""
    TRACES["choose_first"] += 1
    return with_rows(slots, rows, choose(rows_of(slots, rows), logits, slots.cache.max_len, top=True))


def rows_of(slots: Slots, rows: jax.Array) -> Slots:
    """The state of rows [R] (≥ B: padding, zeros), every field but the cache (None)."""
    return jax.tree.map(lambda column: take_rows(column, rows), slots.replace(cache=None))


def with_rows(slots: Slots, rows: jax.Array, part: Slots) -> Slots:
    """slots with rows [R] (≥ B: dropped) replaced by part's (every field but the cache, which stays slots')."""
    state = jax.tree.map(lambda whole, new: whole.at[rows].set(new, mode="drop"), slots.replace(cache=None),
                         part.replace(cache=None))
    return state.replace(cache=slots.cache)


def decode(params: Params, config: Config, slots: Slots, steps: jax.Array, out_len: int,
           constrain=None, top: bool = False, plan=None, lora: LoraTable | None = None,
           rows: int | None = None) -> tuple[Slots, Emitted]:
    """Up to `steps` (≤ out_len) single-token steps over every running row, until none is running.

    Each step feeds every running row its last token at position length - 1; other rows feed position
    -1, which writes nothing and is masked. Returns the state and what each row emitted (with each
    token's TOP_LOGPROBS most likely alternatives when `top`). plan, lora: as `extend`'s. rows: the steps run over
    the state's first `rows` rows only, at the cost of a step of that many rows (every running row must be among
    them: the others emit nothing); None: every row. Runs the program compiled with the plan's compiler options
    for that many rows (`decode_program`)."""
    rows = slots.token.shape[0] if rows is None else rows
    options = plan.decode_options(rows) if plan else ()
    return decode_program(options)(params, config, slots, steps, out_len, constrain, top, plan, lora, rows)


@functools.cache
def decode_program(options: tuple[tuple[str, str], ...] = ()) -> Callable:
    """`decode`'s program, jitted with these XLA compiler options (`Plan.decode_options`)."""
    return jax.jit(decode_rows, static_argnums=(1, 4, 5, 6, 7, 9), donate_argnums=(2,),
                   compiler_options=dict(options) or None)


def decode_rows(params: Params, config: Config, slots: Slots, steps: jax.Array, out_len: int, constrain=None,
                top: bool = False, plan=None, lora: LoraTable | None = None,
                rows: int | None = None) -> tuple[Slots, Emitted]:
    """`decode`'s steps over the state's first `rows` rows (`on_leading_rows`; traced once per program and shape)."""
    TRACES["decode"] += 1
    return on_leading_rows(lambda part: decode_steps(params, config, part, steps, out_len, constrain, top, plan, lora),
                           slots, rows)


def on_leading_rows(steps: Callable, slots: Slots, rows: int | None, *row_inputs) -> tuple[Slots, Emitted]:
    """steps(slots, *row_inputs) -> (Slots, Emitted) over the state's first `rows` rows only (None: every row), at
    the cost of a step of `rows` rows: the steps take those rows of every field but the cache (and of row_inputs',
    [B, ...] each) and the whole cache, whose first rows they read and write in place (`forward` with a cache of more
    rows than its tokens'); the other rows emit nothing."""
    batch = slots.token.shape[0]
    if rows is None or rows == batch:
        return steps(slots, *row_inputs)
    part, *row_inputs = jax.tree.map(lambda column: column[:rows], (slots.replace(cache=None), *row_inputs))
    part, emitted = steps(part.replace(cache=slots.cache), *row_inputs)
    slots = jax.tree.map(lambda whole, new: jax.lax.dynamic_update_slice_in_dim(whole, new, 0, 0),
                         slots.replace(cache=None), part.replace(cache=None)).replace(cache=part.cache)
    return slots, jax.tree.map(lambda column: jnp.pad(column, [(0, batch - rows)] + [(0, 0)] * (column.ndim - 1)),
                               emitted)


def decode_steps(params: Params, config: Config, slots: Slots, steps: jax.Array, out_len: int,
                 constrain=None, top: bool = False, plan=None, lora: LoraTable | None = None) -> tuple[Slots, Emitted]:
    """`decode`'s steps over every row of `slots`."""
    batch = slots.token.shape[0]
    start = slots.count

    def step(carry):
        slots, out, i = carry
        running = slots.finish == RUNNING
        positions = jnp.where(running, slots.length - 1, -1)[:, None]
        logits, cache = forward(params, config, slots.token[:, None], positions, slots.cache, constrain=constrain,
                                lora=row_adapters(lora, slots.request), plan=plan)
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


@functools.partial(jax.jit, static_argnums=(1, 5, 6, 7, 9), donate_argnums=(2,))
def verify(params: Params, config: Config, slots: Slots, drafts: jax.Array, n_drafts: jax.Array,
           constrain=None, top: bool = False, plan=None, lora: LoraTable | None = None,
           rows: int | None = None) -> tuple[Slots, Emitted]:
    """One forward over every running row's last token and its first n_drafts[b] drafts (drafts [B, K]), then
    each row's tokens chosen one by one, as `decode` would choose them, for as long as each equals the draft
    fed after it: the row emits its accepted drafts and one token more (up to K + 1 tokens, fewer where it
    stops). Greedy and seeded rows give exactly decode's tokens (token n is drawn with the row's key folded
    with n, from logits conditioned on the tokens it chose). plan, lora: as `extend`'s; rows: as `decode`'s.
    Returns the state and what each row emitted."""
    TRACES["verify"] += 1
    return on_leading_rows(lambda part, part_drafts, part_n: verify_rows(params, config, part, part_drafts, part_n,
                                                                         constrain, top, plan, lora),
                           slots, rows, drafts, n_drafts)


def verify_rows(params: Params, config: Config, slots: Slots, drafts: jax.Array, n_drafts: jax.Array,
                constrain=None, top: bool = False, plan=None, lora: LoraTable | None = None) -> tuple[Slots, Emitted]:
    """`verify` over every row of `slots`."""
    width = drafts.shape[1] + 1
    running = slots.finish == RUNNING
    columns = jnp.arange(width)
    positions = jnp.where(running[:, None] & (columns <= n_drafts[:, None]), slots.length[:, None] - 1 + columns, -1)
    tokens = jnp.concatenate([slots.token[:, None], drafts], axis=1)
    logits, cache = forward(params, config, tokens, positions, slots.cache, constrain=constrain,
                            lora=row_adapters(lora, slots.request), plan=plan)
    start = slots.count
    next_drafts = jnp.concatenate([drafts, jnp.full_like(drafts[:, :1], -1)], axis=1)

    def step(carry, column):
        slots, accepting = carry
        slots = choose(slots, logits[:, column], max_len, top, active=accepting)
        accepting = (accepting & (slots.finish == RUNNING) & (column < n_drafts)
                     & (slots.token == next_drafts[:, column]))
        return (slots, accepting), (slots.token, slots.logprob, slots.top_ids, slots.top_logprobs)

    max_len = slots.cache.max_len
    (rows, _), out = jax.lax.scan(step, (slots.replace(cache=None), running), columns)
    slots = rows.replace(cache=cache)
    tokens, logprobs, top_ids, top_logprobs = (jnp.moveaxis(column, 0, 1) for column in out)
    return slots, Emitted(tokens=tokens, logprobs=logprobs, count=slots.count - start, top_ids=top_ids,
                          top_logprobs=top_logprobs)


@functools.partial(jax.jit, donate_argnums=(0,))
def free(slots: Slots, slot: jax.Array) -> Slots:
    """Row `slot` emptied: FREE (its keys and values are left: a new request overwrites them before reading)."""
    TRACES["free"] += 1
    return slots.replace(finish=slots.finish.at[slot].set(FREE), count=slots.count.at[slot].set(0))
