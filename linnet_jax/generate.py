"""`generate`: batched, bucketed decoding with the loop on the device.

A request becomes: prompts left-padded to a bucket of T (powers of two from 16), a static cache
of a bucketed length, per-row sampling arrays, and a padded array of stop ids. Two jitted
programs do the work: `_prefill` (the prompts through the cache and the first token) and
`_decode` (a `lax.while_loop` of single-token steps until every row has stopped or a step
limit). Nothing that changes between requests inside those buckets is static, so a new
prompt length, `max_new_tokens`, temperature or seed reuses the compiled programs.
Streaming and stop strings run `_decode` a few steps at a time and look at the text on the host.
"""

import dataclasses
import functools
from collections.abc import Iterator

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from linnet_jax.model import Model, as_token_batch, on_device
from linnet_jax.models import KVCache, Params, forward, init_cache
from linnet_jax.models.config import Config
from linnet_jax.models.decoder import unstack_cache
from linnet_jax.models.params import unstack_layers
from linnet_jax.ops import SamplingParams, penalize_repeats, sample
from linnet_jax.sharding import Layout, host, put

MIN_BUCKET = 16
STOP_ID_SLOTS = 16  # stop ids travel as a fixed-size array, padded with -1
STREAM_CHUNK = 4  # decode steps per dispatch when streaming
STOP_STRING_CHUNK = 32  # decode steps per dispatch when stop strings are watched
RUNNING, STOP_ID, LENGTH = 0, 1, 2
TRACES = {"prefill": 0, "decode": 0}  # incremented when a program is traced: tests count retraces


@dataclasses.dataclass
class Generation:
    """One row's result: the new text and ids (no eos), why it stopped, and each chosen token's logprob."""

    text: str | None
    tokens: list[int]
    stop_reason: str  # "eos", "stop" or "length"
    logprobs: list[float]


@flax.struct.dataclass
class DecodeState:
    """Everything the decode loop carries. N = the output buffer length (a bucket ≥ max_new_tokens)."""

    cache: KVCache
    tokens: jax.Array  # [B, N] int32, the new tokens
    logprobs: jax.Array  # [B, N] float32, log-softmax of the raw logits at the chosen tokens
    seen: jax.Array  # [B, V] bool, prompt and generated tokens (for the repetition penalty)
    positions: jax.Array  # [B] int32, the position of the last token
    finish: jax.Array  # [B] int32: RUNNING, STOP_ID (a stop id was chosen) or LENGTH
    count: jax.Array  # [B] int32, tokens generated so far (the stop token included)
    step: jax.Array  # int32 scalar, steps taken


def bucket(n: int) -> int:
    """The smallest power of two ≥ n, and at least MIN_BUCKET."""
    return max(MIN_BUCKET, 1 << (max(n, 1) - 1).bit_length())


def choose(state: DecodeState, logits: jax.Array, sampling: SamplingParams, stop_ids: jax.Array,
           max_new: jax.Array) -> DecodeState:
    """Sample each row's next token from logits [B, V] and record it (rows already finished are left alone)."""
    chosen = sample(penalize_repeats(logits, state.seen, sampling.repetition_penalty), sampling, state.step)
    logprob = jnp.take_along_axis(jax.nn.log_softmax(logits), chosen[:, None], axis=-1)[:, 0]
    running = state.finish == RUNNING
    column = jnp.minimum(state.count, state.tokens.shape[1] - 1)[:, None]
    write = lambda buffer, value: jnp.where(  # noqa: E731
        running[:, None], jnp.put_along_axis(buffer, column, value[:, None], axis=1, inplace=False), buffer)
    count = state.count + running
    finish = jnp.where(running & jnp.isin(chosen, stop_ids), STOP_ID, state.finish)
    finish = jnp.where((finish == RUNNING) & (count >= max_new), LENGTH, finish)
    rows = jnp.arange(chosen.shape[0])
    return state.replace(
        tokens=write(state.tokens, chosen),
        logprobs=write(state.logprobs, logprob),
        seen=state.seen.at[rows, chosen].set(state.seen[rows, chosen] | running),
        finish=finish,
        count=count,
        step=state.step + 1,
    )


