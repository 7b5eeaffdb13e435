"""Structured output: a request's grammar as the bitmask of the tokens it allows next.

A spec is one of {"json": schema} (a JSON schema as a dict or JSON text; {} or true is any JSON value),
{"regex": pattern}, {"choice": [strings]} or {"grammar": text} (Lark, or llama.cpp's GBNF). llguidance compiles
it against the model's tokenizer and keeps the matcher's state as tokens are chosen. llguidance rather than
xgrammar: it needs no torch, fills NumPy bitmasks, takes Lark grammars, JSON schemas and regular expressions, and
ships one abi3 wheel for every Python this project supports.

    constraint(model, spec) -> Constraint     the spec compiled (a RequestError naming `structured` if it is not
                                              valid, over a bound, or can never be completed); its mask() and
                                              advance(tokens) -> whether it is complete (a RequestError once the
                                              grammar allows nothing more)
    constraints(model, structured, batch)     one spec for every row or one per row (None: unconstrained)
    bitmasks(constraints, vocab) -> [B, W]    each constrained row's mask, every token for the others
    with_bitmasks(slots, masks) -> Slots      the decode state's `allowed` replaced (a transfer: no program)

Every spec is bounded before llguidance sees it (MAX_SPEC_BYTES, MAX_NESTING, MAX_SCHEMA_REFERENCES,
MAX_GRAMMAR_RULES, MAX_CHOICES), and llguidance compiles it on a thread of its own with COMPILER_STACK_BYTES of stack:
its compiler recurses on the native stack through a schema's references and a grammar's rules, and a chain of a
thousand of them overflows a thread's default 8 MiB (a SIGSEGV that takes the process down). Within the bounds a
compile needs a few MiB of that stack.

The host computes a constrained row's mask after each of its tokens, so a dispatch that carries one decodes a
single step; unconstrained rows cost no host work, and their all-ones rows keep one program for every batch.
"""

import functools
import json
import re
import threading

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
MAX_SPEC_BYTES = 131072  # a schema's JSON text, a regex, a grammar's text, or a choice's strings together
MAX_NESTING = 64  # a schema's objects and arrays inside one another
MAX_SCHEMA_REFERENCES = 1000  # "$ref"s in one schema
MAX_GRAMMAR_RULES = 1000  # a Lark grammar's rules and terminals, or a GBNF grammar's rules
MAX_CHOICES = 1000  # the strings of a choice
COMPILER_STACK_BYTES = 256 << 20  # the stack llguidance compiles on (virtual memory: only what it uses is touched)
RULE = re.compile(r"^[ \t]*(?:[?!]?[A-Za-z_][A-Za-z0-9_]*(?:\.-?\d+)?[ \t]*:|[A-Za-z0-9_-]+[ \t]*::=)", re.M)
_STACK_SIZE = threading.Lock()  # held while the process's new-thread stack size is the compiler's


@functools.cache
def matcher_tokenizer(tokenizer, vocab: int, eos: tuple[int, ...]) -> llguidance.LLTokenizer:
    """llguidance's view of the tokenizer (its token bytes; about a second to build, so built once per model)."""
    return llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab, eos_token=list(eos))


def on_compiler_stack(function):
    """`function` run, each call, on a thread of its own with COMPILER_STACK_BYTES of stack; its result returned or
    its exception raised here."""

    @functools.wraps(function)
    def run(*args):
        outcome = {}

        def call():
            try:
                outcome["value"] = function(*args)
            except BaseException as error:  # noqa: BLE001 - raised again in the caller's thread
                outcome["error"] = error

        with _STACK_SIZE:
            previous = threading.stack_size(COMPILER_STACK_BYTES)
            try:
                thread = threading.Thread(target=call, name="linnet-jax-grammar", daemon=True)
                thread.start()
            finally:
                threading.stack_size(previous)
        thread.join()
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    return run


@on_compiler_stack
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
            raise RequestError(FIELD, f"structured json must be a JSON schema: an object, the JSON text of one, or "
                                      f"true (any value); got {value!r}")
        check_schema(schema)
        text = json.dumps(schema)
        check_bound(kind, utf8_bytes(text), "bytes of JSON", MAX_SPEC_BYTES)
        return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_LAYOUT)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise RequestError(FIELD, f"structured choice must be a non-empty list of non-empty strings, "
                                      f"got {value!r}")
        check_bound(kind, len(value), "strings", MAX_CHOICES)
        check_bound(kind, sum(map(utf8_bytes, value)), "bytes of text", MAX_SPEC_BYTES)
        return llguidance.grammar_from("choice", value)
    if not isinstance(value, str) or not value:
        raise RequestError(FIELD, f"structured {kind} must be a non-empty string, got {value!r}")
    check_bound(kind, utf8_bytes(value), "bytes", MAX_SPEC_BYTES)
    if kind == "grammar":
        check_bound(kind, len(RULE.findall(value)), "rules", MAX_GRAMMAR_RULES)
    try:
        return llguidance.grammar_from(kind, value)
    except ValueError as error:  # a GBNF grammar that does not convert
        raise RequestError(FIELD, f"structured grammar is not valid: {error}") from error


