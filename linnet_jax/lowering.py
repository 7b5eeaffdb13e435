"""`lowered`: the StableHLO of every program linnet_jax compiles, lowered for an accelerator from any machine.

The programs are the ones `generate`, `serve.Engine` and a train step compile: `extend_{C}` (a prompt's
first chunk of C tokens, attending to its own C keys) and `extend_{C}_continued` (a later chunk, reading the
row's max_len slots, or on a CPU the fewest spans that hold its keys: `ops.attention.key_spans`) for each width C
of the engine's prefill dispatches (`inputs.prefill_widths` of its prefill_chunk), `choose_first` (the first
token of the prompts a chunk ends), `decode`, `verify` (n-gram drafts), `free` (a slot emptied), the
serving engine's token-packed step over a paged cache at 16 and at STEP_TOKENS tokens (`step_16`, `step_512`:
`serve.runner.packed_step`, with DRAFTS drafts a sequence), `scrub_pages` (a failed request's pages zeroed), and
`train_step` (AdamW, full fine-tuning); and, for an engine serving LoRA adapters, each
extend, decode, verify and step again as `{name}_lora` (taking the engine's adapter table: its default max_loras
adapters and the base, at its default max_lora_rank) and `put_lora` (an adapter written into the table).
Each takes what it takes on that platform under its hardware plan (`linnet_jax.backend`): on a GPU or
TPU the stacked `[layers, ...]` weights, sliced inside the program, and XLA's own products. Nothing is
placed on a device: the arguments are shapes (`jax.ShapeDtypeStruct`) and `Traced.lower` takes the
platform (`lowering_platforms`), so a CPU machine reads the program a GPU or TPU will get.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from linnet_jax.adapters import DEFAULT_MAX_LORA_RANK, DEFAULT_MAX_LORAS, put_entry
from linnet_jax.backend import decode_params, plan_for_platform
from linnet_jax.decode import choose_first, decode_program, empty_slots, extend, free, verify
from linnet_jax.inputs import MIN_BUCKET, STOP_ID_SLOTS, make_requests, make_sampling, prefill_widths
from linnet_jax.loaded import Model
from linnet_jax.models.config import Config
from linnet_jax.models.lora import FIELDS, LoraConfig, LoraTable, lora_shapes
from linnet_jax.models.paged import StepLayout
from linnet_jax.serve.engine import DEFAULT_PAGE_SIZE
from linnet_jax.serve.runner import new_state, packed_step, scrub_pages
from linnet_jax.train.step import init_state, make_train_step

LOWERING_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
DECODE_STEPS = 8  # steps per decode call (`generate` runs 4 when streaming, 32 watching stop strings, or to the end)
PREFILL_CHUNK = 256  # the widest chunk: `serve.Engine`'s default prefill_chunk
DRAFTS = 4  # drafts per row a verify call checks: vLLM's usual num_speculative_tokens
STEP_TOKENS = 2 * PREFILL_CHUNK  # the most tokens of a serving step: `serve.Engine`'s default max_step_tokens
TRAIN_LEARNING_RATE = 1e-4


def shapes(tree):
    """A pytree of arrays as a pytree of jax.ShapeDtypeStruct (nothing read, nothing placed)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


