"""The OpenAI API's shapes for `linnet_jax.serve.app`: request bodies and the responses built from engine output.

Request bodies are strict pydantic models: a wrong JSON type is a 400 that names the field (`"5"` is not an
int, `1` is not a bool). Every field that OpenAI defines and this server does not implement is refused by name
(`refused_field`), unless it holds the value that means "not used"; other unknown fields are accepted, as vLLM
accepts them. A grammar comes as OpenAI's `response_format` or vLLM's `structured_outputs` (`structured`). Responses are plain dicts in OpenAI's shapes: `/v1/completions` (`Completions`) and
`/v1/chat/completions` (`ChatCompletions`), streamed as chunks or whole.
"""

import dataclasses
import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from linnet_jax.decode import TOP_LOGPROBS
from linnet_jax.inputs import SEED_RANGE
from linnet_jax.serve.engine import Handle, Piece
from linnet_jax.serve.errors import APIError

# OpenAI fields this server does not implement -> the values that mean "not used" (accepted).
REFUSED = {
    "tools": ([],), "tool_choice": ("none",), "functions": ([],), "function_call": ("none",), "suffix": ("",),
    "best_of": (1,),
}
STRUCTURED_OUTPUTS = ("json", "regex", "choice", "grammar", "json_object")  # vLLM's kinds that this server takes
ANY_JSON_OBJECT = {"json": {"type": "object"}}
# OpenAI's finish_reason for each of the engine's stop reasons.
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "abort"}


class Strict(BaseModel):
    """JSON types as OpenAI's API takes them: no coercion, no NaN or infinity; unknown fields accepted."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class StreamOptions(Strict):
    include_usage: bool | None = None


class Sampling(Strict):
    """The fields both generation endpoints share."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # -1 (vLLM's spelling) or 0: no top-k
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    response_format: dict | None = None
    structured_outputs: dict | None = None
    seed: int | None = Field(None, ge=SEED_RANGE[0], lt=SEED_RANGE[1])
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    n: int | None = Field(None, ge=1)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None


class CompletionRequest(Sampling):
    """POST /v1/completions: `prompt` is a string, a list of strings, ids, or a list of id lists."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=TOP_LOGPROBS)
    echo: bool | None = None
    max_tokens: int | None = Field(None, ge=0)  # 0: with echo, score the prompt only


class ContentPart(Strict):
    type: Literal["text"]
    text: str


class Message(Strict):
    role: str
    content: str | list[ContentPart] | None = None


class ChatRequest(Sampling):
    """POST /v1/chat/completions."""

    messages: list[Message] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=TOP_LOGPROBS)


class TokenizeRequest(Strict):
    """POST /tokenize: a prompt (encoded as /v1/completions encodes it) or messages (as the chat endpoint does)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int]


class LoadLoraRequest(Strict):
    """POST /v1/load_lora_adapter (vLLM's): a PEFT adapter directory served as `lora_name`."""

    lora_name: str
    lora_path: str


class UnloadLoraRequest(Strict):
    """POST /v1/unload_lora_adapter (vLLM's)."""

    lora_name: str


def refused_field(body: BaseModel) -> str | None:
    """The first OpenAI field in the request that this server does not implement (and does not hold its
    "not used" value), or None."""
    extra = body.model_extra or {}
    return next((name for name, unused in REFUSED.items()
                 if extra.get(name) is not None and extra[name] not in unused), None)


def message_dicts(messages: list[Message]) -> list[dict]:
    """Messages as the chat template takes them: text parts joined into one string, extra keys kept. A 400 naming
    `messages[i].content` for a message without content (null or missing, as OpenAI's assistant tool_calls have)."""
    def content(i: int, message: Message) -> str:
        if message.content is None:
            raise APIError(400, f"messages[{i}].content is null or missing; expected a string or a list of text "
                                f"parts (this server takes no tool_calls)", f"messages[{i}].content")
        if isinstance(message.content, list):
            return "".join(part.text for part in message.content)
        return message.content

    return [{**(message.model_extra or {}), "role": message.role, "content": content(i, message)}
            for i, message in enumerate(messages)]


