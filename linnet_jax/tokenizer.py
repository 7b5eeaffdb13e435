"""Text <-> token ids and chat templates, with the same results as transformers.

A `Tokenizer` wraps a `tokenizers.Tokenizer` (the Rust backend transformers' fast tokenizers
use) together with what transformers keeps beside it: the special tokens, whether a BOS/EOS is
added, every end-of-sequence id, and the chat template.

    Tokenizer.from_hf_dir(dir)             tokenizer.json + tokenizer_config.json (+ chat_template.jinja,
                                           special_tokens_map.json, generation_config.json)
    Tokenizer.from_gguf_metadata(metadata) the tokenizer.* keys of a GGUF file (see linnet_jax.gguf)
    tok.save(dir)                          files transformers.AutoTokenizer.from_pretrained(dir) loads
    tok.gguf_metadata()                    the tokenizer.* keys for linnet_jax.gguf.write_gguf

GGUF stores a byte-level BPE vocabulary ("gpt2") as tokens + merges, and a sentencepiece one
("llama") as tokens + scores; both become a tokenizers BPE model built the way transformers'
GGUF loader builds it, so ids agree with `AutoTokenizer.from_pretrained(dir, gguf_file=...)`.
"""

from __future__ import annotations

import datetime
import functools
import json
import pathlib
import re

import jinja2
import jinja2.ext
import numpy as np
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

__all__ = ["Tokenizer"]

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
TOKENIZER_CLASS = "PreTrainedTokenizerFast"  # the transformers class that reads a saved Tokenizer back
_SURROGATE = re.compile("[\ud800-\udfff]")
# GGUF token types (llama.cpp's llama_token_type).
_NORMAL, _CONTROL, _USER_DEFINED, _UNUSED = 1, 3, 4, 5

# The pre-tokenizer split of byte-level vocabularies whose GGUF `tokenizer.ggml.pre` names one that is not
# GPT-2's (GPT-2's is ByteLevel's built-in regex, the default). The same table as transformers' GGUF loader
# for these families.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
           "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}


@functools.cache
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map: printable Latin-1 bytes stand for themselves, the
    other 68 bytes (controls, space, ...) take the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str | None) -> tokenizers.Tokenizer:
    """A GGUF "gpt2" vocabulary as a byte-level BPE tokenizer (transformers' GPT2Tokenizer shape)."""
    alphabet = _byte_alphabet()
    letters = set(alphabet.values())
    # A token spelled outside the byte alphabet (a llama.cpp mislabel) is respelled in it.
    vocab = {t if set(t) <= letters else "".join(alphabet[b] for b in t.encode()): i for i, t in enumerate(tokens)}
    backend = tokenizers.Tokenizer(models.BPE(
        vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges],
        continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    if pre in _SPLITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return backend


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """The BPE merges a sentencepiece vocabulary implies: every split of a token into two tokens,
    best-scored result first (ties: longer left piece, longer right piece, then vocabulary order)."""
    ids = {t: i for i, t in enumerate(tokens)}
    ranked = sorted(
        (-score, -cut, -(len(token) - cut), index, ids[token[:cut]], ids[token[cut:]])
        for index, (token, score) in enumerate(zip(tokens, scores))
        for cut in range(1, len(token))
        if token[:cut] in ids and token[cut:] in ids)
    return [(tokens[left], tokens[right]) for *_, left, right in ranked]


def _sentencepiece_bpe(tokens: list[str], scores: list[float], merges: list[str] | None,
                       add_space_prefix: bool) -> tokenizers.Tokenizer:
    """A GGUF "llama" (sentencepiece) vocabulary as a BPE with byte fallback (transformers' LlamaTokenizer shape)."""
    pairs = [tuple(m.split(" ", 1)) for m in merges] if merges else _merges_from_scores(tokens, scores)
    backend = tokenizers.Tokenizer(models.BPE(
        vocab={t: i for i, t in enumerate(tokens)}, merges=pairs, fuse_unk=True, byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_space_prefix else "never", split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if add_space_prefix else []))
    return backend


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers marks assistant text with it): renders its body."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja's own tojson escapes HTML characters; chat templates want plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    """A chat template compiled in the sandbox, with the globals and filters transformers provides."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(source)