@functools.partial(jax.jit, static_argnums=(1, 8, 9), donate_argnums=(4,))
def _prefill(params: Params, config: Config, tokens: jax.Array, positions: jax.Array, cache: KVCache,
             sampling: SamplingParams, stop_ids: jax.Array, max_new: jax.Array, out_len: int,
             layout: Layout | None) -> DecodeState:
    """Run the left-padded prompts [B, T] (positions -1 at padding) and choose the first token."""
    TRACES["prefill"] += 1
    batch, length = tokens.shape
    logits, cache = forward(params, config, tokens, positions, cache, logits_at=jnp.full((batch,), length - 1),
                            constrain=layout and layout.constrain)
    seen = jnp.zeros((batch, config.vocab_size), bool).at[jnp.arange(batch)[:, None], tokens].max(positions >= 0)
    state = DecodeState(
        cache=cache,
        tokens=jnp.zeros((batch, out_len), jnp.int32),
        logprobs=jnp.zeros((batch, out_len), jnp.float32),
        seen=seen,
        positions=positions[:, -1],
        finish=jnp.zeros((batch,), jnp.int32),
        count=jnp.zeros((batch,), jnp.int32),
        step=jnp.zeros((), jnp.int32),
    )
    return choose(state, logits[:, 0], sampling, stop_ids, max_new)


@functools.partial(jax.jit, static_argnums=(1, 7), donate_argnums=(2,))
def _decode(params: Params, config: Config, state: DecodeState, sampling: SamplingParams, stop_ids: jax.Array,
            max_new: jax.Array, until_step: jax.Array, layout: Layout | None) -> DecodeState:
    """Single-token steps until every row has finished or `until_step` steps have been taken."""
    TRACES["decode"] += 1

    def step(state: DecodeState) -> DecodeState:
        last = jnp.take_along_axis(state.tokens, (state.count - 1)[:, None], axis=1)
        positions = state.positions + 1
        logits, cache = forward(params, config, last, positions[:, None], state.cache,
                                constrain=layout and layout.constrain)
        return choose(state.replace(cache=cache, positions=positions), logits[:, 0], sampling, stop_ids, max_new)

    def running(state: DecodeState) -> jax.Array:
        return (state.step < until_step) & jnp.any(state.finish == RUNNING)

    return jax.lax.while_loop(running, step, state)


@dataclasses.dataclass
class Request:
    """A batch of prompts as ids, and how to present the results."""

    prompts: list[list[int]]
    single: bool  # one prompt in, one result out
    as_text: bool  # text out (else ids)


def _is_conversation(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) for m in value)


def make_request(model: Model, prompt, tokens, chat: bool | None) -> Request:
    """Turn generate's inputs (a string, strings, a conversation, conversations, or ids) into prompt ids."""
    if (prompt is None) == (tokens is None):
        raise ValueError("give exactly one of prompt (text or conversations) and tokens (lists of ids)")
    if tokens is not None:
        single = len(tokens) > 0 and all(isinstance(t, (int, np.integer)) for t in tokens)
        rows = [list(tokens)] if single else [list(row) for row in tokens]
        for i, row in enumerate(rows):
            as_token_batch(row, model.config.vocab_size, name=f"tokens[{i}]")
        return Request(prompts=[[int(t) for t in row] for row in rows], single=single, as_text=False)
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise ValueError("this model has no tokenizer: pass tokens=[[ids...]] instead of text")
    single = isinstance(prompt, str) or _is_conversation(prompt)
    items = [prompt] if single else list(prompt)
    if not items:
        raise ValueError("prompt is an empty list; expected a string, a conversation, or a list of them")
    return Request(prompts=[_encode(tokenizer, item, chat) for item in items], single=single, as_text=True)


