"""The paged engine's device side (DESIGN.md decision 20): the pool of pages (`models.paged.PagedCache`), each row's
request state (`decode.Slots`' per-row fields: sampling, stop ids, budget, penalties' counts, grammar mask), and one
program that runs a `scheduler.StepPlan` in one dispatch and reads its results back once.

    inputs = runner.inputs(plan)          # the plan as host arrays (what a lockstep leader sends its followers)
    chosen = runner.execute(inputs, lora) # one dispatch, one packed host read
    result = runner.result(plan, chosen)  # a scheduler.StepResult

A step's shapes are buckets, so programs are few and fixed: T tokens (powers of two from 16 up to max_step_tokens,
and max_step_tokens), S = rows sequences, M = a max_len request's pages in the table, and K + 1 choices per sequence
(K: the most speculative drafts). Attention loops over the pages the step's longest sequence holds, a bound taken on
the device (`ops.paged_attention`), so a step of short requests reads their pages, not max_len's. A decoding
sequence feeds its last token and its drafts; its tokens are chosen one by one from their logits, for as long as
each equals the draft fed after it (`decode.verify`'s rule), so a request's tokens are those `generate` gives for
the same arguments, greedy or seeded, however many drafts were verified. Sampling is `decode.choose`'s.
"""

import functools
from collections import deque

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from linnet_jax.decode import FREE, RUNNING, TOP_LOGPROBS, TRACES, Request, Slots, choose, empty_slots, rows_of, with_rows
from linnet_jax.inputs import STOP_ID_SLOTS, buckets, fitting, sampling_options
from linnet_jax.loaded import Model
from linnet_jax.models.config import Config
from linnet_jax.models.lora import LoraTable
from linnet_jax.models.paged import PagedCache, StepLayout, init_pages, paged_forward
from linnet_jax.models.params import Params
from linnet_jax.ops import quantized
from linnet_jax.ops.paged_attention import token_places
from linnet_jax.serve.scheduler import StepPlan, StepResult
from linnet_jax.sharding import hosts


@flax.struct.dataclass
class Chosen:
    """What a step chose, per sequence [S]: up to K + 1 tokens [S, K + 1] (count [S] of them), their logprobs, their
    TOP_LOGPROBS most likely alternatives [S, K + 1, TOP_LOGPROBS] (zeros unless asked for), and its row's finish
    state after them."""

    tokens: jax.Array
    logprobs: jax.Array
    count: jax.Array
    finish: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


def where_rows(pick: jax.Array, new, old):
    """Per row, `new`'s fields where pick [S] holds, else `old`'s (pytrees of [S, ...] arrays)."""
    return jax.tree.map(lambda a, b: jnp.where(pick.reshape(pick.shape + (1,) * (a.ndim - 1)), a, b), new, old)


