"""A request's inputs, validated, as the decode core takes them: prompts → ids, sampling options, seeds,
stop ids, the bucket rule, and `extend_rows` (prompt chunks into rows of a decode state, one dispatch).

`generate` and the serving engine both build their requests here, so the two refuse the same values with
the same `RequestError`, which names the field it is about.
"""

import dataclasses
import re
import reprlib

import jax
import jax.numpy as jnp
import numpy as np

from linnet_jax.decode import BIAS_SLOTS, Request, Slots, choose_first, empty_slots, extend
from linnet_jax.loaded import Model, as_token_batch
from linnet_jax.ops import SamplingParams

MIN_BUCKET = 16
STOP_ID_SLOTS = 16  # stop ids travel as a fixed-size array, padded with -1
SEED_RANGE = (-(2**63), 2**63)  # every signed 64-bit seed is its own stream
MAX_STOPS, MAX_STOP_CHARS = 16, 256  # stop strings a request may give, and the characters of each
CANONICAL_ID = re.compile("0|[1-9][0-9]*")  # a token id as a logit_bias key (JSON's keys are strings)


class RequestError(ValueError):
    """A request's value that cannot be honoured: `field` names the argument (e.g. "temperature", "prompt"),
    `message` says what was expected."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field, self.message = field, message


# --- the bucket rule, padding, admission ----------------------------------------------------------------------

def bucket(n: int, limit: int | None = None) -> int:
    """The smallest power of two ≥ n, and at least MIN_BUCKET; at most `limit` (a cache's slots) when given."""
    size = max(MIN_BUCKET, 1 << (max(int(n), 1) - 1).bit_length())
    return size if limit is None else min(size, limit)


def buckets(limit: int) -> list[int]:
    """Every length `bucket(n, limit)` gives for n in [1, limit]: powers of two from MIN_BUCKET below limit, and
    limit itself."""
    sizes = [MIN_BUCKET]
    while sizes[-1] * 2 < limit:
        sizes.append(sizes[-1] * 2)
    return sizes + [limit] * (sizes[-1] < limit)


def fitting(sizes: list[int], count: int) -> int:
    """The smallest of the ascending bucket `sizes` that holds `count`."""
    return next(size for size in sizes if size >= count)


def prefill_widths(chunk: int, max_len: int) -> list[int]:
    """The columns of a prefill dispatch (its chunks padded to one of them) for chunks of at most `chunk` tokens
    into rows of max_len slots: the buckets up to the widest such a chunk needs (powers of two from MIN_BUCKET), and
    three quarters of each from 128 (96, 192, 384, ..), which halve the padding of a chunk in a bucket's lower
    half."""
    widest = bucket(min(chunk, max_len - 1), chunk)
    powers = [width for width in buckets(chunk) if width <= widest]
    return sorted(powers + [width * 3 // 4 for width in powers if width >= 128])


def new_slots(model: Model, batch: int, max_len: int) -> Slots:
    """An empty decode state for the model: on its device, or on its mesh (the cache by the layout's rules)."""
    args = (model.config, batch, max_len, STOP_ID_SLOTS, model.params.dtype)
    if model.layout is None:  # committed to the weights' device, as every state `extend` returns is: one program
        return jax.device_put(empty_slots(*args), model.params.sharding)
    shapes = jax.eval_shape(lambda: empty_slots(*args))
    shardings = jax.tree.map(lambda _: model.layout.replicated(), shapes)
    shardings = shardings.replace(cache=model.layout.cache_shardings(model.config, batch, max_len))
    return jax.jit(empty_slots, static_argnums=range(5), out_shardings=shardings)(*args)


def extend_rows(model: Model, slots: Slots, rows: list[int], chunks: list[list[int]], starts: list[int],
                requests: list[Request], last: list[bool], height: int | None = None, width: int | None = None,
                lora=None) -> Slots:
    """Prompt chunks into rows of the decode state in one `extend` dispatch, then `choose_first`: chunk i (its
    tokens at positions starts[i] ..) into row rows[i], with its request (one row each); last[i]: it ends its
    prompt (the row's first token is chosen). Padded to `height` rows (padding rows write nothing) and `width`
    columns; by default the rows given and the bucket of the longest chunk. Chunks that all begin their prompts
    attend to their own keys only (`extend`'s fresh). lora: the adapter table (`models.lora.LoraTable`) or None."""
    height, width = height or len(rows), width or bucket(max(map(len, chunks)), slots.cache.max_len)
    padding = height - len(rows)
    tokens = np.zeros((height, width), np.int32)
    for row, chunk in enumerate(chunks):
        tokens[row, :len(chunk)] = chunk
    column = lambda values, fill, dtype: np.asarray(list(values) + [fill] * padding, dtype)  # noqa: E731
    request = jax.tree.map(lambda *columns: np.concatenate(columns), *requests, *[requests[0]] * padding)
    row_ids = column(rows, slots.token.shape[0], np.int32)
    slots, logits = extend(model.decode_params, model.config, slots, row_ids, tokens, column(starts, 0, np.int32),
                           column(map(len, chunks), 0, np.int32), request, column(last, False, bool),
                           model.layout and model.layout.constrain, model.plan, not any(starts),
                           lora=lora)
    return choose_first(slots, row_ids, logits)


# --- prompts --------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Prompts:
    """A batch of prompts as ids, and how to present the results."""

    prompts: list[list[int]]
    single: bool  # one prompt in, one result out
    as_text: bool  # text out (else ids)


def is_conversation(value) -> bool:
    """Whether value is one conversation: a non-empty list of message dicts."""
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) for m in value)


def make_prompts(model: Model, prompt, tokens, chat: bool | None) -> Prompts:
    """Turn the inputs (a string, strings, a conversation, conversations, or ids) into prompt ids."""
    if (prompt is None) == (tokens is None):
        raise RequestError("prompt", "give exactly one of prompt (text or conversations) and tokens (lists of ids)")
    if tokens is not None:
        if len(tokens) == 0:
            raise RequestError("tokens", "tokens is an empty list; expected a list of ids or a list of id lists")
        single = all(isinstance(t, (int, np.integer)) for t in tokens)
        rows = [list(tokens)] if single else [list(row) for row in tokens]
        for i, row in enumerate(rows):
            as_token_batch(row, model.config.vocab_size, name=f"tokens[{i}]")
        return Prompts(prompts=[[int(t) for t in row] for row in rows], single=single, as_text=False)
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise RequestError("prompt", "this model has no tokenizer: pass tokens=[[ids...]] instead of text")
    single = isinstance(prompt, str) or is_conversation(prompt)
    items = [prompt] if single else list(prompt)
    if not items:
        raise RequestError("prompt", "prompt is an empty list; expected a string, a conversation, or a list of them")
    prompts = [encode(tokenizer, item, chat) for item in items]
    for i, ids in enumerate(prompts):
        as_token_batch(ids, model.config.vocab_size, name=f"prompt {i} (as encoded by the tokenizer)")
    return Prompts(prompts=prompts, single=single, as_text=True)


def encode(tokenizer, item, chat: bool | None) -> list[int]:
    """One prompt's ids: a conversation through the chat template; a string through it too (as one user
    message) when chat is True, or None and the tokenizer has a template; else encoded as it is."""
    if is_conversation(item):
        if chat is False:
            raise RequestError("prompt", "chat=False, but the prompt is a conversation (a list of messages)")
        return tokenizer.apply_chat_template(item, add_generation_prompt=True, tokenize=True)
    if not isinstance(item, str):
        raise RequestError("prompt", f"each prompt must be a string or a conversation (a list of message dicts), "
                                     f"got {item!r}")
    if chat or (chat is None and tokenizer.chat_template):
        return tokenizer.apply_chat_template([{"role": "user", "content": item}], add_generation_prompt=True,
                                             tokenize=True)
    ids = tokenizer.encode(item, add_special_tokens=True)
    if not ids:
        raise RequestError("prompt", "the prompt encodes to no tokens")
    return ids


def check_max_new_tokens(value, field: str = "max_new_tokens") -> int:
    """The token budget as an int, or a RequestError unless it is a positive int (NumPy ints included)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 1:
        raise RequestError(field, f"{field} must be a positive int, got {value!r}")
    return int(value)


# --- sampling, seeds, stops -----------------------------------------------------------------------------------

def per_row(field: str, value, batch: int, dtype) -> np.ndarray:
    """A number, or one per row, as a [batch] array of dtype."""
    try:
        array = np.asarray(value, dtype)
    except OverflowError as error:
        limits = np.iinfo(dtype) if np.issubdtype(dtype, np.integer) else np.finfo(dtype)
        raise RequestError(field, f"{field} must be in [{limits.min}, {limits.max}] ({np.dtype(dtype).name}), "
                                  f"got {value!r}") from error
    except (TypeError, ValueError) as error:
        raise RequestError(field, f"{field} must be a number or one value per prompt, got {value!r}") from error
    if array.ndim == 0:
        return np.full((batch,), array, dtype)
    if array.shape != (batch,):
        raise RequestError(field, f"{field} must be a number or one value per prompt ({batch}), got shape "
                                  f"{array.shape}")
    return array


def seed_key(seed, stream: int = 0) -> np.ndarray:
    """The raw threefry key uint32[2] of stream `stream` of a signed 64-bit seed (its two 32-bit halves,
    as jax.random.PRNGKey makes them under x64), folded with the stream."""
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)):
        raise RequestError("seed", f"seed must be an int (or one int per prompt), got {seed!r}")
    if not SEED_RANGE[0] <= int(seed) < SEED_RANGE[1]:
        raise RequestError("seed", f"seed must be a signed 64-bit int, in [-2**63, 2**63), got {seed}")
    bits = int(seed) % 2**64
    key = jnp.asarray([bits >> 32, bits & 0xFFFFFFFF], jnp.uint32)
    return np.asarray(jax.random.fold_in(key, stream))


def row_keys(seed, batch: int) -> np.ndarray:
    """Each row's key [B, 2]: one seed gives row b stream b of it; one seed per prompt gives each row
    stream 0 of its own (so a prompt with seed s draws the same alone and at any row of any batch)."""
    if isinstance(seed, (list, tuple, np.ndarray)):
        seeds = list(np.asarray(seed, object).reshape(-1)) if isinstance(seed, np.ndarray) else list(seed)
        if len(seeds) != batch:
            raise RequestError("seed", f"seed must be an int or one int per prompt ({batch}), got {len(seeds)} values")
        return np.stack([seed_key(s) for s in seeds])
    return np.stack([seed_key(seed, row) for row in range(batch)])


def bias_row(logit_bias, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """One row's logit bias ({id: bias}, ids as ints or decimal strings as OpenAI's JSON sends them, `bias_token`;
    None: none) as its ids [BIAS_SLOTS] int32 and biases [BIAS_SLOTS] float32, padded with id 0 and bias 0."""
    entries = {} if logit_bias is None else logit_bias
    if not isinstance(entries, dict):
        raise RequestError("logit_bias", f"logit_bias must be a dict of token id -> bias, got {logit_bias!r}")
    if len(entries) > BIAS_SLOTS:
        raise RequestError("logit_bias", f"logit_bias holds {len(entries)} entries; at most {BIAS_SLOTS} are supported")
    ids, values = np.zeros(BIAS_SLOTS, np.int32), np.zeros(BIAS_SLOTS, np.float32)
    for i, (key, bias) in enumerate(entries.items()):
        token = bias_token(key, vocab)
        if token in ids[:i]:
            raise RequestError("logit_bias", f"logit_bias names token {token} twice (key {key!r} and an earlier one); "
                                             f"give each token one bias")
        if isinstance(bias, (bool, np.bool_)) or not isinstance(bias, (int, float, np.number)) \
                or not -100 <= bias <= 100:
            raise RequestError("logit_bias", f"logit_bias values must be numbers in [-100, 100], got {bias!r} for "
                                             f"token {token}")
        ids[i], values[i] = token, bias
    return ids, values


def bias_token(key, vocab: int) -> int:
    """A logit_bias key as its token id in [0, vocab): an int, or an id's canonical decimal string (ASCII digits,
    no sign, space or leading zero, so that no two keys name one id); else a RequestError naming logit_bias and the
    key. The length bound keeps int() from strings past Python's 4300-digit limit."""
    canonical = isinstance(key, str) and CANONICAL_ID.fullmatch(key) and len(key) <= len(str(vocab))
    token = int(key) if canonical else key
    if isinstance(token, (bool, np.bool_)) or not isinstance(token, (int, np.integer)) or not 0 <= token < vocab:
        raise RequestError("logit_bias", f"logit_bias keys must be token ids in [0, {vocab}), as ints or decimal "
                                         f"strings (ASCII digits, no sign, space or leading zero), got "
                                         f"{reprlib.repr(key)}")
    return int(token)