def budget(body: Sampling) -> tuple[str, int | None]:
    """The new-token budget's field and value: max_completion_tokens when given (OpenAI's newer name), else
    max_tokens (None: what the slot has room for)."""
    if body.max_completion_tokens is not None:
        return "max_completion_tokens", body.max_completion_tokens
    return "max_tokens", body.max_tokens


def structured(body: Sampling) -> tuple[dict | None, str]:
    """The request's grammar as Engine.submit's `structured` (None: none) and the field it came from: OpenAI's
    response_format ({"type": "json_object"} or {"type": "json_schema", "json_schema": {"name", "schema",
    "strict"}}) or vLLM's structured_outputs (one of json, regex, choice, grammar, json_object). A 400 naming the
    field for any other shape (what a grammar's content gets wrong, Engine.submit says)."""
    response_format, outputs = body.response_format, body.structured_outputs
    if outputs is not None:
        if response_format not in (None, {"type": "text"}):
            raise APIError(400, "give one of response_format and structured_outputs", "structured_outputs")
        # a kind is given unless null, or json_object false (vLLM's flag, off): json false is a schema that
        # Engine.submit refuses
        kinds = [kind for kind in STRUCTURED_OUTPUTS
                 if outputs.get(kind) is not None and not (kind == "json_object" and outputs[kind] is False)]
        if len(kinds) != 1:
            raise APIError(400, f"structured_outputs must hold one of {', '.join(STRUCTURED_OUTPUTS)}, got "
                                f"{sorted(outputs)}", "structured_outputs")
        spec = ANY_JSON_OBJECT if kinds[0] == "json_object" else {kinds[0]: outputs[kinds[0]]}
        return spec, "structured_outputs"
    kind = (response_format or {}).get("type", "text")
    if kind == "json_object":
        return ANY_JSON_OBJECT, "response_format"
    if kind == "json_schema":
        schema = response_format.get("json_schema")
        if not isinstance(schema, dict) or not isinstance(schema.get("name"), str):
            raise APIError(400, 'response_format.json_schema must be an object with a "name" and a "schema"',
                           "response_format.json_schema")
        return {"json": schema.get("schema", {})}, "response_format"
    if kind != "text":
        raise APIError(400, f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                       "response_format.type")
    return None, "response_format"


def engine_options(body: Sampling, top_logprobs: int) -> dict:
    """The Engine.submit keywords of a request (OpenAI's defaults: temperature 1, top_p 1), seed, choice and
    structured aside."""
    def given(value, default):
        return default if value is None else value

    return dict(
        max_tokens=budget(body)[1],
        temperature=given(body.temperature, 1.0), top_p=given(body.top_p, 1.0), top_k=max(given(body.top_k, 0), 0),
        min_p=given(body.min_p, 0.0), repetition_penalty=given(body.repetition_penalty, 1.0),
        presence_penalty=given(body.presence_penalty, 0.0), frequency_penalty=given(body.frequency_penalty, 0.0),
        logit_bias=body.logit_bias, stop=body.stop, stop_token_ids=body.stop_token_ids,
        ignore_eos=bool(body.ignore_eos), top_logprobs=top_logprobs)


@dataclasses.dataclass
class Output:
    """One choice's output, accumulated from the engine's Pieces."""

    text: str = ""
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)

    def add(self, piece: Piece) -> None:
        self.text += piece.text
        self.tokens += piece.tokens
        self.logprobs += piece.logprobs
        self.top_logprobs += piece.top_logprobs


def usage(handles: list[Handle], n: int) -> dict:
    """OpenAI's usage: each prompt counted once (handles hold n choices per prompt), every choice's tokens."""
    prompt = sum(handle.prompt_tokens for handle in handles[::n])
    completion = sum(len(handle.generation.tokens) for handle in handles)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def finish_reason(handle: Handle) -> str:
    return FINISH_REASONS[handle.generation.stop_reason]