def lowered(model: Model, platform: str, *, batch: int = 1, max_len: int = 1024) -> dict[str, str]:
    """{program name: StableHLO text} of every program generate, serve.Engine and a train step compile, lowered
    for `platform` ("cpu", "cuda", "rocm" or "tpu") on one device of it, for a decode state of `batch` rows of
    `max_len` cache slots (the train step: a batch of `batch` rows of `max_len` tokens)."""
    if platform not in LOWERING_PLATFORMS:
        raise ValueError(f"platform must be one of {LOWERING_PLATFORMS}, got {platform!r}")
    if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or batch < 1:
        raise ValueError(f"batch must be a positive int, got {batch!r}")
    context = model.config.max_position_embeddings
    if isinstance(max_len, bool) or not isinstance(max_len, (int, np.integer)) or not MIN_BUCKET <= max_len <= context:
        raise ValueError(f"max_len must be an int in [{MIN_BUCKET}, {context}] (the model's context), got {max_len!r}")
    config, plan, platforms = model.config, plan_for_platform(platform), (platform,)
    params = shapes(decode_params(model.params, plan))
    dtype = model.params.dtype
    request = shapes(make_requests(make_sampling(1, 0.0, 0, 1.0, 0.0, 1.0, 0), np.full(STOP_ID_SLOTS, -1, np.int32), 1))
    slots = jax.eval_shape(lambda: empty_slots(config, batch, max_len, STOP_ID_SLOTS, dtype))
    slot = jax.ShapeDtypeStruct((), jnp.int32)
    row = jax.ShapeDtypeStruct((1,), jnp.int32)
    drafts = jax.ShapeDtypeStruct((batch, DRAFTS), jnp.int32)
    table = table_shapes(config, DEFAULT_MAX_LORAS + 1, DEFAULT_MAX_LORA_RANK, config.dtype)
    programs = {}
    for suffix, lora in (("", None), ("_lora", table)):
        for width in prefill_widths(PREFILL_CHUNK, max_len):
            chunk = (params, config, slots, row, jax.ShapeDtypeStruct((1, width), jnp.int32), row, row, request,
                     jax.ShapeDtypeStruct((1,), jnp.bool_))
            programs[f"extend_{width}{suffix}"] = extend.trace(*chunk, plan=plan, fresh=True, lora=lora)
            programs[f"extend_{width}_continued{suffix}"] = extend.trace(*chunk, plan=plan, lora=lora)
        programs[f"decode{suffix}"] = decode_program(plan.decode_options(batch)).trace(
            params, config, slots, slot, DECODE_STEPS, plan=plan, lora=lora)
        programs[f"verify{suffix}"] = verify.trace(params, config, slots, drafts,
                                                   jax.ShapeDtypeStruct((batch,), jnp.int32), plan=plan, lora=lora)
        for tokens in (MIN_BUCKET, STEP_TOKENS):
            programs[f"step_{tokens}{suffix}"] = step_traced(model, params, plan, batch, max_len, tokens, lora)
    programs["choose_first"] = choose_first.trace(slots, row, jax.ShapeDtypeStruct((1, config.vocab_size),
                                                                                 jnp.float32))
    programs["free"] = free.trace(slots, slot)
    pool = jax.eval_shape(lambda: new_state(model, batch, pages_for(batch, max_len), DEFAULT_PAGE_SIZE)).cache
    programs["scrub_pages"] = scrub_pages.trace(pool, jax.ShapeDtypeStruct((pool.k[0].shape[0],), jnp.int32))
    entry = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), table)  # one entry's a, b, scale
    programs["put_lora"] = put_entry.trace(table, slot, entry.a, entry.b, entry.scale)
    programs["train_step"] = train_step_traced(model, batch, max_len)
    return {name: traced.lower(lowering_platforms=platforms).as_text() for name, traced in programs.items()}


def pages_for(batch: int, max_len: int) -> int:
    """A pool that holds `batch` requests of max_len positions, in pages of DEFAULT_PAGE_SIZE."""
    return batch * -(-max_len // DEFAULT_PAGE_SIZE)


def step_traced(model: Model, params, plan, rows: int, max_len: int, tokens: int,
                lora: LoraTable | None) -> jax.stages.Traced:
    """The serving engine's step (`serve.runner.packed_step`) of `tokens` packed tokens for `rows` sequences of up
    to max_len positions, over a pool of pages that holds them all, each sequence choosing up to 1 + DRAFTS tokens;
    params: the plan's (shapes)."""
    state = jax.eval_shape(lambda: new_state(model, rows, pages_for(rows, max_len), DEFAULT_PAGE_SIZE))
    ints, flags = jax.ShapeDtypeStruct((rows,), jnp.int32), jax.ShapeDtypeStruct((rows,), jnp.bool_)
    layout = StepLayout(kv_lens=ints, page_indices=jax.ShapeDtypeStruct((rows, pages_for(1, max_len)), jnp.int32),
                        cu_q_lens=jax.ShapeDtypeStruct((rows + 1,), jnp.int32),
                        num_seqs=jax.ShapeDtypeStruct((1,), jnp.int32))
    requests = jax.tree.map(lambda x: jax.ShapeDtypeStruct((rows, *x.shape[1:]), x.dtype), state.request)
    return packed_step.trace(params, model.config, state, jax.ShapeDtypeStruct((tokens,), jnp.int32),
                             layout, ints, flags, flags, flags, ints, requests, jax.ShapeDtypeStruct((), jnp.bool_),
                             max_len=max_len, choices=1 + DRAFTS, plan=plan, lora=lora)


def table_shapes(config: Config, entries: int, rank: int, dtype) -> LoraTable:
    """The shapes of an engine's adapter table (`linnet_jax.adapters.AdapterTable`): `entries` entries of rank
    `rank` on every projection, a [N, L, *I, R] and b [N, L, R, *O] in `dtype`, scale [N] float32."""
    def stacked(part: str) -> dict[str, jax.ShapeDtypeStruct]:
        return {field: jax.ShapeDtypeStruct((entries, *lora_shapes(config, field, rank)[part]), dtype)
                for field in FIELDS}

    return LoraTable(a=stacked("a"), b=stacked("b"), scale=jax.ShapeDtypeStruct((entries,), jnp.float32))


def train_step_traced(model: Model, batch: int, length: int) -> jax.stages.Traced:
    """One AdamW fine-tuning step (`train.step.make_train_step`) traced over a [batch, length] batch: full, or LoRA's
    default adapters over a quantized model's frozen weights (QLoRA)."""
    optimizer, lora = optax.adamw(TRAIN_LEARNING_RATE), LoraConfig() if model.quantization else None
    state = jax.eval_shape(lambda: init_state(model, optimizer, lora=lora))
    tokens = jax.ShapeDtypeStruct((batch, length), jnp.int32)
    return jax.jit(make_train_step(optimizer, lora=lora)).trace(state, {"tokens": tokens, "loss_mask": tokens})
