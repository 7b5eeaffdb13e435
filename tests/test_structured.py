"""Structured output (`linnet_jax.structured`) and the presence/frequency penalties and logit bias: the ops against
NumPy references; 40 sampled requests with a nested JSON schema through an engine of 8 slots all validate, and with
greedy, regex, choice and free requests beside them each gives what `generate` gives, with nothing compiled after
warm-up; the server takes OpenAI's response_format and vLLM's structured_outputs on both endpoints; invalid
grammars and penalties are refused naming the field."""

import json
import re

import httpx
import jax.numpy as jnp
import jsonschema
import llguidance.numpy
import numpy as np
import pytest
from test_engine import alone
from test_serve import MODEL, client, serving

from linnet_jax import generate
from linnet_jax.inputs import RequestError
from linnet_jax.ops import SamplingParams, bitmask_words, masked, penalized
from linnet_jax.serve import Engine
from linnet_jax.serve.errors import APIError
from linnet_jax.serve.protocol import ChatRequest, structured

SCHEMA = {  # bounded everywhere (enums, maxLength, maxItems, integer ranges), so a random model's output ends
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "owner": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9},
                                                   "active": {"type": "boolean"}},
                  "required": ["id", "active"], "additionalProperties": False},
    },
    "required": ["name", "kind", "age", "tags", "owner"],
    "additionalProperties": False,
}
REGEX, CHOICES = r"[0-9]{3}-[a-z]{2,4}", ["yes", "no", "maybe later"]
BUDGET = 160


def test_penalties_and_bias_equal_a_numpy_reference():
    rng = np.random.default_rng(0)
    batch, vocab, entries = 4, 50, 3
    logits = rng.normal(0, 3, (batch, vocab)).astype(np.float32)
    counts = rng.integers(0, 4, (batch, vocab)) * (rng.random((batch, vocab)) < 0.3)
    seen = (counts > 0) | (rng.random((batch, vocab)) < 0.2)  # the prompt's tokens too
    repetition, presence, frequency = (rng.uniform(low, high, batch).astype(np.float32)
                                       for low, high in ((0.5, 2), (-2, 2), (-2, 2)))
    ids = np.stack([rng.choice(vocab, entries, replace=False) for _ in range(batch)]).astype(np.int32)
    bias = rng.uniform(-100, 100, (batch, entries)).astype(np.float32)
    ones = np.ones(batch, np.float32)
    params = SamplingParams(temperature=ones, top_k=ones.astype(np.int32), top_p=ones, min_p=0 * ones,
                            repetition_penalty=repetition, presence_penalty=presence, frequency_penalty=frequency,
                            bias_ids=ids, bias=bias, keys=np.zeros((batch, 2), np.uint32))
    want = logits.copy()
    for b in range(batch):  # transformers' repetition penalty, then OpenAI's penalties, then the bias
        for v in range(vocab):
            if seen[b, v]:
                want[b, v] = want[b, v] / repetition[b] if want[b, v] > 0 else want[b, v] * repetition[b]
            want[b, v] -= presence[b] * (counts[b, v] > 0) + frequency[b] * counts[b, v]
        want[b, ids[b]] += bias[b]
    got = penalized(jnp.asarray(logits), jnp.asarray(seen), jnp.asarray(counts, jnp.int32), params)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-4)


def test_the_mask_is_llguidance_bitmask():
    rng = np.random.default_rng(1)
    vocab = 70
    bitmask = rng.integers(-2**31, 2**31, (3, bitmask_words(vocab)), dtype=np.int64).astype(np.int32)
    logits = rng.normal(size=(3, vocab)).astype(np.float32)
    want = logits.copy()
    llguidance.numpy.apply_token_bitmask_inplace(want, bitmask)
    np.testing.assert_array_equal(np.asarray(masked(jnp.asarray(logits), jnp.asarray(bitmask.view(np.uint32)))), want)


def test_a_large_logit_bias_forces_or_forbids_a_token(tiny_chat):
    prompt = [[5, 6, 7, 8]]
    assert generate(tiny_chat, tokens=prompt, max_new_tokens=6, ignore_eos=True, logit_bias={321: 100}) == [[321] * 6]
    plain = generate(tiny_chat, tokens=prompt, max_new_tokens=1, ignore_eos=True)[0][0]
    assert generate(tiny_chat, tokens=prompt, max_new_tokens=1, ignore_eos=True, logit_bias={plain: -100})[0][0] != plain


@pytest.mark.parametrize("arguments, field", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(logit_bias={10**6: 1}), "logit_bias"), (dict(logit_bias={1: 101}), "logit_bias"),
    (dict(logit_bias={i: 1 for i in range(301)}), "logit_bias"), (dict(structured={"regex": "[a-"}), "structured"),
    (dict(structured={"json": {"type": "nonsense"}}), "structured"), (dict(structured={"xml": "x"}), "structured"),
    (dict(structured={"json": "{not json"}), "structured"), (dict(structured={"choice": []}), "structured"),
])
def test_invalid_values_are_request_errors_naming_the_argument(tiny_chat, arguments, field):
    with pytest.raises(RequestError) as error:
        generate(tiny_chat, tokens=[[5, 6]], max_new_tokens=2, **arguments)
    assert error.value.field == field and isinstance(error.value, ValueError)