class Shape:
    """How one endpoint writes choices, whole and streamed. `tokenizer` names the logprob tokens."""

    object: str
    chunk_object: str
    prefix: str

    def __init__(self, model_name: str, tokenizer, logprobs: bool):
        self.model_name, self.tokenizer, self.logprobs = model_name, tokenizer, logprobs
        self.id, self.created = f"{self.prefix}-{uuid.uuid4().hex}", int(time.time())

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False) if self.tokenizer else str(token)

    def response(self, choices: list[dict], usage: dict) -> dict:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model_name,
                "choices": choices, "usage": usage}

    def chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        chunk = {"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.model_name,
                 "choices": choices}
        return chunk | ({"usage": usage} if usage is not None else {})


class Completions(Shape):
    """/v1/completions: choices carry `text`; logprobs as {tokens, token_logprobs, top_logprobs, text_offset}."""

    object = chunk_object = "text_completion"
    prefix = "cmpl"

    def choice(self, index: int, output: Output, reason: str | None, offset: int = 0) -> dict:
        return {"index": index, "text": output.text, "logprobs": self.choice_logprobs(output, offset),
                "finish_reason": reason}

    def choice_logprobs(self, output: Output, offset: int) -> dict | None:
        if not self.logprobs:
            return None
        texts = [self.token_text(token) for token in output.tokens]
        starts = [offset + sum(len(text) for text in texts[:i]) for i in range(len(texts))]
        top = [{self.token_text(t): lp for t, lp in pairs} if pairs else None for pairs in output.top_logprobs]
        return {"tokens": texts, "token_logprobs": output.logprobs, "top_logprobs": top or [None] * len(texts),
                "text_offset": starts}

    def echoed(self, choice: dict, prompt: Output, stop: Output) -> dict:
        """A choice with its prompt before it (`echo`): the prompt's text, and (logprobs) its tokens' entries, the
        first token's logprob and top_logprobs null (nothing comes before it), then the generated tokens' and
        the entry of the stop id that ended the generation, if one did (`linnet_jax.serve.echo`)."""
        text, logprobs = prompt.text + choice["text"], choice["logprobs"]
        if logprobs is not None:
            parts = [self.choice_logprobs(prompt, 0), logprobs, self.choice_logprobs(stop, len(text))]
            parts[0]["token_logprobs"][0] = parts[0]["top_logprobs"][0] = None
            parts[1] = logprobs | {"text_offset": [len(prompt.text) + offset for offset in logprobs["text_offset"]]}
            logprobs = {key: [value for part in parts for value in part[key]] for key in logprobs}
        return choice | {"text": text, "logprobs": logprobs}

    def delta(self, index: int, piece: Output, first: bool, offset: int) -> dict:
        return self.choice(index, piece, None, offset)

    def end(self, index: int, reason: str, first: bool) -> dict:
        return {"index": index, "text": "", "logprobs": None, "finish_reason": reason}


class ChatCompletions(Shape):
    """/v1/chat/completions: choices carry a `message` (streamed: a `delta`, the role with the first token);
    logprobs as {content: [{token, logprob, bytes, top_logprobs}]}."""

    object, chunk_object = "chat.completion", "chat.completion.chunk"
    prefix = "chatcmpl"

    def choice(self, index: int, output: Output, reason: str | None) -> dict:
        return {"index": index, "message": {"role": "assistant", "content": output.text},
                "logprobs": self.choice_logprobs(output), "finish_reason": reason}

    def entry(self, token: int, logprob: float) -> dict:
        text = self.token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "replace"))}

    def choice_logprobs(self, output: Output) -> dict | None:
        if not self.logprobs:
            return None
        tops = output.top_logprobs or [[]] * len(output.tokens)
        return {"content": [self.entry(token, logprob) | {"top_logprobs": [self.entry(t, lp) for t, lp in top]}
                            for token, logprob, top in zip(output.tokens, output.logprobs, tops)]}

    def delta(self, index: int, piece: Output, first: bool, offset: int) -> dict:
        delta = ({"role": "assistant"} if first else {}) | {"content": piece.text}
        return {"index": index, "delta": delta, "logprobs": self.choice_logprobs(piece), "finish_reason": None}

    def end(self, index: int, reason: str, first: bool) -> dict:
        delta = {"role": "assistant", "content": ""} if first else {}
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}