def _encode(tokenizer, item, chat: bool | None) -> list[int]:
    if _is_conversation(item):
        if chat is False:
            raise ValueError("chat=False, but the prompt is a conversation (a list of messages)")
        return tokenizer.apply_chat_template(item, add_generation_prompt=True, tokenize=True)
    if not isinstance(item, str):
        raise ValueError(f"each prompt must be a string or a conversation (a list of message dicts), got {item!r}")
    if chat or (chat is None and tokenizer.chat_template):
        return tokenizer.apply_chat_template([{"role": "user", "content": item}], add_generation_prompt=True,
                                             tokenize=True)
    ids = tokenizer.encode(item, add_special_tokens=True)
    if not ids:
        raise ValueError("the prompt encodes to no tokens")
    return ids


def _per_row(name: str, value, batch: int, dtype) -> np.ndarray:
    array = np.asarray(value, dtype)
    if array.ndim == 0:
        return np.full((batch,), array, dtype)
    if array.shape != (batch,):
        raise ValueError(f"{name} must be a number or one value per prompt ({batch}), got shape {array.shape}")
    return array


def make_sampling(batch: int, temperature, top_k, top_p, min_p, repetition_penalty, seed: int) -> SamplingParams:
    """Per-row sampling arrays, validated; row b's random stream is fold_in(seed, b)."""
    values = dict(
        temperature=_per_row("temperature", temperature, batch, np.float32),
        top_k=_per_row("top_k", top_k, batch, np.int32),
        top_p=_per_row("top_p", top_p, batch, np.float32),
        min_p=_per_row("min_p", min_p, batch, np.float32),
        repetition_penalty=_per_row("repetition_penalty", repetition_penalty, batch, np.float32),
    )
    checks = {
        "temperature": (values["temperature"] >= 0, "≥ 0"),
        "top_k": (values["top_k"] >= 0, "≥ 0"),
        "top_p": ((values["top_p"] > 0) & (values["top_p"] <= 1), "in (0, 1]"),
        "min_p": ((values["min_p"] >= 0) & (values["min_p"] <= 1), "in [0, 1]"),
        "repetition_penalty": (values["repetition_penalty"] > 0, "> 0"),
    }
    for name, (ok, expected) in checks.items():
        if not ok.all():
            raise ValueError(f"{name} must be {expected}, got {values[name].tolist()}")
    keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(jax.random.PRNGKey(seed), jnp.arange(batch))
    return SamplingParams(**{k: jnp.asarray(v) for k, v in values.items()}, keys=keys)


def eos_ids(model: Model) -> set[int]:
    """Every end-of-sequence id the model declares (config, generation config, tokenizer)."""
    return set(model.config.eos_token_ids) | set(model.tokenizer.eos_token_ids if model.tokenizer else ())


def stop_id_array(model: Model, stop_token_ids, ignore_eos: bool) -> jax.Array:
    """Every id that ends a row, padded to STOP_ID_SLOTS with -1."""
    ids = set(stop_token_ids or ())
    if not ignore_eos:
        ids |= eos_ids(model)
    if len(ids) > STOP_ID_SLOTS:
        raise ValueError(f"at most {STOP_ID_SLOTS} stop token ids are supported, got {len(ids)}")
    bad = [i for i in ids if not 0 <= i < model.config.vocab_size]
    if bad:
        raise ValueError(f"stop token id {bad[0]} is outside the vocabulary [0, {model.config.vocab_size})")
    return jnp.asarray(sorted(ids) + [-1] * (STOP_ID_SLOTS - len(ids)), jnp.int32)


