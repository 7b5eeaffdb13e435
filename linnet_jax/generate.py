"""`generate`: batched, bucketed decoding on the decode core's per-slot primitives (`linnet_jax.decode`).

A call becomes: each prompt left-padded to a bucket of T (powers of two from 16) and prefilled on
its own, inserted into its row of a decode state of a bucketed length, then `decode` steps with
the loop on the device until every row has stopped. Everything a request owns (sampling values,
random key, stop ids, max_new_tokens) is an array in its row, so a new prompt length inside a
bucket, max_new_tokens, temperature or seed reuses the compiled programs, and a row's tokens do
not depend on the rows beside it. Streaming and stop strings run `decode` a few steps at a time
and look at the text on the host.
"""

import dataclasses
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from linnet_jax.decode import FREE, LENGTH, RUNNING, STOP_ID, TRACES, Request, Slots, decode, empty_slots, insert, prefill
from linnet_jax.model import Model, as_token_batch
from linnet_jax.models.config import Config
from linnet_jax.ops import SamplingParams
from linnet_jax.sharding import host

MIN_BUCKET = 16
STOP_ID_SLOTS = 16  # stop ids travel as a fixed-size array, padded with -1
STREAM_CHUNK = 4  # decode steps per dispatch when streaming
STOP_STRING_CHUNK = 32  # decode steps per dispatch when stop strings are watched
SEED_RANGE = (-(2**63), 2**63)  # every signed 64-bit seed is its own stream

__all__ = ["FREE", "Generation", "LENGTH", "RUNNING", "STOP_ID", "TRACES", "generate"]


@dataclasses.dataclass
class Generation:
    """One row's result: the new text and ids (no eos), why it stopped, and each chosen token's logprob."""

    text: str | None
    tokens: list[int]
    stop_reason: str  # "eos", "stop" or "length"
    logprobs: list[float]


def bucket(n: int) -> int:
    """The smallest power of two ≥ n, and at least MIN_BUCKET."""
    return max(MIN_BUCKET, 1 << (max(int(n), 1) - 1).bit_length())


@dataclasses.dataclass
class Prompts:
    """A batch of prompts as ids, and how to present the results."""

    prompts: list[list[int]]
    single: bool  # one prompt in, one result out
    as_text: bool  # text out (else ids)


def _is_conversation(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) for m in value)


def make_prompts(model: Model, prompt, tokens, chat: bool | None) -> Prompts:
    """Turn generate's inputs (a string, strings, a conversation, conversations, or ids) into prompt ids."""
    if (prompt is None) == (tokens is None):
        raise ValueError("give exactly one of prompt (text or conversations) and tokens (lists of ids)")
    if tokens is not None:
        single = len(tokens) > 0 and all(isinstance(t, (int, np.integer)) for t in tokens)
        rows = [list(tokens)] if single else [list(row) for row in tokens]
        for i, row in enumerate(rows):
            as_token_batch(row, model.config.vocab_size, name=f"tokens[{i}]")
        return Prompts(prompts=[[int(t) for t in row] for row in rows], single=single, as_text=False)
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise ValueError("this model has no tokenizer: pass tokens=[[ids...]] instead of text")
    single = isinstance(prompt, str) or _is_conversation(prompt)
    items = [prompt] if single else list(prompt)
    if not items:
        raise ValueError("prompt is an empty list; expected a string, a conversation, or a list of them")
    prompts = [_encode(tokenizer, item, chat) for item in items]
    for i, ids in enumerate(prompts):
        as_token_batch(ids, model.config.vocab_size, name=f"prompt {i} (as encoded by the tokenizer)")
    return Prompts(prompts=prompts, single=single, as_text=True)


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


def seed_key(seed, stream: int = 0) -> np.ndarray:
    """The raw threefry key uint32[2] of stream `stream` of a signed 64-bit seed (its two 32-bit halves,
    as jax.random.PRNGKey makes them under x64), folded with the stream."""
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"seed must be an int (or one int per prompt), got {seed!r}")
    if not SEED_RANGE[0] <= int(seed) < SEED_RANGE[1]:
        raise ValueError(f"seed must be a signed 64-bit int, in [-2**63, 2**63), got {seed}")
    bits = int(seed) % 2**64
    key = jnp.asarray([bits >> 32, bits & 0xFFFFFFFF], jnp.uint32)
    return np.asarray(jax.random.fold_in(key, stream))