def mixed_requests(vocab: int) -> list[dict]:
    """40 sampled requests under SCHEMA, 4 greedy ones, 2 regex, 2 choice, 4 free (2 greedy, 2 sampled, with a
    smaller budget)."""
    rng = np.random.default_rng(7)
    kinds = [("schema", 1.0)] * 40 + [("schema", 0.0)] * 4 + [("regex", 1.0), ("regex", 0.0), ("choice", 1.0),
                                                              ("choice", 0.0), ("free", 0.0), ("free", 1.0)] + \
        [("free", 0.0), ("free", 1.0)]
    specs = {"schema": {"json": SCHEMA}, "regex": {"regex": REGEX}, "choice": {"choice": CHOICES}, "free": None}
    return [dict(tokens=rng.integers(3, vocab, int(rng.integers(2, 30))).tolist(),
                 max_tokens=BUDGET if specs[kind] else 24, seed=int(rng.integers(0, 2**62)), temperature=temperature,
                 structured=specs[kind]) for kind, temperature in kinds]


def check_output(text: str, spec: dict | None) -> None:
    if spec is None:
        return
    if "json" in spec:
        jsonschema.validate(json.loads(text), spec["json"])
    elif "regex" in spec:
        assert re.fullmatch(spec["regex"], text), text
    else:
        assert text in spec["choice"], text


def test_engine_constrained_and_free_requests_equal_generate_and_compile_nothing(tiny_chat):
    requests = mixed_requests(tiny_chat.config.vocab_size)
    with Engine(tiny_chat, slots=8, max_len=256, prefill_chunk=32) as engine:
        engine.warmup()
        results = [handle.result(timeout=600) for handle in [engine.submit(**r) for r in requests]]
        assert engine.compiles_after_warmup == 0
    for i, (result, request) in enumerate(zip(results, requests)):
        if request["structured"] is not None:  # the grammar was complete, or (a regex that may go on) eos ended it
            assert result.stop_reason in ("stop", "eos"), (i, result)
            check_output(result.text, request["structured"])
    constrained = [i for i, request in enumerate(requests) if request["structured"] is not None]
    batched = generate(tiny_chat, tokens=[requests[i]["tokens"] for i in constrained], max_new_tokens=BUDGET,
                       temperature=[requests[i]["temperature"] for i in constrained],
                       seed=[requests[i]["seed"] for i in constrained],
                       structured=[requests[i]["structured"] for i in constrained], return_details=True)
    assert [results[i].tokens for i in constrained] == [g.tokens for g in batched]
    for request, result in zip(requests, results):
        if request["structured"] is None:  # a free request beside constrained ones gives what it gives alone
            assert result.tokens == alone(tiny_chat, {k: v for k, v in request.items() if k != "structured"}).tokens


def test_protocol_maps_response_format_and_structured_outputs():
    def body(**fields):
        return ChatRequest(messages=[{"role": "user", "content": "x"}], **fields)

    assert structured(body()) == (None, "response_format")
    assert structured(body(response_format={"type": "text"}))[0] is None
    assert structured(body(response_format={"type": "json_object"}))[0] == {"json": {"type": "object"}}
    assert structured(body(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA,
                                                                                   "strict": True}})) \
        == ({"json": SCHEMA}, "response_format")
    assert structured(body(structured_outputs={"regex": "a+"})) == ({"regex": "a+"}, "structured_outputs")
    assert structured(body(structured_outputs={"json_object": True}))[0] == {"json": {"type": "object"}}
    for fields, param in ((dict(response_format={"type": "xml"}), "response_format.type"),
                          (dict(response_format={"type": "json_schema"}), "response_format.json_schema"),
                          (dict(structured_outputs={"regex": "a", "choice": ["a"]}), "structured_outputs"),
                          (dict(structured_outputs={"regex": "a"}, response_format={"type": "json_object"}),
                           "structured_outputs")):
        with pytest.raises(APIError) as error:
            structured(body(**fields))
        assert error.value.param == param


def test_server_structured_output_on_both_endpoints(tiny_chat):
    messages = [{"role": "user", "content": "a pet as JSON"}]
    expected = generate(tiny_chat, messages, BUDGET, structured={"json": SCHEMA})
    schema_format = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}
    with Engine(tiny_chat, slots=4, max_len=256) as engine, serving(engine) as url:
        api = client(url)
        chat = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=BUDGET, temperature=0,
                                           response_format=schema_format)
        assert (chat.choices[0].message.content, chat.choices[0].finish_reason) == (expected, "stop")
        for spec in ({"regex": REGEX}, {"choice": CHOICES}, {"json": json.dumps(SCHEMA)}):
            completion = api.completions.create(model=MODEL, prompt="the sea", max_tokens=BUDGET, temperature=1,
                                                seed=3, extra_body={"structured_outputs": spec})
            check_output(completion.choices[0].text, {"json": SCHEMA} if "json" in spec else spec)
            assert completion.choices[0].finish_reason == "stop"
        biased = api.completions.create(model=MODEL, prompt="the sea", max_tokens=3, temperature=0,
                                        logit_bias={"321": 100}, presence_penalty=1, frequency_penalty=-1)
        assert biased.choices[0].text == tiny_chat.tokenizer.decode([321] * 3)
        for path, body, param in [
            ("/v1/chat/completions", {"messages": messages, "response_format": {
                "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
             "response_format"),
            ("/v1/completions", {"prompt": "hi", "structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
            ("/v1/completions", {"prompt": "hi", "structured_outputs": {"xml": "x"}}, "structured_outputs"),
            ("/v1/completions", {"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
            ("/v1/completions", {"prompt": "hi", "logit_bias": {"1": 500}}, "logit_bias"),
            ("/v1/completions", {"prompt": "hi", "logit_bias": {"x": 5}}, "logit_bias"),
        ]:
            response = httpx.post(f"{url}{path}", json=body, timeout=60)
            assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