def plan_lengths(config: Config, prompts: list[list[int]], max_new_tokens: int, max_len: int | None) -> tuple[int, int]:
    """(prompt bucket T, cache length S), or a ValueError before any work when the request cannot fit."""
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > config.max_position_embeddings:
        raise ValueError(
            f"the longest prompt ({longest} tokens) plus max_new_tokens ({max_new_tokens}) exceeds the model's "
            f"context of {config.max_position_embeddings} positions"
        )
    prompt_bucket = bucket(longest)
    needed = prompt_bucket + max_new_tokens
    if max_len is None:
        return prompt_bucket, bucket(needed)
    if max_len < needed:
        raise ValueError(f"max_len={max_len} is too small: the prompts (padded to {prompt_bucket}) and "
                         f"max_new_tokens={max_new_tokens} need {needed} cache slots")
    return prompt_bucket, max_len


def left_pad(prompts: list[list[int]], length: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and positions [B, length], prompts right-aligned; padding has token 0 and position -1."""
    tokens = np.zeros((len(prompts), length), np.int32)
    positions = np.full((len(prompts), length), -1, np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, length - len(prompt):] = prompt
        positions[row, length - len(prompt):] = np.arange(len(prompt))
    return tokens, positions


def run(model: Model, prompts: list[list[int]], max_new_tokens: int, max_len: int | None,
        sampling: SamplingParams, stop_ids: jax.Array, chunk: int | None) -> Iterator[DecodeState]:
    """Prefill, then decode `chunk` steps per dispatch (all at once when None), yielding the state after each."""
    config, layout = model.config, model.layout
    prompt_bucket, cache_len = plan_lengths(config, prompts, max_new_tokens, max_len)
    tokens, positions = left_pad(prompts, prompt_bucket)
    prompts_in = on_device(model, {"tokens": tokens, "positions": positions}, ("batch", "seq"))
    if layout is None:  # unrolled layers decode faster on XLA:CPU (benchmarks/RESULTS.md)
        params = unstack_layers(model.params)
        cache = unstack_cache(init_cache(config, len(prompts), cache_len, model.params.embed.dtype))
    else:
        params = model.params
        cache = sharded_cache(config, len(prompts), cache_len, model.params.embed.dtype, layout)
        sampling, stop_ids = (jax.tree.map(lambda x: put(x, layout.replicated()), tree) for tree in (sampling, stop_ids))
    state = _prefill(params, config, prompts_in["tokens"], prompts_in["positions"], cache, sampling, stop_ids,
                     np.int32(max_new_tokens), bucket(max_new_tokens), layout)
    yield state
    while (host(state.finish) == RUNNING).any():
        until = max_new_tokens if chunk is None else int(host(state.step)) + chunk
        state = _decode(params, config, state, sampling, stop_ids, np.int32(max_new_tokens), np.int32(until), layout)
        yield state


def sharded_cache(config: Config, batch: int, max_len: int, dtype, layout: Layout) -> KVCache:
    """An empty cache made directly on the mesh, sharded by the layout's rules."""
    shardings = KVCache(**layout.cache_shardings(config, batch, max_len))
    return jax.jit(init_cache, static_argnums=(0, 1, 2, 3), out_shardings=shardings)(config, batch, max_len, dtype)


def row_results(state: DecodeState, eos: set[int]) -> list[tuple[list[int], str, list[float]]]:
    """Each row's (new ids without the stop token, stop reason, logprobs).

    The reason is "eos" for one of the model's eos ids, "stop" for another stop id, else "length".
    """
    tokens, logprobs = host(state.tokens), host(state.logprobs)
    results = []
    for row, (count, finish) in enumerate(zip(host(state.count), host(state.finish))):
        ids, scores = tokens[row, :count].tolist(), logprobs[row, :count].tolist()
        if finish == STOP_ID:
            reason = "eos" if ids[-1] in eos else "stop"
            ids, scores = ids[:-1], scores[:-1]
        else:
            reason = "length"
        results.append((ids, reason, scores))
    return results


def cut_at_stop(text: str, stop: list[str]) -> int | None:
    """Where the earliest stop string begins in text, or None."""
    found = [i for i in (text.find(s) for s in stop) if i >= 0]
    return min(found) if found else None


def finish_row(tokenizer, ids: list[int], reason: str, logprobs: list[float], stop: list[str]) -> Generation:
    """A Generation, with the text cut before the first stop string (and the ids after it dropped)."""
    if tokenizer is None:
        return Generation(text=None, tokens=ids, stop_reason=reason, logprobs=logprobs)
    text = tokenizer.decode(ids)
    cut = cut_at_stop(text, stop)
    if cut is None:
        return Generation(text=text, tokens=ids, stop_reason=reason, logprobs=logprobs)
    keep = next(n for n in range(1, len(ids) + 1) if cut_at_stop(tokenizer.decode(ids[:n]), stop) is not None)
    return Generation(text=text[:cut], tokens=ids[:keep], stop_reason="stop", logprobs=logprobs[:keep])


def held_back(text: str, stop: list[str]) -> int:
    """How many trailing characters of streamed text to hold: a partial UTF-8 char or a stop string's prefix."""
    hold = 1 if text.endswith("\ufffd") else 0
    for s in stop:
        hold = max(hold, *(n for n in range(1, len(s)) if text.endswith(s[:n])), 0)
    return hold


def generate(model: Model, prompt=None, max_new_tokens: int = 128, *, tokens=None, max_len: int | None = None,
             temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, seed: int = 0,
             stop: str | list[str] | None = None, stop_token_ids=None, ignore_eos: bool = False,
             chat: bool | None = None, stream: bool = False, return_details: bool = False):
    """Generate from text, conversations or ids. See the README for every input and result form.

    prompt: a string, a list of strings, a conversation ([{"role", "content"}, ...]) or a list of
    them; or tokens: a list of id lists. Greedy at temperature 0; otherwise temperature, top_k,
    top_p, min_p and repetition_penalty (numbers, or one per prompt), seeded. Stops at the model's
    eos ids and stop_token_ids (unless ignore_eos), at stop strings, or after max_new_tokens.
    stream=True (one prompt) returns an iterator of text pieces.
    """
    request = make_request(model, prompt, tokens, chat)
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if stops and model.tokenizer is None:
        raise ValueError("stop strings need a tokenizer; this model has none (use stop_token_ids)")
    if stream and not (request.single and request.as_text):
        raise ValueError("stream=True takes one text prompt or conversation, not a batch or token ids")
    batch = len(request.prompts)
    sampling = make_sampling(batch, temperature, top_k, top_p, min_p, repetition_penalty, seed)
    stop_ids = stop_id_array(model, stop_token_ids, ignore_eos)
    chunk = STREAM_CHUNK if stream else (STOP_STRING_CHUNK if stops else None)
    states = run(model, request.prompts, max_new_tokens, max_len, sampling, stop_ids, chunk)
    if stream:
        return _stream(model.tokenizer, states, stops, eos_ids(model))
    rows = []
    for state in states:
        rows = [finish_row(model.tokenizer, *row, stops) for row in row_results(state, eos_ids(model))]
        if stops and all(r.stop_reason != "length" for r in rows):
            break
    results = rows if return_details else [r.text if request.as_text else r.tokens for r in rows]
    return results[0] if request.single else results


def _stream(tokenizer, states: Iterator[DecodeState], stops: list[str], eos: set[int]) -> Iterator[str]:
    """Yield the new text after each dispatch, holding back what a stop string or a partial char may change."""
    emitted = 0
    for state in states:
        generation = finish_row(tokenizer, *row_results(state, eos)[0], stops)
        done = generation.stop_reason == "stop" or host(state.finish)[0] != RUNNING
        safe = len(generation.text) if done else len(generation.text) - held_back(generation.text, stops)
        if safe > emitted:
            yield generation.text[emitted:safe]
            emitted = safe
        if done:
            return