def row_keys(seed, batch: int) -> np.ndarray:
    """Each row's key [B, 2]: one seed gives row b stream b of it; one seed per prompt gives each row
    stream 0 of its own (so a prompt with seed s draws the same alone and at any row of any batch)."""
    if isinstance(seed, (list, tuple, np.ndarray)):
        seeds = list(np.asarray(seed, object).reshape(-1)) if isinstance(seed, np.ndarray) else list(seed)
        if len(seeds) != batch:
            raise ValueError(f"seed must be an int or one int per prompt ({batch}), got {len(seeds)} values")
        return np.stack([seed_key(s) for s in seeds])
    return np.stack([seed_key(seed, row) for row in range(batch)])


def make_sampling(batch: int, temperature, top_k, top_p, min_p, repetition_penalty, seed) -> SamplingParams:
    """Per-row sampling arrays, validated, with each row's key (`row_keys`)."""
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
    return SamplingParams(**values, keys=row_keys(seed, batch))


def eos_ids(model: Model) -> set[int]:
    """Every end-of-sequence id the model declares (config, generation config, tokenizer)."""
    return set(model.config.eos_token_ids) | set(model.tokenizer.eos_token_ids if model.tokenizer else ())


def stop_id_array(model: Model, stop_token_ids, ignore_eos: bool) -> np.ndarray:
    """Every id that ends a row, padded to STOP_ID_SLOTS with -1: int32 [STOP_ID_SLOTS]."""
    ids = set(stop_token_ids or ())
    if not ignore_eos:
        ids |= eos_ids(model)
    if len(ids) > STOP_ID_SLOTS:
        raise ValueError(f"at most {STOP_ID_SLOTS} stop token ids are supported, got {len(ids)}")
    bad = [i for i in ids if not 0 <= i < model.config.vocab_size]
    if bad:
        raise ValueError(f"stop token id {bad[0]} is outside the vocabulary [0, {model.config.vocab_size})")
    return np.asarray(sorted(ids) + [-1] * (STOP_ID_SLOTS - len(ids)), np.int32)


def make_requests(sampling: SamplingParams, stop_ids: np.ndarray, max_new_tokens: int) -> Request:
    """The decode core's per-row request arrays: [B] sampling rows, the same stop ids and budget for each."""
    batch = sampling.keys.shape[0]
    return Request(sampling=sampling, stop_ids=np.tile(stop_ids, (batch, 1)),
                   max_new=np.full((batch,), max_new_tokens, np.int32))


def check_max_new_tokens(max_new_tokens) -> int:
    """max_new_tokens as an int, or a ValueError unless it is a positive int (NumPy ints included)."""
    if isinstance(max_new_tokens, (bool, np.bool_)) or not isinstance(max_new_tokens, (int, np.integer)) \
            or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    return int(max_new_tokens)


def plan_cache(config: Config, prompts: list[list[int]], max_new_tokens: int, max_len) -> int:
    """The decode state's slots per row, or a ValueError before any work when the request cannot fit.

    Default: a bucket of the longest prompt's bucket plus max_new_tokens (the same for every prompt
    length inside a bucket, so nothing retraces)."""
    longest = max(len(p) for p in prompts)
    context = config.max_position_embeddings
    if longest + max_new_tokens > context:
        raise ValueError(f"the longest prompt ({longest} tokens) plus max_new_tokens ({max_new_tokens}) exceeds "
                         f"the model's context of {context} positions")
    if max_len is None:
        return min(bucket(bucket(longest) + max_new_tokens), context)
    if isinstance(max_len, (bool, np.bool_)) or not isinstance(max_len, (int, np.integer)) or not 0 < max_len <= context:
        raise ValueError(f"max_len must be an int in [1, {context}] (the model's context), got {max_len!r}")
    if max_len < longest + max_new_tokens:
        raise ValueError(f"max_len={max_len} is too small: the longest prompt ({longest} tokens) and "
                         f"max_new_tokens={max_new_tokens} need {longest + max_new_tokens} cache slots")
    return int(max_len)


