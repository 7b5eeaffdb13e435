"""Structured output: a request's grammar as the bitmask of the tokens it allows next.

A spec is one of {"json": schema} (a JSON schema as a dict or JSON text; {} or true is any JSON value),
{"regex": pattern}, {"choice": [strings]} or {"grammar": text} (Lark, or llama.cpp's GBNF). llguidance compiles
it against the model's tokenizer and keeps the matcher's state as tokens are chosen. llguidance rather than
xgrammar: it needs no torch, fills NumPy bitmasks, takes Lark grammars, JSON schemas and regular expressions, and
ships one abi3 wheel for every Python this project supports.

    constraint(model, spec) -> Constraint     the spec compiled (a RequestError naming `structured` if it is not
                                              valid); its mask() and advance(tokens) -> whether it is complete
    constraints(model, structured, batch)     one spec for every row or one per row (None: unconstrained)
    bitmasks(constraints, vocab) -> [B, W]    each constrained row's mask, every token for the others
    with_bitmasks(slots, masks) -> Slots      the decode state's `allowed` replaced (a transfer: no program)

The host computes a constrained row's mask after each of its tokens, so a dispatch that carries one decodes a
single step; unconstrained rows cost no host work, and their all-ones rows keep one program for every batch.
"""

import functools
import json

import jax
import llguidance
import llguidance.numpy
import numpy as np

from linnet_jax.decode import ALL_ALLOWED, Slots
from linnet_jax.inputs import RequestError, eos_ids
from linnet_jax.loaded import Model
from linnet_jax.ops import bitmask_words

KINDS = ("json", "regex", "choice", "grammar")  # a spec's one key
# JSON comes out as Python's json.dumps writes it: no whitespace but after the separators, so that a model cannot
# loop on whitespace and a bounded schema bounds the output (a schema's "x-guidance" options override these).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
FIELD = "structured"  # the argument a RequestError names


@functools.cache
def matcher_tokenizer(tokenizer, vocab: int, eos: tuple[int, ...]) -> llguidance.LLTokenizer:
    """llguidance's view of the tokenizer (its token bytes; about a second to build, so built once per model)."""
    return llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab, eos_token=list(eos))


def grammar(spec) -> str:
    """The llguidance grammar of a spec, or a RequestError saying what is wrong with its shape."""
    kinds = [kind for kind in KINDS if isinstance(spec, dict) and kind in spec]
    if not isinstance(spec, dict) or len(kinds) != 1 or len(spec) != 1:
        raise RequestError(FIELD, f"structured must be a dict with one key of {', '.join(KINDS)}, got {spec!r}")
    kind, value = kinds[0], spec[kinds[0]]
    if kind == "json":
        schema = parse_json(value) if isinstance(value, str) else value
        schema = {} if schema is True else schema  # the schema every value satisfies
        if not isinstance(schema, dict):
            raise RequestError(FIELD, f"structured json must be a JSON schema (an object, or true), got {value!r}")
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_LAYOUT)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise RequestError(FIELD, f"structured choice must be a non-empty list of non-empty strings, "
                                      f"got {value!r}")
        return llguidance.grammar_from("choice", value)
    if not isinstance(value, str) or not value:
        raise RequestError(FIELD, f"structured {kind} must be a non-empty string, got {value!r}")
    try:
        return llguidance.grammar_from(kind, value)
    except ValueError as error:  # a GBNF grammar that does not convert
        raise RequestError(FIELD, f"structured grammar is not valid: {error}") from error


def parse_json(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise RequestError(FIELD, f"structured json is not valid JSON: {error}") from error


class Constraint:
    """One request's grammar as it stands: the tokens it allows next (`mask`), advanced by the tokens chosen."""

    def __init__(self, matcher: llguidance.LLMatcher, words: int):
        self.matcher, self.words = matcher, words
        self._mask: np.ndarray | None = None  # the mask of the current state, once computed

    def mask(self) -> np.ndarray:
        """[W] uint32: the tokens the grammar allows next (the model's eos ids once it may end)."""
        if self._mask is None:
            mask = np.zeros((1, self.words), np.int32)
            llguidance.numpy.fill_next_token_bitmask(self.matcher, mask)
            self._mask = mask[0].view(np.uint32)
        return self._mask

    def advance(self, tokens: list[int]) -> bool:
        """The chosen tokens consumed; returns whether the grammar is complete (nothing may follow)."""
        self.matcher.consume_tokens(tokens)
        self._mask = None
        return self.matcher.is_stopped()


def constraint(model: Model, spec) -> Constraint:
    """A fresh Constraint of one spec for the model; a RequestError naming `structured` for an invalid spec (a
    schema, regex or grammar that does not compile, with llguidance's message)."""
    return matched(model, grammar(spec), next(iter(spec)))


def matched(model: Model, source: str, kind: str) -> Constraint:
    """A fresh Constraint of llguidance grammar `source` (made from a spec of `kind`) for the model."""
    if model.tokenizer is None:
        raise RequestError(FIELD, "structured output needs a tokenizer (the token bytes); this model has none")
    tokenizer = matcher_tokenizer(model.tokenizer, model.config.vocab_size, tuple(sorted(eos_ids(model))))
    matcher = llguidance.LLMatcher(tokenizer, source, log_level=0)
    if matcher.is_error():
        raise RequestError(FIELD, f"structured {kind} is not valid: {matcher.get_error()}")
    return Constraint(matcher, bitmask_words(model.config.vocab_size))


def constraints(model: Model, structured, batch: int) -> list[Constraint | None]:
    """Each row's Constraint: one spec shared by every row (its grammar made once, each row its own matcher), or a
    list of one spec (or None) per row."""
    if not isinstance(structured, (list, tuple)):
        source = grammar(structured)
        return [matched(model, source, next(iter(structured))) for _ in range(batch)]
    if len(structured) != batch:
        raise RequestError(FIELD, f"structured must be one spec or one per prompt ({batch}), got {len(structured)}")
    return [None if spec is None else constraint(model, spec) for spec in structured]


def bitmasks(rows: list[Constraint | None], vocab: int) -> np.ndarray:
    """[B, W] uint32: each constrained row's mask, every token for the rows without a constraint."""
    masks = np.full((len(rows), bitmask_words(vocab)), ALL_ALLOWED, np.uint32)
    for row, given in enumerate(rows):
        if given is not None:
            masks[row] = given.mask()
    return masks


def with_bitmasks(slots: Slots, masks: np.ndarray) -> Slots:
    """The decode state with `allowed` = masks [B, W], placed as the state's own (so no program recompiles)."""
    return slots.replace(allowed=jax.device_put(masks, slots.allowed.sharding))