def bias_table(logit_bias, batch: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """The logit bias of every row, one dict for all or one per row: ids [B, BIAS_SLOTS], biases [B, BIAS_SLOTS]."""
    rows = list(logit_bias) if isinstance(logit_bias, (list, tuple)) else [logit_bias] * batch
    if len(rows) != batch:
        raise RequestError("logit_bias", f"logit_bias must be one dict or one per prompt ({batch}), got {len(rows)}")
    ids, values = zip(*(bias_row(row, vocab) for row in rows))
    return np.stack(ids), np.stack(values)


def make_sampling(batch: int, temperature, top_k, top_p, min_p, repetition_penalty, seed, presence_penalty=0.0,
                  frequency_penalty=0.0, bias: tuple[np.ndarray, np.ndarray] | None = None) -> SamplingParams:
    """Per-row sampling arrays, validated, with each row's key (`row_keys`) and logit bias (`bias_table`'s ids
    and biases; None: none)."""
    values = dict(
        temperature=per_row("temperature", temperature, batch, np.float32),
        top_k=per_row("top_k", top_k, batch, np.int32),
        top_p=per_row("top_p", top_p, batch, np.float32),
        min_p=per_row("min_p", min_p, batch, np.float32),
        repetition_penalty=per_row("repetition_penalty", repetition_penalty, batch, np.float32),
        presence_penalty=per_row("presence_penalty", presence_penalty, batch, np.float32),
        frequency_penalty=per_row("frequency_penalty", frequency_penalty, batch, np.float32),
    )
    checks = {
        "temperature": (values["temperature"] >= 0, "≥ 0"),
        "top_k": (values["top_k"] >= 0, "≥ 0"),
        "top_p": ((values["top_p"] > 0) & (values["top_p"] <= 1), "in (0, 1]"),
        "min_p": ((values["min_p"] >= 0) & (values["min_p"] <= 1), "in [0, 1]"),
        "repetition_penalty": (values["repetition_penalty"] > 0, "> 0"),
        "presence_penalty": (np.abs(values["presence_penalty"]) <= 2, "in [-2, 2]"),
        "frequency_penalty": (np.abs(values["frequency_penalty"]) <= 2, "in [-2, 2]"),
    }
    for field, (ok, expected) in checks.items():
        if not ok.all():
            raise RequestError(field, f"{field} must be {expected}, got {values[field].tolist()}")
    bias_ids, bias = bias_table(None, batch, 0) if bias is None else bias
    return SamplingParams(**values, bias_ids=bias_ids, bias=bias, keys=row_keys(seed, batch))


def stop_strings(stop, tokenizer) -> tuple[str, ...]:
    """stop (None, a string or a list of them) as a tuple of at most MAX_STOPS non-empty strings of at most
    MAX_STOP_CHARS characters each; they need a tokenizer."""
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > MAX_STOPS:
        raise RequestError("stop", f"stop holds {len(stops)} strings; at most {MAX_STOPS} are supported")
    if any(not isinstance(s, str) or not s for s in stops):
        raise RequestError("stop", f"stop must be a non-empty string or a list of them, got {stop!r}")
    if long := next((s for s in stops if len(s) > MAX_STOP_CHARS), None):
        raise RequestError("stop", f"a stop string holds {len(long)} characters; at most {MAX_STOP_CHARS} are "
                                   f"supported (it begins {long[:20]!r})")
    if stops and tokenizer is None:
        raise RequestError("stop", "stop strings need a tokenizer; this model has none (use stop_token_ids)")
    return stops


def eos_ids(model: Model) -> set[int]:
    """Every end-of-sequence id the model declares (config, generation config, tokenizer)."""
    return set(model.config.eos_token_ids) | set(model.tokenizer.eos_token_ids if model.tokenizer else ())


def stop_id_array(model: Model, stop_token_ids, ignore_eos: bool) -> np.ndarray:
    """Every id that ends a row, padded to STOP_ID_SLOTS with -1: int32 [STOP_ID_SLOTS]."""
    ids = set(stop_token_ids or ())
    if not ignore_eos:
        ids |= eos_ids(model)
    if len(ids) > STOP_ID_SLOTS:
        raise RequestError("stop_token_ids", f"at most {STOP_ID_SLOTS} stop token ids are supported, got {len(ids)}")
    bad = [i for i in ids if not 0 <= i < model.config.vocab_size]
    if bad:
        raise RequestError("stop_token_ids", f"stop token id {bad[0]} is outside the vocabulary "
                                             f"[0, {model.config.vocab_size})")
    return np.asarray(sorted(ids) + [-1] * (STOP_ID_SLOTS - len(ids)), np.int32)


def make_requests(sampling: SamplingParams, stop_ids: np.ndarray, max_new_tokens: int, adapter=0) -> Request:
    """The decode core's per-row request arrays: [B] sampling rows, the same stop ids and budget for each, and
    each row's adapter table entry (a number, or one per row; 0: the base model)."""
    batch = sampling.keys.shape[0]
    return Request(sampling=sampling, stop_ids=np.tile(stop_ids, (batch, 1)),
                   max_new=np.full((batch,), max_new_tokens, np.int32),
                   adapter=np.broadcast_to(np.asarray(adapter, np.int32), (batch,)).copy())


@dataclasses.dataclass(frozen=True)
class SamplingOptions:
    """A call's sampling options for its B rows, validated (`sampling_options`): how each row samples, and the
    stop strings and stop ids that end every row."""

    sampling: SamplingParams  # each field [B]; keys [B, 2]
    stops: tuple[str, ...]
    stop_ids: np.ndarray  # int32 [STOP_ID_SLOTS], padded with -1

    def row(self, index: int) -> "SamplingOptions":
        """Row `index` alone (B = 1): stream `index` of a single seed."""
        return dataclasses.replace(self, sampling=jax.tree.map(lambda column: column[index:index + 1], self.sampling))

    def requests(self, max_new_tokens: int, adapter=0) -> Request:
        """The decode core's [B] request rows, each with a budget of max_new_tokens and adapter entry `adapter`."""
        return make_requests(self.sampling, self.stop_ids, max_new_tokens, adapter)


def sampling_options(model: Model, rows: int, *, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0,
                     repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, logit_bias=None, seed=0,
                     stop=None, stop_token_ids=None, ignore_eos: bool = False) -> SamplingOptions:
    """The options of `rows` rows, each a number or one per row (seed: one int, row b drawing stream b of it, or
    one per row; logit_bias: one dict or one per row); a RequestError names the first field that cannot be
    honoured."""
    return SamplingOptions(
        sampling=make_sampling(rows, temperature, top_k, top_p, min_p, repetition_penalty, seed, presence_penalty,
                               frequency_penalty, bias_table(logit_bias, rows, model.config.vocab_size)),
        stops=stop_strings(stop, model.tokenizer), stop_ids=stop_id_array(model, stop_token_ids, ignore_eos))
