"""Speculative decoding by prompt lookup (n-gram): drafts come from the request's own prompt and output.

A row whose last n tokens (prompt_lookup_max ≥ n ≥ prompt_lookup_min, longest first) appeared earlier in
its history proposes the num_speculative_tokens tokens that followed that earlier occurrence (the latest
one). `linnet_jax.decode.verify` checks every row's drafts in one forward and keeps the longest run that
equals what the row would have chosen, so the tokens are exactly those of decoding without it, greedy or
seeded. The options take vLLM's names: {"method": "ngram", "num_speculative_tokens": 4,
"prompt_lookup_max": 4, "prompt_lookup_min": 2}, num_speculative_tokens at most MAX_SPECULATIVE_TOKENS and
prompt_lookup_max at most MAX_PROMPT_LOOKUP; an engine checks that its verify steps fit (`check_fits`).
"""

import dataclasses

import numpy as np

from linnet_jax.inputs import RequestError


MAX_SPECULATIVE_TOKENS = 32  # drafts verified per row and step (vLLM's n-gram runs take 2 to 8)
MAX_PROMPT_LOOKUP = 64  # the longest n-gram looked up


@dataclasses.dataclass(frozen=True)
class Ngram:
    """Prompt-lookup options (vLLM's names)."""

    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2


def speculative_config(options: dict | Ngram | None, field: str = "speculative") -> Ngram | None:
    """The options as an Ngram (None: no speculation), or a RequestError naming what is wrong."""
    if options is None or isinstance(options, Ngram):
        return options
    if not isinstance(options, dict):
        raise RequestError(field, f"{field} must be a dict like {{\"method\": \"ngram\", \"num_speculative_tokens\": 4}}, "
                                  f"got {options!r}")
    options = dict(options)
    method = options.pop("method", "ngram")
    if method != "ngram":
        raise RequestError(field, f"{field}: method {method!r} is not supported; expected \"ngram\" (prompt lookup)")
    names = {f.name for f in dataclasses.fields(Ngram)}
    unknown = sorted(set(options) - names)
    if unknown:
        raise RequestError(field, f"{field}: unknown option(s) {unknown}; expected some of {sorted(names)}")
    for name, value in options.items():
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise RequestError(field, f"{field}: {name} must be a positive int, got {value!r}")
    config = Ngram(**{name: int(value) for name, value in options.items()})
    for name, most in (("num_speculative_tokens", MAX_SPECULATIVE_TOKENS), ("prompt_lookup_max", MAX_PROMPT_LOOKUP)):
        if getattr(config, name) > most:
            raise RequestError(field, f"{field}: {name} must be at most {most}, got {getattr(config, name)}")
    if config.prompt_lookup_min > config.prompt_lookup_max:
        raise RequestError(field, f"{field}: prompt_lookup_min ({config.prompt_lookup_min}) is above "
                                  f"prompt_lookup_max ({config.prompt_lookup_max})")
    return config


def check_fits(config: Ngram | None, slots: int, max_len: int, max_step_tokens: int, field: str = "speculative"
               ) -> None:
    """A RequestError naming `field` unless an engine's verify step fits: a row's 1 + num_speculative_tokens
    positions below max_len, and every slot's (slots × that many tokens) within max_step_tokens."""
    if config is None:
        return
    width = 1 + config.num_speculative_tokens
    if width >= max_len:
        raise RequestError(field, f"{field}: num_speculative_tokens={config.num_speculative_tokens} leaves no room in "
                                  f"max_len={max_len} positions; expected at most {max_len - 2}")
    if slots * width > max_step_tokens:
        raise RequestError(field, f"{field}: a verify step carries slots × (1 + num_speculative_tokens) = {slots} × "
                                  f"{width} = {slots * width} tokens, above max_step_tokens={max_step_tokens}")


def propose(history: list[int], config: Ngram, most: int) -> list[int]:
    """Up to min(num_speculative_tokens, most) draft tokens for a row whose tokens so far are `history`: those
    that followed the latest earlier occurrence of its longest matching suffix; [] when none matches."""
    most = min(config.num_speculative_tokens, most)
    tokens = np.asarray(history)
    for n in range(min(config.prompt_lookup_max, len(tokens) - 1), config.prompt_lookup_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)  # every earlier n-gram
        starts = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if most > 0 and starts.size:
            follow = starts[-1] + n
            return tokens[follow:follow + most].tolist()
    return []


def draft_arrays(drafts: list[list[int]], width: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's drafts as int32 [B, width] (zeros after them) and their counts [B]."""
    array = np.zeros((len(drafts), width), np.int32)
    for row, draft in enumerate(drafts):
        array[row, :len(draft)] = draft
    return array, np.asarray([len(d) for d in drafts], np.int32)