def check_bound(kind: str, count: int, what: str, most: int) -> None:
    """A RequestError naming `structured` when a spec of `kind` holds more than `most` of `what`."""
    if count > most:
        raise RequestError(FIELD, f"structured {kind} holds {count} {what}, above the limit of {most}")


def check_schema(schema: dict) -> None:
    """A RequestError naming `structured` when a JSON schema is over a bound: MAX_NESTING objects and arrays deep,
    or MAX_SCHEMA_REFERENCES "$ref"s. Walked without recursion, so that no depth of nesting can overflow the stack
    here either (and before json.dumps, which recurses)."""
    pending, references = [(schema, 1)], 0
    while pending:
        node, depth = pending.pop()
        check_bound("json", depth, "levels of nested objects and arrays", MAX_NESTING)
        references += isinstance(node, dict) and "$ref" in node
        children = node.values() if isinstance(node, dict) else node
        pending.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    check_bound("json", references, '"$ref"s', MAX_SCHEMA_REFERENCES)


def utf8_bytes(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def parse_json(text: str):
    check_bound("json", utf8_bytes(text), "bytes of JSON", MAX_SPEC_BYTES)
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise RequestError(FIELD, f"structured json is not valid JSON: {error}") from error
    except RecursionError as error:
        raise RequestError(FIELD, f"structured json is nested too deeply to read (at most {MAX_NESTING} levels are "
                                  f"taken)") from error


class Constraint:
    """One request's grammar as it stands: the tokens it allows next (`mask`), advanced by the tokens chosen."""

    def __init__(self, matcher: llguidance.LLMatcher, words: int):
        self.matcher, self.words = matcher, words
        self._mask: np.ndarray | None = None  # the mask of the current state, once computed

    def mask(self) -> np.ndarray:
        """[W] uint32: the tokens the grammar allows next (the model's eos ids once it may end); a RequestError
        naming `structured` when it allows none (`check`)."""
        if self._mask is None:
            mask = np.zeros((1, self.words), np.int32)
            llguidance.numpy.fill_next_token_bitmask(self.matcher, mask)
            self.check()
            self._mask = mask[0].view(np.uint32)
        return self._mask

    def advance(self, tokens: list[int]) -> bool:
        """The chosen tokens consumed; returns whether the grammar is complete (nothing may follow). A RequestError
        naming `structured` when it cannot be completed from here: found now (the next mask is made here, where
        it would be made before the next step anyway), so the request ends with that error, never with output
        that does not follow its grammar."""
        self.matcher.consume_tokens(tokens)
        self._mask = None
        self.check()
        if self.matcher.is_stopped():
            return True
        self.mask()
        return False

    def check(self) -> None:
        """A RequestError naming `structured` when the matcher is in its error state (the grammar allows nothing
        more), with the first line of llguidance's reason."""
        if self.matcher.is_error():
            reason = (self.matcher.get_error().strip().splitlines() or ["no reason given"])[0]
            raise RequestError(FIELD, f"the structured output's grammar can never be completed from here (no "
                                      f"output follows it; llguidance: {reason})")


def constraint(model: Model, spec) -> Constraint:
    """A fresh Constraint of one spec for the model; a RequestError naming `structured` for an invalid spec (a
    schema, regex or grammar that does not compile, with llguidance's message; one over a bound; one that no
    output can satisfy)."""
    return matched(model, grammar(spec), next(iter(spec)))


@on_compiler_stack
def matched(model: Model, source: str, kind: str) -> Constraint:
    """A fresh Constraint of llguidance grammar `source` (made from a spec of `kind`) for the model, its first mask
    made (a RequestError when no output satisfies it)."""
    if model.tokenizer is None:
        raise RequestError(FIELD, "structured output needs a tokenizer (the token bytes); this model has none")
    tokenizer = matcher_tokenizer(model.tokenizer, model.config.vocab_size, tuple(sorted(eos_ids(model))))
    matcher = llguidance.LLMatcher(tokenizer, source, log_level=0)
    if matcher.is_error():
        raise RequestError(FIELD, f"structured {kind} is not valid: {matcher.get_error()}")
    rule = Constraint(matcher, bitmask_words(model.config.vocab_size))
    rule.mask()
    return rule


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
