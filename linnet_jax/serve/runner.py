"""The paged engine's device side (DESIGN.md decision 20): the pool of pages (`models.paged.PagedCache`), each row's
request state (`decode.Slots`' per-row fields: sampling, stop ids, budget, penalties' counts), and one program that
runs a `scheduler.StepPlan` in one dispatch and reads its results back once.

A step's shapes are buckets, so programs are few and fixed: T tokens (powers of two from 16 up to max_step_tokens,
and max_step_tokens), S = rows sequences, M page-table columns (powers of two up to a max_len request's pages):
attention reads a step's longest sequence's pages, not max_len's. Sampling is `decode.choose`'s, so a request's
tokens are those `generate` gives for the same arguments.
"""

import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from linnet_jax.decode import FREE, RUNNING, TRACES, Request, Slots, choose, empty_slots, rows_of, with_rows
from linnet_jax.inputs import MIN_BUCKET, STOP_ID_SLOTS, sampling_options
from linnet_jax.loaded import Model
from linnet_jax.models.config import Config
from linnet_jax.models.lora import LoraTable
from linnet_jax.models.paged import StepLayout, init_pages, paged_forward
from linnet_jax.models.params import Params
from linnet_jax.ops.paged_attention import token_places
from linnet_jax.serve.engine import powers_up_to
from linnet_jax.serve.scheduler import StepPlan, StepResult


@flax.struct.dataclass
class Chosen:
    """What a step chose, per sequence [S]: its token, that token's logprob and its row's finish state."""

    token: jax.Array
    logprob: jax.Array
    finish: jax.Array


def where_rows(pick: jax.Array, new, old):
    """Per row, `new`'s fields where pick [S] holds, else `old`'s (pytrees of [S, ...] arrays)."""
    return jax.tree.map(lambda a, b: jnp.where(pick.reshape(pick.shape + (1,) * (a.ndim - 1)), a, b), new, old)


@functools.partial(jax.jit, static_argnames=("config", "max_len"), donate_argnames=("state",))
def packed_step(params: Params, config: Config, state: Slots, tokens: jax.Array, layout: StepLayout,
                rows: jax.Array, new: jax.Array, choosing: jax.Array, requests: Request, max_len: int,
                lora: LoraTable | None = None) -> tuple[Slots, Chosen]:
    """One step: the packed tokens [T] through `paged_forward` (their keys and values into their pages, each token
    with its request's adapter entry), then each choosing sequence's next token from its last token's logits
    (`decode.choose`). rows [S]: each sequence's state row (≥ the rows: padding); new [S]: its row begins (takes
    requests' row, its counts reset); choosing [S]: a decode or a prompt's last chunk. Returns the state and what
    each sequence chose."""
    TRACES["packed_step"] += 1
    part = rows_of(state, rows)
    zeroed = part.replace(seen=jnp.zeros_like(part.seen), generated=jnp.zeros_like(part.generated),
                          count=jnp.zeros_like(part.count), request=requests)
    part = where_rows(new, zeroed, part)
    sequence, _, real = token_places(layout.cu_q_lens, layout.kv_lens, layout.num_seqs, tokens.shape[0])
    adapters = None if lora is None else lora.rows(part.request.adapter[sequence])
    logits, cache = paged_forward(params, config, tokens, state.cache, layout,
                                  jnp.maximum(layout.cu_q_lens[1:] - 1, 0), adapters)
    part = part.replace(seen=part.seen.at[sequence, tokens].max(real), length=layout.kv_lens,
                        finish=jnp.where(choosing, RUNNING, FREE).astype(jnp.int32))
    part = choose(part, logits, max_len, top=False, active=choosing)
    return with_rows(state.replace(cache=cache), rows, part), Chosen(part.token, part.logprob, part.finish)


def bucket(sizes: list[int], count: int) -> int:
    return next(size for size in sizes if size >= count)


class PagedRunner:
    """The pool, the rows' state and the step program over them (see the module docstring)."""

    def __init__(self, model: Model, rows: int, pages: int, page_size: int, max_len: int, max_step_tokens: int):
        self.model, self.rows, self.page_size, self.max_len = model, rows, page_size, max_len
        state = empty_slots(model.config, rows, 1, STOP_ID_SLOTS, model.params.dtype)
        self.state = jax.device_put(state.replace(cache=init_pages(model.config, pages, page_size)),
                                    model.params.sharding)
        self.token_buckets = [size for size in powers_up_to(max_step_tokens) if size >= MIN_BUCKET] or [max_step_tokens]
        self.column_buckets = powers_up_to(-(-max_len // page_size))
        self.filler = sampling_options(model, 1).requests(1)  # the request row of sequences that begin nothing
        self.shapes: list[tuple[int, int]] = []  # each step's program shape: (token bucket T, table columns M)

    def run(self, plan: StepPlan, lora: LoraTable | None = None) -> StepResult:
        """The plan in one dispatch (lora: the adapter table the requests' entries index); what it chose read back
        once."""
        parts, rows = plan.scheduled, self.rows
        tokens = np.zeros(bucket(self.token_buckets, plan.tokens), np.int32)
        tokens[:plan.tokens] = [token for part in parts for token in part.tokens]
        spans = np.zeros(rows + 1, np.int32)
        spans[1:len(parts) + 1] = np.cumsum([len(part.tokens) for part in parts])
        spans[len(parts) + 1:] = plan.tokens
        table = np.zeros((rows, bucket(self.column_buckets, max(len(part.pages) for part in parts))), np.int32)
        kv_lens, state_rows = np.zeros(rows, np.int32), np.full(rows, rows, np.int32)
        new, choosing = np.zeros(rows, bool), np.zeros(rows, bool)
        requests = [self.filler] * rows
        for i, part in enumerate(parts):
            table[i, :len(part.pages)] = part.pages
            kv_lens[i], state_rows[i] = part.start + len(part.tokens), part.sequence.row
            new[i], choosing[i] = part.new, part.choosing
            requests[i] = part.sequence.request if part.new else self.filler
        layout = StepLayout(kv_lens=kv_lens, page_indices=table, cu_q_lens=spans,
                            num_seqs=np.asarray([len(parts)], np.int32))
        stacked = jax.tree.map(lambda *columns: np.concatenate(columns), *requests)
        self.shapes.append((tokens.shape[0], table.shape[1]))
        self.state, chosen = packed_step(self.model.params, self.model.config, self.state, tokens, layout, state_rows,
                                         new, choosing, stacked, max_len=self.max_len, lora=lora)
        chosen = jax.tree.map(lambda column: column[:len(parts)], jax.device_get(chosen))
        return StepResult(tuple(chosen.token.tolist()), tuple(chosen.finish.tolist()), tuple(chosen.logprob.tolist()))