def _encodable(text: str, name: str) -> str:
    """`text`, or a ValueError naming the position of a lone surrogate (a str UTF-8 cannot encode)."""
    if match := _SURROGATE.search(text):
        raise ValueError(f"{name} holds a lone surrogate, U+{ord(match.group()):04X}, at position {match.start()}: "
                         "it is not a character and cannot be encoded as UTF-8")
    return text


def _checked_messages(messages) -> list[dict]:
    """`messages` as transformers passes them to a template (keys whose value is None dropped), or a ValueError."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(
            f"messages must be a non-empty list of {{'role': ..., 'content': ...}} dicts, got {messages!r}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or (
                "content" not in message and "tool_calls" not in message):
            raise ValueError(f"messages[{i}] must be a dict with a string 'role' and a 'content', got {message!r}")
        for key, value in message.items():
            if isinstance(value, str):
                _encodable(value, f"messages[{i}][{key!r}]")
    return [{k: v for k, v in message.items() if v is not None} for message in messages]


def _read_json(path: pathlib.Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


class Tokenizer:
    """Wraps a `tokenizers.Tokenizer` plus the chat template and special ids.

    backend: the tokenizers.Tokenizer; the special tokens named here are added to it as special
      tokens when it lacks them (as transformers does).
    add_bos_token / add_eos_token: when given, `encode(..., add_special_tokens=True)` adds exactly
      these (the backend's post-processor is replaced); when None, the backend's own post-processor
      decides (a tokenizer.json may carry one).
    eos_token_ids: every id that ends a generation; the eos token's id is always among them.
    gguf_tokenizer: the tokenizer.ggml.* metadata this was built from, written back by gguf_metadata().
    """

    def __init__(self, backend: tokenizers.Tokenizer, *, chat_template: str | None = None,
                 bos_token: str | None = None, eos_token: str | None = None, unk_token: str | None = None,
                 pad_token: str | None = None, eos_token_ids=(), add_bos_token: bool | None = None,
                 add_eos_token: bool | None = None, gguf_tokenizer: dict | None = None):
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token, self.eos_token, self.unk_token, self.pad_token = bos_token, eos_token, unk_token, pad_token
        self.add_bos_token, self.add_eos_token = add_bos_token, add_eos_token
        self.gguf_tokenizer = gguf_tokenizer
        added = {a.content for a in backend.get_added_tokens_decoder().values()}
        missing = [t for t in dict.fromkeys((bos_token, eos_token, unk_token, pad_token))
                   if t is not None and t not in added]
        if missing:
            backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])
        if add_bos_token is not None or add_eos_token is not None:
            backend.post_processor = self._post_processor(bool(add_bos_token), bool(add_eos_token))
        self.bos_token_id = self._id(bos_token)
        self.pad_token_id = self._id(pad_token)
        eos_id = self._id(eos_token)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(
            [*([eos_id] if eos_id is not None else []), *(int(i) for i in eos_token_ids)]))
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def _post_processor(self, add_bos: bool, add_eos: bool) -> processors.TemplateProcessing:
        """BOS/EOS around each sequence, as transformers' update_post_processor (absent tokens are not added)."""
        bos = [(self.bos_token, self._id(self.bos_token))] if add_bos and self.bos_token is not None else []
        eos = [(self.eos_token, self._id(self.eos_token))] if add_eos and self.eos_token is not None else []

        def sequence(piece: str, type_id: int) -> str:
            return " ".join([*(f"{t}:{type_id}" for t, _ in bos), f"${piece}:{type_id}",
                             *(f"{t}:{type_id}" for t, _ in eos)])

        return processors.TemplateProcessing(
            single=sequence("A", 0), pair=f"{sequence('A', 0)} {sequence('B', 1)}", special_tokens=bos + eos)

    # ---- construction ----

    @classmethod
    def from_hf_dir(cls, path) -> Tokenizer | None:
        """The tokenizer of a transformers checkpoint directory; None when it has no tokenizer.json."""
        path = pathlib.Path(path)
        if not (path / "tokenizer.json").is_file():
            return None
        config = _read_json(path / "tokenizer_config.json")
        special = _read_json(path / "special_tokens_map.json")
        generation = _read_json(path / "generation_config.json")

        def token(name: str) -> str | None:
            value = config.get(name, special.get(name))
            return value.get("content") if isinstance(value, dict) else value

        template_file = path / "chat_template.jinja"
        template = template_file.read_text(encoding="utf-8") if template_file.is_file() else config.get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]: the default one
            template = {t["name"]: t["template"] for t in template}.get("default")
        eos_ids = generation.get("eos_token_id")
        return cls(
            tokenizers.Tokenizer.from_file(str(path / "tokenizer.json")), chat_template=template,
            **{name: token(name) for name in _SPECIAL_NAMES},
            eos_token_ids=[eos_ids] if isinstance(eos_ids, int) else eos_ids or (),
            add_bos_token=config.get("add_bos_token"), add_eos_token=config.get("add_eos_token"))

    @classmethod
    def from_gguf_metadata(cls, metadata: dict) -> Tokenizer | None:
        """The tokenizer described by a GGUF file's tokenizer.* metadata (see `linnet_jax.gguf.read_gguf`);
        None when there is none. Byte-level BPE ("gpt2") and sentencepiece ("llama") vocabularies."""
        kind = metadata.get("tokenizer.ggml.model")
        if kind is None:
            return None

        def required(key: str):
            if key not in metadata:
                raise ValueError(f"GGUF tokenizer metadata key {key!r} is missing")
            return metadata[key]

        tokens = required("tokenizer.ggml.tokens")
        types = metadata.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
        if kind == "gpt2":
            backend = _byte_level_bpe(tokens, required("tokenizer.ggml.merges"), metadata.get("tokenizer.ggml.pre"))
            letters = set(_byte_alphabet().values())
            control = [t for t, k in zip(tokens, types) if k == _CONTROL and set(t) <= letters]
        elif kind == "llama":
            merges = metadata.get("tokenizer.ggml.merges")
            backend = _sentencepiece_bpe(tokens, None if merges else required("tokenizer.ggml.scores"), merges,
                                         metadata.get("tokenizer.ggml.add_space_prefix", True))
            control = [t for t, k in zip(tokens, types) if k == _CONTROL]
        else:
            raise ValueError(f"GGUF tokenizer model {kind!r} is not supported; supported: gpt2, llama")
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
        backend.add_tokens([AddedToken(t, special=False, normalized=False)
                            for t, k in zip(tokens, types) if k == _USER_DEFINED])

        def token(key: str) -> str | None:
            index = metadata.get(f"tokenizer.ggml.{key}")
            return None if index is None else tokens[index]

        return cls(
            backend, chat_template=metadata.get("tokenizer.chat_template"),
            bos_token=token("bos_token_id"), eos_token=token("eos_token_id"),
            unk_token=token("unknown_token_id"), pad_token=token("padding_token_id"),
            eos_token_ids=[metadata[f"tokenizer.ggml.{k}"] for k in ("eot_token_id", "eom_token_id")
                           if f"tokenizer.ggml.{k}" in metadata],
            # llama.cpp adds BOS to sentencepiece vocabularies unless told otherwise.
            add_bos_token=metadata.get("tokenizer.ggml.add_bos_token", kind == "llama"),
            add_eos_token=metadata.get("tokenizer.ggml.add_eos_token", False),
            gguf_tokenizer={k: v for k, v in metadata.items() if k.startswith("tokenizer.ggml.")})

    # ---- use ----

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written in the text (e.g. "<|im_start|>") map to their ids. (Through
        encode_batch, which, unlike encode, lets other Python threads run meanwhile: a server's event loop.)"""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        return self.backend.encode_batch([_encodable(text, "the text")], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Text of `ids` (a sequence or 1-D array of ints); ValueError for an id outside the vocabulary."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1).tolist()
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (vocab size {self.vocab_size})")
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tokenize: bool = False,
                            **template_vars) -> str | list[int]:
        """Render `messages` ([{"role": ..., "content": ...}, ...]) with the chat template, as transformers'
        apply_chat_template does; `template_vars` (e.g. tools=..., enable_thinking=...) reach the template.
        tokenize=True returns the ids of the rendered text (no special tokens added: the template writes them)."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template, so apply_chat_template() cannot format messages; "
                             "encode() the prompt text instead")
        special = {name: getattr(self, name) for name in _SPECIAL_NAMES if getattr(self, name) is not None}
        text = _compile_template(self.chat_template).render(
            messages=_checked_messages(messages), tools=None, documents=None,
            add_generation_prompt=add_generation_prompt, **{**special, **template_vars})
        return self.encode(text) if tokenize else text

    # ---- export ----

    def save(self, out_dir) -> None:
        """Write tokenizer.json, tokenizer_config.json, special_tokens_map.json and chat_template.jinja
        (the template also inside tokenizer_config.json, for older readers)."""
        out = pathlib.Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(out / "tokenizer.json"))
        special = {name: getattr(self, name) for name in _SPECIAL_NAMES if getattr(self, name) is not None}
        config = {"tokenizer_class": TOKENIZER_CLASS, **special, "clean_up_tokenization_spaces": False}
        for flag in ("add_bos_token", "add_eos_token"):
            if getattr(self, flag) is not None:
                config[flag] = getattr(self, flag)
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
            (out / "chat_template.jinja").write_text(self.chat_template, encoding="utf-8")
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")
        (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2, ensure_ascii=False),
                                                     encoding="utf-8")

    def gguf_metadata(self) -> dict:
        """The tokenizer.* GGUF keys (llama.cpp's names) for `linnet_jax.gguf.write_gguf`.

        A tokenizer read from GGUF gives back the keys it was read from; one from a transformers
        directory must be byte-level BPE ("gpt2": tokens, merges, token types, pre-tokenizer name)."""
        keys = dict(self.gguf_tokenizer) if self.gguf_tokenizer is not None else self._byte_level_gguf_keys()
        if self.chat_template is not None:
            keys["tokenizer.chat_template"] = self.chat_template
        return keys

    def _byte_level_gguf_keys(self) -> dict:
        spec = json.loads(self.backend.to_str())
        model, pre = spec["model"], spec.get("pre_tokenizer") or {}
        steps = pre.get("pretokenizers", [pre])
        if model["type"] != "BPE" or not any(s.get("type") == "ByteLevel" for s in steps):
            raise ValueError("only byte-level BPE tokenizers can be written as GGUF tokenizer metadata; "
                             f"this one is {model['type']} with pre-tokenizer {pre.get('type')}")
        added = self.backend.get_added_tokens_decoder()
        tokens = [f"[PAD{i}]" for i in range(self.vocab_size)]
        types = [_UNUSED] * self.vocab_size
        for token, index in self.backend.get_vocab(with_added_tokens=True).items():
            tokens[index] = token
            types[index] = _NORMAL if index not in added else _CONTROL if added[index].special else _USER_DEFINED
        probe = self.backend.encode("a", add_special_tokens=True).ids
        keys = {
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.pre": _pre_name(steps),
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": [m if isinstance(m, str) else " ".join(m) for m in model["merges"]],
            "tokenizer.ggml.add_bos_token": self.bos_token_id is not None and probe[0] == self.bos_token_id,
            "tokenizer.ggml.add_eos_token": self.eos_token is not None and probe[-1] == self._id(self.eos_token),
        }
        for key, index in (("bos_token_id", self.bos_token_id), ("eos_token_id", self._id(self.eos_token)),
                           ("unknown_token_id", self._id(self.unk_token)), ("padding_token_id", self.pad_token_id)):
            if index is not None:
                keys[f"tokenizer.ggml.{key}"] = index
        return keys


def _pre_name(steps: list[dict]) -> str:
    """llama.cpp's name (tokenizer.ggml.pre) for a byte-level pre-tokenizer, given as tokenizer.json's steps."""
    regexes = [s["pattern"].get("Regex") for s in steps if s["type"] == "Split"]
    if regexes == [_LLAMA3_SPLIT]:
        return "llama-bpe"
    if regexes == [_QWEN2_SPLIT]:
        return "qwen2"
    if [s["type"] for s in steps] == ["Digits", "ByteLevel"] and steps[0].get("individual_digits"):
        return "smollm"
    if regexes:
        raise ValueError(f"the pre-tokenizer split {regexes[0]!r} has no llama.cpp name")
    return "gpt-2"