def left_pad(prompts: list[list[int]], length: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and positions [B, length], prompts right-aligned; padding has token 0 and position -1."""
    tokens = np.zeros((len(prompts), length), np.int32)
    positions = np.full((len(prompts), length), -1, np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, length - len(prompt):] = prompt
        positions[row, length - len(prompt):] = np.arange(len(prompt))
    return tokens, positions


def new_slots(model: Model, batch: int, max_len: int) -> Slots:
    """An empty decode state for the model: on its device, or on its mesh (the cache by the layout's rules)."""
    args = (model.config, batch, max_len, STOP_ID_SLOTS, model.params.embed.dtype)
    if model.layout is None:  # committed to the weights' device, as every state `insert` returns is: one program
        return jax.device_put(empty_slots(*args), model.params.embed.sharding)
    shapes = jax.eval_shape(lambda: empty_slots(*args))
    shardings = jax.tree.map(lambda _: model.layout.replicated(), shapes)
    shardings = shardings.replace(cache=model.layout.cache_shardings(model.config, batch, max_len))
    return jax.jit(empty_slots, static_argnums=range(5), out_shardings=shardings)(*args)


@dataclasses.dataclass
class Rows:
    """Each row's tokens and logprobs so far, and its finish state, gathered on the host."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    finish: np.ndarray  # [B] int32

    def running(self) -> bool:
        return bool((self.finish == RUNNING).any())


def run(model: Model, prompts: list[list[int]], requests: Request, max_len: int, chunk: int | None
        ) -> Iterator[Rows]:
    """Prefill and insert each prompt, then decode `chunk` steps per dispatch (to the end when None),
    yielding every row's results after each dispatch."""
    config, params = model.config, model.decode_params
    constrain = model.layout and model.layout.constrain
    slots = new_slots(model, len(prompts), max_len)
    for row, prompt in enumerate(prompts):
        tokens, positions = left_pad([prompt], bucket(len(prompt)))
        request = jax.tree.map(lambda column: column[row:row + 1], requests)
        slots = insert(prefill(params, config, tokens, positions, request, max_len, plan=model.plan), slots, row)
    rows = Rows(tokens=[[t] for t in host(slots.token).tolist()], logprobs=[[p] for p in host(slots.logprob).tolist()],
                finish=host(slots.finish))
    yield rows
    max_new = int(requests.max_new.max())
    steps = max_new - 1 if chunk is None else chunk
    out_len = bucket(steps) if chunk is None else chunk
    while rows.running():
        slots, emitted = decode(params, config, slots, np.int32(steps), out_len, constrain, plan=model.plan)
        tokens, logprobs, counts = host(emitted.tokens), host(emitted.logprobs), host(emitted.count)
        for row, count in enumerate(counts):
            rows.tokens[row] += tokens[row, :count].tolist()
            rows.logprobs[row] += logprobs[row, :count].tolist()
        rows.finish = host(slots.finish)
        yield rows


def row_results(rows: Rows, eos: set[int]) -> list[tuple[list[int], str, list[float]]]:
    """Each row's (new ids without the stop token, stop reason, logprobs).

    The reason is "eos" for one of the model's eos ids, "stop" for another stop id, else "length".
    """
    results = []
    for ids, scores, finish in zip(rows.tokens, rows.logprobs, rows.finish):
        if finish == STOP_ID:
            results.append((ids[:-1], "eos" if ids[-1] in eos else "stop", scores[:-1]))
        else:
            results.append((list(ids), "length", list(scores)))
    return results


def cut_at_stop(text: str, stop: list[str]) -> int | None:
    """Where the earliest stop string begins in text, or None."""
    found = [i for i in (text.find(s) for s in stop) if i >= 0]
    return min(found) if found else None


def finish_row(tokenizer, ids: list[int], reason: str, logprobs: list[float], stop: list[str]) -> Generation:
    """A Generation, with the text cut before the first stop string, and the ids (and their logprobs) cut to
    those whose text lies wholly before it: decode(tokens) is a prefix of the text."""
    if tokenizer is None:
        return Generation(text=None, tokens=ids, stop_reason=reason, logprobs=logprobs)
    text = tokenizer.decode(ids)
    cut = cut_at_stop(text, stop)
    if cut is None:
        return Generation(text=text, tokens=ids, stop_reason=reason, logprobs=logprobs)
    text = text[:cut]
    keep = next(n for n in range(len(ids), -1, -1) if text.startswith(tokenizer.decode(ids[:n])))
    return Generation(text=text, tokens=ids[:keep], stop_reason="stop", logprobs=logprobs[:keep])


def held_back(text: str, stop: list[str]) -> int:
    """How many trailing characters of streamed text to hold: a partial UTF-8 char or a stop string's prefix."""
    hold = 1 if text.endswith("\ufffd") else 0
    for s in stop:
        hold = max(hold, *(n for n in range(1, len(s)) if text.endswith(s[:n])), 0)
    return hold


def generate(model: Model, prompt=None, max_new_tokens: int = 128, *, tokens=None, max_len: int | None = None,
             temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, seed=0,
             stop: str | list[str] | None = None, stop_token_ids=None, ignore_eos: bool = False,
             chat: bool | None = None, stream: bool = False, return_details: bool = False):
    """Generate from text, conversations or ids. See the README for every input and result form.

    prompt: a string, a list of strings, a conversation ([{"role", "content"}, ...]) or a list of
    them; or tokens: a list of id lists. Greedy at temperature 0; otherwise temperature, top_k,
    top_p, min_p and repetition_penalty (numbers, or one per prompt), seeded: seed is one int (row b
    draws stream b of it) or one per prompt (each prompt draws as it would alone). Stops at the
    model's eos ids and stop_token_ids (unless ignore_eos), at stop strings, or after max_new_tokens.
    max_len: the cache slots per row (prompt + new tokens); default a bucket that fits them.
    stream=True (one prompt) returns an iterator of text pieces.
    """
    prompts = make_prompts(model, prompt, tokens, chat)
    max_new_tokens = check_max_new_tokens(max_new_tokens)
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not isinstance(s, str) or not s for s in stops):
        raise ValueError(f"stop must be a non-empty string or a list of them, got {stop!r}")
    if stops and model.tokenizer is None:
        raise ValueError("stop strings need a tokenizer; this model has none (use stop_token_ids)")
    if stream and not (prompts.single and prompts.as_text):
        raise ValueError("stream=True takes one text prompt or conversation, not a batch or token ids")
    if stream and return_details:
        raise ValueError("stream=True yields text pieces; return_details=True is for a call that returns the result")
    batch = len(prompts.prompts)
    sampling = make_sampling(batch, temperature, top_k, top_p, min_p, repetition_penalty, seed)
    requests = make_requests(sampling, stop_id_array(model, stop_token_ids, ignore_eos), max_new_tokens)
    max_len = plan_cache(model.config, prompts.prompts, max_new_tokens, max_len)
    chunk = STREAM_CHUNK if stream else (STOP_STRING_CHUNK if stops else None)
    states = run(model, prompts.prompts, requests, max_len, chunk)
    if stream:
        return _stream(model.tokenizer, states, stops, eos_ids(model))
    results = []
    for rows in states:
        results = [finish_row(model.tokenizer, *row, stops) for row in row_results(rows, eos_ids(model))]
        if stops and all(r.stop_reason != "length" for r in results):
            break
    results = results if return_details else [r.text if prompts.as_text else r.tokens for r in results]
    return results[0] if prompts.single else results


def _stream(tokenizer, states: Iterator[Rows], stops: list[str], eos: set[int]) -> Iterator[str]:
    """Yield the new text after each dispatch, holding back what a stop string or a partial char may change."""
    emitted = 0
    for rows in states:
        generation = finish_row(tokenizer, *row_results(rows, eos)[0], stops)
        done = generation.stop_reason == "stop" or rows.finish[0] != RUNNING
        safe = len(generation.text) if done else len(generation.text) - held_back(generation.text, stops)
        if safe > emitted:
            yield generation.text[emitted:safe]
            emitted = safe
        if done:
            return