def top_of(logits: jax.Array, want: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The TOP_LOGPROBS most likely ids and logprobs of logits [S, V] (under the raw logits), computed only when
    `want` (a scalar bool); zeros otherwise."""
    def top():
        logprobs, ids = jax.lax.top_k(jax.nn.log_softmax(logits), TOP_LOGPROBS)
        return ids.astype(jnp.int32), logprobs

    def none():
        shape = (logits.shape[0], TOP_LOGPROBS)
        return jnp.zeros(shape, jnp.int32), jnp.zeros(shape, jnp.float32)

    return jax.lax.cond(want, top, none)


@functools.partial(jax.jit, static_argnames=("config", "max_len", "choices", "plan"), donate_argnames=("state",))
def packed_step(params: Params, config: Config, state: Slots, tokens: jax.Array, layout: StepLayout,
                rows: jax.Array, new: jax.Array, choosing: jax.Array, prompt: jax.Array, drafts: jax.Array,
                requests: Request, top: jax.Array, max_len: int, choices: int, plan=None,
                lora: LoraTable | None = None) -> tuple[Slots, Chosen]:
    """One step: the packed tokens [T] through `paged_forward` (their keys and values into their pages, each token
    with its request's adapter entry), then each choosing sequence's tokens from its logits (module docstring).

    rows [S]: each sequence's state row (≥ the rows: padding); new [S]: its row begins (takes requests' row, its
    counts reset); choosing [S]: a decode or a prompt's last chunk; prompt [S]: it feeds prompt tokens (they join
    its `seen`); drafts [S]: how many of its tokens after the first are drafts (a decode's; K = choices - 1 at
    most); top: a scalar bool, report the alternatives; plan: the hardware plan the params were made for
    (`Model.plan`, its einsum; params: `Model.decode_params`). Returns the state and what each sequence chose."""
    TRACES["packed_step"] += 1
    part = rows_of(state, rows)
    zeroed = part.replace(seen=jnp.zeros_like(part.seen), generated=jnp.zeros_like(part.generated),
                          count=jnp.zeros_like(part.count), request=requests)
    part = where_rows(new, zeroed, part)
    sequence, _, real = token_places(layout.cu_q_lens, layout.kv_lens, layout.num_seqs, tokens.shape[0])
    ends = jnp.maximum(layout.cu_q_lens[1:] - 1, 0)  # [S] each sequence's last token
    columns = jnp.arange(choices)
    places = jnp.minimum(ends[:, None] - drafts[:, None] + columns, ends[:, None])  # [S, K + 1]
    adapters = None if lora is None else lora.rows(part.request.adapter[sequence])
    logits, cache = paged_forward(params, config, tokens, state.cache, layout, places.reshape(-1), adapters,
                                  quantized.einsum if plan is None else plan.einsum)
    logits = logits.reshape(*places.shape, -1)  # [S, K + 1, V]
    following = tokens[jnp.minimum(places + 1, tokens.shape[0] - 1)]  # [S, K + 1] the draft after each choice
    part = part.replace(seen=part.seen.at[sequence, tokens].max(real & prompt[sequence]),
                        length=layout.kv_lens - drafts, finish=jnp.where(choosing, RUNNING, FREE).astype(jnp.int32))
    start = part.count

    def step(carry, column):
        part, accepting = carry
        part = choose(part, logits[:, column], max_len, top=False, active=accepting)
        top_ids, top_logprobs = top_of(logits[:, column], top)
        accepting = (accepting & (part.finish == RUNNING) & (column < drafts)
                     & (part.token == following[:, column]))
        return (part, accepting), (part.token, part.logprob, top_ids, top_logprobs)

    (part, _), out = jax.lax.scan(step, (part, choosing), columns)
    chosen_tokens, logprobs, top_ids, top_logprobs = (jnp.moveaxis(column, 0, 1) for column in out)
    chosen = Chosen(tokens=chosen_tokens, logprobs=logprobs, count=part.count - start, finish=part.finish,
                    top_ids=top_ids, top_logprobs=top_logprobs)
    return with_rows(state.replace(cache=cache), rows, part), chosen


@functools.partial(jax.jit, donate_argnums=(0,))
def scrub_pages(cache: PagedCache, pages: jax.Array) -> PagedCache:
    """The cache with pages [M] (≥ P: none) zeroed in every layer: after a request that failed, whose pages may hold
    NaN, which a later request's masked positions would still multiply (0 × NaN) in attention's product."""
    TRACES["scrub"] += 1
    return cache.replace(k=tuple(k.at[pages].set(0, mode="drop") for k in cache.k),
                         v=tuple(v.at[pages].set(0, mode="drop") for v in cache.v))


def new_state(model: Model, rows: int, pages: int, page_size: int) -> Slots:
    """Free rows and an empty pool, made where the weights are (replicated over a mesh's devices)."""
    def make():
        state = empty_slots(model.config, rows, 1, STOP_ID_SLOTS, model.params.dtype)
        return state.replace(cache=init_pages(model.config, pages, page_size))

    sharding = model.params.sharding if model.layout is None else model.layout.replicated()
    return jax.jit(make, out_shardings=sharding)()


class PagedRunner:
    """The pool, the rows' state and the step program over them (see the module docstring). drafts: the most
    speculative drafts a decoding sequence feeds (K)."""

    def __init__(self, model: Model, rows: int, pages: int, page_size: int, max_len: int, max_step_tokens: int,
                 drafts: int = 0):
        self.model, self.rows, self.pages, self.page_size, self.max_len = model, rows, pages, page_size, max_len
        self.choices = drafts + 1
        self.state = new_state(model, rows, pages, page_size)
        self.token_buckets = buckets(max_step_tokens)
        self.columns = -(-max_len // page_size)  # M: a max_len request's pages
        self.filler = sampling_options(model, 1).requests(1)  # the request row of sequences that begin nothing
        self.shapes: deque[tuple[int, int]] = deque(maxlen=65536)  # the latest steps' (token bucket T, page columns
        # their attention read)

    def inputs(self, plan: StepPlan) -> dict:
        """The plan as the step program's host inputs (numpy arrays and a stacked Request)."""
        parts, rows = plan.scheduled, self.rows
        tokens = np.zeros(fitting(self.token_buckets, plan.tokens), np.int32)
        tokens[:plan.tokens] = [token for part in parts for token in part.tokens]
        spans = np.zeros(rows + 1, np.int32)
        spans[1:len(parts) + 1] = np.cumsum([len(part.tokens) for part in parts])
        spans[len(parts) + 1:] = plan.tokens
        table = np.zeros((rows, self.columns), np.int32)
        kv_lens, state_rows = np.zeros(rows, np.int32), np.full(rows, rows, np.int32)
        new, choosing, prompt = np.zeros(rows, bool), np.zeros(rows, bool), np.zeros(rows, bool)
        drafts, requests = np.zeros(rows, np.int32), [self.filler] * rows
        for i, part in enumerate(parts):
            table[i, :len(part.pages)] = part.pages
            kv_lens[i], state_rows[i] = part.start + len(part.tokens), part.sequence.row
            new[i], choosing[i], prompt[i], drafts[i] = part.new, part.choosing, part.prompt, part.drafts
            requests[i] = part.sequence.request if part.new else self.filler
        return {"tokens": tokens, "kv_lens": kv_lens, "page_indices": table, "cu_q_lens": spans,
                "num_seqs": np.asarray([len(parts)], np.int32), "rows": state_rows, "new": new,
                "choosing": choosing, "prompt": prompt, "drafts": drafts,
                "requests": jax.tree.map(lambda *columns: np.concatenate(columns), *requests),
                "top": np.asarray(any(part.sequence.top for part in parts))}

    def execute(self, inputs: dict, lora: LoraTable | None = None) -> Chosen:
        """One dispatch of the step program over `inputs` (lora: the adapter table the requests' entries index);
        what it chose, read back once."""
        layout = StepLayout(kv_lens=inputs["kv_lens"], page_indices=inputs["page_indices"],
                            cu_q_lens=inputs["cu_q_lens"], num_seqs=inputs["num_seqs"])
        used = inputs["kv_lens"][:int(inputs["num_seqs"][0])]
        self.shapes.append((inputs["tokens"].shape[0], -(-int(used.max(initial=0)) // self.page_size)))
        self.state, chosen = packed_step(self.model.decode_params, self.model.config, self.state, inputs["tokens"], layout,
                                         inputs["rows"], inputs["new"], inputs["choosing"], inputs["prompt"],
                                         inputs["drafts"], inputs["requests"], inputs["top"], max_len=self.max_len,
                                         choices=self.choices, plan=self.model.plan, lora=lora)
        leaves, tree = jax.tree.flatten(chosen)
        return jax.tree.unflatten(tree, hosts(*leaves))

    @staticmethod
    def result(plan: StepPlan, chosen: Chosen) -> StepResult:
        """The scheduler's view of what the plan's sequences chose."""
        counts = chosen.count[:len(plan.scheduled)].tolist()
        return StepResult(tokens=tuple(tuple(row[:n]) for row, n in zip(chosen.tokens.tolist(), counts)),
                          states=tuple(chosen.finish[:len(counts)].tolist()),
                          logprobs=tuple(tuple(row[:n]) for row, n in zip(chosen.logprobs.tolist(), counts)))

    def run(self, plan: StepPlan, lora: LoraTable | None = None) -> StepResult:
        """The plan in one dispatch; what it chose."""
        return self.result(plan, self.execute(self.inputs(plan), lora))

    def scrub(self, pages: np.ndarray) -> None:
        """Zero pages [M] of the pool (padded with the pool's size: none)."""
        self.state = self.state.replace(cache=scrub_pages(self.state.cache, pages))

    def compile_all(self, lora: LoraTable | None = None) -> None:
        """Run each program once over nothing (every token padding, no row changed): warm-up."""
        empty = StepPlan(())
        for size in self.token_buckets:
            inputs = self.inputs(empty)
            inputs["tokens"] = np.zeros(size, np.int32)
            self.execute(inputs, lora)
        self.scrub(np.full(self.columns, self.pages, np.int32))
