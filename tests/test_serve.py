"""The OpenAI-compatible server (`linnet_jax.serve.app`, `linnet-jax serve`) against live servers on 127.0.0.1.

Most servers run in-process (uvicorn in a thread, on a socket bound to a free port); the shutdown test runs
`linnet-jax serve` as a subprocess. Parity with `generate()` runs on SmolLM2 through the official `openai`
client; concurrency, the fuzz and the error cases run on a tiny random llama with SmolLM2's tokenizer.
"""

import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import uvicorn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import linnet_jax
from linnet_jax import generate
from linnet_jax.cli import engine_options, main, parser
from linnet_jax.serve import Engine, EngineFailed
from linnet_jax.serve.app import create_app, serve
from linnet_jax.serve.errors import field_path

MODEL = "test-model"
WORDS = "the sea a cat ran over blue hills while seven quiet birds sang of rain and bread".split()


@pytest.fixture(scope="module")
def tiny_engine(tiny_chat):
    with Engine(tiny_chat, slots=8, max_len=256) as engine:
        yield engine


@pytest.fixture(scope="module")
def tiny_server(tiny_engine):
    with serving(tiny_engine) as url:
        yield url


def free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@contextlib.contextmanager
def serving(engine: Engine, **options):
    """The app on `engine` (create_app's options), served by uvicorn in a thread on a free port: yields its base
    URL."""
    app = create_app(engine, model_name=MODEL, **options)
    sock = free_socket()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def client(url: str, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def metric(url: str, name: str, headers: dict | None = None) -> float:
    """The value of one unlabelled Prometheus sample from /metrics (asked with `headers`)."""
    for line in httpx.get(f"{url}/metrics", headers=headers).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} is not in /metrics")


def wait_for(condition, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


# --- parity with generate() on SmolLM2, through the official client ------------------------------------------

def test_openai_client_matches_generate_on_smollm2(smollm2):
    prompts = ["The capital of France is", "Once upon a time, a fox"]
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    texts = generate(smollm2, prompts, 16, chat=False, return_details=True)
    reply = generate(smollm2, conversation, 16, return_details=True)
    prompt_tokens = [len(smollm2.tokenizer.encode(p, add_special_tokens=True)) for p in prompts]
    chat_tokens = len(smollm2.tokenizer.apply_chat_template(conversation, tokenize=True))
    with Engine(smollm2, slots=4, max_len=128) as engine, serving(engine) as url:
        api = client(url)
        whole = api.completions.create(model=MODEL, prompt=prompts, max_tokens=16, temperature=0)
        assert [c.text for c in sorted(whole.choices, key=lambda c: c.index)] == [t.text for t in texts]
        assert whole.usage.prompt_tokens == sum(prompt_tokens)
        assert whole.usage.completion_tokens == sum(len(t.tokens) for t in texts)
        assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
        assert [c.finish_reason for c in whole.choices] == ["length" if t.stop_reason == "length" else "stop"
                                                           for t in texts]

        chunks = list(api.completions.create(model=MODEL, prompt=prompts[0], max_tokens=16, temperature=0,
                                             stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == texts[0].text
        assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == prompt_tokens[0]
        assert chunks[-1].usage.completion_tokens == len(texts[0].tokens)

        answer = api.chat.completions.create(model=MODEL, messages=conversation, max_tokens=16, temperature=0)
        assert answer.choices[0].message.role == "assistant"
        assert answer.choices[0].message.content == reply.text
        assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (chat_tokens, len(reply.tokens))

        chunks = list(api.chat.completions.create(model=MODEL, messages=conversation, max_tokens=16, temperature=0,
                                                  stream=True, stream_options={"include_usage": True}))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert deltas[0].role == "assistant" and deltas[0].content, "the role travels with the first token"
        assert "".join(d.content or "" for d in deltas) == reply.text
        assert chunks[-1].usage.completion_tokens == len(reply.tokens)
        assert engine.stats()["busy_slots"] == 0


# --- concurrency ----------------------------------------------------------------------------------------------

def mixed_requests(count: int) -> list[dict]:
    """Requests of mixed prompt lengths, max_tokens and sampling: greedy, seeded, and unseeded sampling."""
    rng = random.Random(0)
    requests = []
    for i in range(count):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))
        sampling = [dict(temperature=0.0),
                    dict(temperature=0.9, top_p=0.9, top_k=50, min_p=0.02, repetition_penalty=1.1, seed=1000 + i),
                    dict(temperature=1.0)][i % 3]
        requests.append(dict(prompt=prompt, max_tokens=rng.randint(1, 24), **sampling))
    return requests


async def stream_completion(api: openai.AsyncOpenAI, request: dict) -> tuple[str, str]:
    extra = {k: request[k] for k in ("top_k", "min_p", "repetition_penalty") if k in request}
    stream = await api.completions.create(
        model=MODEL, prompt=request["prompt"], max_tokens=request["max_tokens"], stream=True,
        temperature=request["temperature"], top_p=request.get("top_p", 1.0), seed=request.get("seed"),
        extra_body=extra | {"ignore_eos": True})
    text, finish = "", None
    async for chunk in stream:
        text += chunk.choices[0].text
        finish = chunk.choices[0].finish_reason or finish
    return text, finish


def test_32_concurrent_streams_through_8_slots_equal_generate(tiny_chat, tiny_engine, tiny_server):
    requests = mixed_requests(32)

    async def run_all():
        api = openai.AsyncOpenAI(base_url=f"{tiny_server}/v1", api_key="none", max_retries=0, timeout=300)
        return await asyncio.gather(*(stream_completion(api, request) for request in requests))

    results = asyncio.run(run_all())
    assert all(finish == "length" for _, finish in results)
    assert_reproducible_equal_generate(tiny_chat, requests, [text for text, _ in results])
    assert all(text for text, _ in results)
    assert wait_for(lambda: tiny_engine.stats()["busy_slots"] == 0)


def assert_reproducible_equal_generate(model, requests: list[dict], texts: list[str]) -> None:
    """Each greedy or seeded request's text (ignore_eos) is what `generate` gives for it."""
    checked = [(i, r) for i, r in enumerate(requests) if r["temperature"] == 0 or "seed" in r]
    expected = generate(  # one batch: each row's result is what its prompt gives alone
        model, [r["prompt"] for _, r in checked], max(r["max_tokens"] for _, r in checked), chat=False,
        temperature=[r["temperature"] for _, r in checked], top_p=[r.get("top_p", 1.0) for _, r in checked],
        top_k=[r.get("top_k", 0) for _, r in checked], min_p=[r.get("min_p", 0.0) for _, r in checked],
        repetition_penalty=[r.get("repetition_penalty", 1.0) for _, r in checked],
        seed=[r.get("seed", 0) for _, r in checked], ignore_eos=True, return_details=True)
    for (i, request), details in zip(checked, expected):
        assert texts[i] == model.tokenizer.decode(details.tokens[:request["max_tokens"]]), request


def test_n_choices_are_the_streams_of_one_seed(tiny_chat, tiny_server):
    prompt, n = "seven quiet birds", 3
    rows = generate(tiny_chat, [prompt] * n, 10, chat=False, temperature=0.8, seed=42, ignore_eos=True)
    answer = httpx.post(f"{tiny_server}/v1/completions", timeout=120, json=dict(
        model=MODEL, prompt=prompt, n=n, max_tokens=10, temperature=0.8, seed=42, ignore_eos=True)).json()
    assert [c["text"] for c in sorted(answer["choices"], key=lambda c: c["index"])] == rows
    assert answer["usage"]["completion_tokens"] == 3 * 10


def test_logprobs_in_each_endpoints_shape(tiny_chat, tiny_server):
    details = generate(tiny_chat, "the sea", 5, chat=False, return_details=True, ignore_eos=True)
    body = dict(model=MODEL, prompt="the sea", max_tokens=5, temperature=0, ignore_eos=True, logprobs=2)
    logprobs = httpx.post(f"{tiny_server}/v1/completions", json=body, timeout=60).json()["choices"][0]["logprobs"]
    assert logprobs["token_logprobs"] == pytest.approx(details.logprobs, abs=1e-4)
    assert logprobs["tokens"] == [tiny_chat.tokenizer.decode([t], skip_special_tokens=False) for t in details.tokens]
    assert all(len(top) == 2 for top in logprobs["top_logprobs"]) and len(logprobs["text_offset"]) == 5

    chat = client(tiny_server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0, logprobs=True,
        top_logprobs=3, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(entry.top_logprobs) == 3 for entry in content)
    assert all(entry.top_logprobs[0].logprob >= entry.logprob - 1e-5 for entry in content), "greedy picks the top"


def test_tokenize_detokenize_models_health(tiny_chat, tiny_server):
    ids = httpx.post(f"{tiny_server}/tokenize", json={"prompt": "the sea"}).json()
    assert ids["tokens"] == tiny_chat.tokenizer.encode("the sea", add_special_tokens=True)
    assert ids["count"] == len(ids["tokens"]) and ids["max_model_len"] == 256
    chat = httpx.post(f"{tiny_server}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == tiny_chat.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True)
    assert httpx.post(f"{tiny_server}/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"] == "the sea"
    assert [m.id for m in client(tiny_server).models.list()] == [MODEL]
    assert httpx.get(f"{tiny_server}/health").json() == {"status": "ok"}


def test_tokenizer_info_is_the_served_tokenizer(tiny_chat, tiny_server):
    info = httpx.get(f"{tiny_server}/tokenizer_info").json()
    tokenizer = tiny_chat.tokenizer
    assert info == {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tokenizer.bos_token,
                    "eos_token": tokenizer.eos_token, "pad_token": tokenizer.pad_token,
                    "chat_template": tokenizer.chat_template, "model_max_length": 256}
    assert info["eos_token"] is not None and info["chat_template"], "SmolLM2's tokenizer has both"


def test_max_tokens_beyond_the_slot_is_clamped_to_the_room(tiny_chat, tiny_engine, tiny_server):
    """As vLLM: a prompt that fits is served, its budget clamped to the room its slot has left ("length")."""
    prompt = tiny_chat.tokenizer.encode(" ".join(WORDS * 12), add_special_tokens=True)
    room = tiny_engine.max_len - len(prompt)
    assert 0 < room < 100
    expected = generate(tiny_chat, tokens=[prompt], max_new_tokens=room, ignore_eos=True, return_details=True)[0]
    answer = client(tiny_server).completions.create(model=MODEL, prompt=prompt, max_tokens=10**6, temperature=0,
                                                    extra_body={"ignore_eos": True})
    assert answer.choices[0].finish_reason == "length"
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (len(prompt), room)
    assert answer.choices[0].text == expected.text
    for max_tokens in (10**6, None):  # the engine clamps, and its default is the same room
        served = tiny_engine.submit(tokens=prompt, max_tokens=max_tokens, ignore_eos=True).result(timeout=120)
        assert (served.tokens, served.stop_reason) == (expected.tokens, "length")


# --- errors ---------------------------------------------------------------------------------------------------

BAD_REQUESTS = [  # (path, body, status, param)
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", [1, 2], 400, None),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "stream": 1}, 400, "stream"),
    ("/v1/completions", {"prompt": " ".join(WORDS * 40)}, 400, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], []]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [10**9]}, 400, "prompt"),
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("/v1/completions", {"prompt": "hi", "n": 9}, 400, "n"),
    ("/v1/completions", {"prompt": ["a", "b", "c"], "n": 3}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"1": 500}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "suffix": "end"}, 400, "suffix"),
    ("/v1/completions", {"prompt": "hi", "best_of": 2}, 400, "best_of"),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [-3]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**64}, 400, "seed"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     400, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"},
     400, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]},
     400, "functions"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "xml"}}, 400, "response_format.type"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "frequency_penalty": -3},
     400, "frequency_penalty"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/completions", {"prompt": "a lone \ud800"}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "model": "\ud800"}, 404, "model"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\udfff"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": [2**70]}, 400, "tokens"),
    ("/tokenize", {}, 400, "prompt"),
    ("/nowhere", {}, 404, None),
]


@pytest.mark.parametrize("path, body, status, param", BAD_REQUESTS)
def test_bad_requests_get_openai_errors_naming_the_field(tiny_server, path, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body)
    response = httpx.post(f"{tiny_server}{path}", content=content, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param, error


UNCLEAR_BEFORE = [  # (path, body, param, words of the message): each message names the field and what was expected
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, "messages[0].content",
     "expected a string or a list of text parts"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "tool_calls": [{"id": "1", "type": "function"}]},
                                           {"role": "user", "content": "x"}]},
     "messages[0].content", "null or missing"),
    ("/tokenize", {"messages": [{"role": "user"}]}, "messages[0].content", "expected a string"),
    ("/v1/completions", {"prompt": "hi", "top_k": 2**40}, "top_k", "top_k must be in [-2147483648, 2147483647]"),
    ("/v1/completions", {"prompt": [[]]}, "prompt", "prompt[0] is an empty list of ids; expected at least one id"),
    ("/v1/completions", {"prompt": "hi", "stop": ""}, "stop", "stop must be a non-empty string"),
    ("/v1/completions", {"prompt": "hi", "stop": ["."] * 17}, "stop", "stop holds 17 strings; at most 16"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stop": "y" * 257}, "stop",
     "a stop string holds 257 characters; at most 256"),
    # issue 44: json false is a wrong schema, not a missing json; ids past 64 bits and logit_bias keys that are
    # not an id's canonical decimal string (past int()'s 4300 digits, spaced, full-width, zero-led) are named
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"json": False}}, "structured_outputs",
     "json must be a JSON schema: an object, the JSON text of one, or true"),
    ("/v1/completions", {"prompt": [2**64]}, "prompt", f"holds id {2**64} outside the vocabulary [0, "),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"1" * 4400: 5}}, "logit_bias",
     "logit_bias keys must be token ids in [0, "),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {" 5": 5}}, "logit_bias", "leading zero), got ' 5'"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"１２": 5}}, "logit_bias", "leading zero), got '１２'"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 100, "05": -100}}, "logit_bias",
     "leading zero), got '05'"),
]


@pytest.mark.parametrize("path, body, param, words", UNCLEAR_BEFORE)
def test_refusals_name_the_field_and_what_was_expected(tiny_server, path, body, param, words):
    response = httpx.post(f"{tiny_server}{path}", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_max_completion_tokens_is_the_budget_when_given(tiny_server):
    """OpenAI's newer name wins over max_tokens (as vLLM has it): a max_tokens of 0 beside it is not an error."""
    body = dict(prompt="the sea", max_tokens=0, max_completion_tokens=2, ignore_eos=True, temperature=0)
    response = httpx.post(f"{tiny_server}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2


def test_user_neutral_values_and_unknown_fields_are_accepted(tiny_server):
    body = dict(model=MODEL, prompt="hi", max_completion_tokens=2, user="someone", presence_penalty=0, best_of=1,
                response_format={"type": "text"}, some_vendor_field={"x": 1}, top_k=-1, ignore_eos=True)
    response = httpx.post(f"{tiny_server}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2


def test_stop_strings_and_stop_ids_end_choices_as_generate_does(tiny_chat, tiny_server):
    whole = generate(tiny_chat, "the sea", 12, chat=False, ignore_eos=True, return_details=True)
    stop = whole.text[len(whole.text) // 2:][:3]
    expected = generate(tiny_chat, "the sea", 12, chat=False, ignore_eos=True, stop=[stop])
    api = client(tiny_server)
    cut = api.completions.create(model=MODEL, prompt="the sea", max_tokens=12, temperature=0, stop=[stop],
                                 extra_body={"ignore_eos": True})
    assert (cut.choices[0].text, cut.choices[0].finish_reason) == (expected, "stop")
    # the stop id: the first new token after the first that has not come before (a random model may repeat one)
    first = next(i for i, token in enumerate(whole.tokens) if i > 0 and token not in whole.tokens[:i])
    by_id = api.completions.create(model=MODEL, prompt="the sea", max_tokens=12, temperature=0,
                                   extra_body={"ignore_eos": True, "stop_token_ids": [whole.tokens[first]]})
    assert by_id.choices[0].finish_reason == "stop" and by_id.usage.completion_tokens == first
    assert by_id.choices[0].text == generate(tiny_chat, "the sea", 12, chat=False, ignore_eos=True,
                                             stop_token_ids=[whole.tokens[first]])


def test_field_path_drops_union_member_tags():
    assert field_path(["messages", 0, "content", "str"]) == "messages[0].content"
    assert field_path(["prompt", "list[int]", 0]) == "prompt"
    assert field_path([]) is None


# --- the fuzz -------------------------------------------------------------------------------------------------

def json_containers(inner: st.SearchStrategy) -> st.SearchStrategy:
    return st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
                           | st.text(max_size=8), json_containers, max_leaves=6)
FIELDS = {
    "prompt": st.text(max_size=30) | st.sampled_from(["\ud800", "<|im_start|>", "", " " * 300])
    | st.lists(st.integers(-5, 60000), max_size=5) | st.lists(st.text(max_size=8), max_size=3),
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
                                                "content": st.text(max_size=20) | JSON_VALUES}), max_size=3),
    "max_tokens": st.integers(-3, 300) | JSON_VALUES, "temperature": st.floats(-1, 3) | JSON_VALUES,
    "top_p": st.floats(-0.5, 1.5), "top_k": st.integers(-2, 100), "min_p": st.floats(-0.1, 1.1),
    "repetition_penalty": st.floats(-1, 3), "seed": st.integers(-2**64, 2**64), "n": st.integers(-1, 10),
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=3), "logprobs": st.integers(-1, 25) |
    st.booleans(), "top_logprobs": st.integers(-1, 25), "stream": st.booleans(), "ignore_eos": st.booleans(),
    "stop_token_ids": st.lists(st.integers(-2, 60000), max_size=3), "model": st.sampled_from([MODEL, "other"]),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}), "presence_penalty": st.floats(-2, 2),
    "tokens": st.lists(st.integers(-5, 60000), max_size=5), "user": JSON_VALUES, "anything": JSON_VALUES,
}
BODIES = st.dictionaries(st.sampled_from(sorted(FIELDS)), st.none(), max_size=8).flatmap(
    lambda keys: st.fixed_dictionaries({key: FIELDS[key] for key in keys}))
PATHS = st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])


@settings(max_examples=100, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(path=PATHS, body=BODIES | JSON_VALUES, raw=st.booleans())
def test_fuzz_never_gets_a_5xx(tiny_server, path, body, raw):
    content = json.dumps(body)[:-1] if raw else json.dumps(body)  # raw: cut off, not JSON
    response = httpx.post(f"{tiny_server}{path}", content=content, timeout=120,
                          headers={"content-type": "application/json"})
    assert response.status_code < 500, (response.status_code, response.text)
    if response.status_code >= 400:
        assert response.json()["error"]["message"]
    assert httpx.get(f"{tiny_server}/health").status_code == 200


def test_still_serving_after_the_fuzz(tiny_server):
    answer = client(tiny_server).completions.create(model=MODEL, prompt="the sea", max_tokens=3, temperature=0)
    assert answer.choices[0].finish_reason in ("length", "stop")


SIZES = st.sampled_from([0, 1, 16, 256, 257, 4_000, 200_000, 1_200_000])  # 1 MiB is the default body limit
SIZED_FIELDS = {  # sizes in characters, ids or list items
    "prompt": SIZES.map(lambda n: "sea " * (n // 4)) | SIZES.map(lambda n: [7] * n)
    | SIZES.map(lambda n: [[7, 8]] * (n // 8)) | SIZES.map(lambda n: ["sea"] * (n // 4)),
    "messages": SIZES.map(lambda n: [{"role": "user", "content": "sea " * (n // 4)}])
    | SIZES.map(lambda n: [{"role": "user", "content": "hi"}] * (n // 16)),
    "stop": SIZES.map(lambda n: "z" * n) | SIZES.map(lambda n: ["z"] * (n // 16)),
    "stop_token_ids": SIZES.map(lambda n: [5] * (n // 8)), "tokens": SIZES.map(lambda n: [9] * (n // 8)),
    "max_tokens": st.integers(1, 8), "top_k": st.integers(-1, 2**70), "seed": st.integers(-2**70, 2**70),
    "anything": SIZES.map(lambda n: {"x": "y" * n}),
}
SIZED_BODIES = st.dictionaries(st.sampled_from(sorted(FIELDS | SIZED_FIELDS)), st.none(), max_size=6).flatmap(
    lambda keys: st.fixed_dictionaries({key: (FIELDS | SIZED_FIELDS)[key] for key in keys}))


def health_while(url: str, action) -> tuple[object, float]:
    """Run action() in a thread; meanwhile ask /health again and again (each must be a 200): action's result, and
    the longest /health took, in seconds."""
    outcome, slowest = [], 0.0
    thread = threading.Thread(target=lambda: outcome.append(action()))
    thread.start()
    while thread.is_alive():
        start = time.monotonic()
        assert httpx.get(f"{url}/health", timeout=60).status_code == 200
        slowest = max(slowest, time.monotonic() - start)
        time.sleep(0.02)
    thread.join()
    assert outcome, "the request raised"
    return outcome[0], slowest


def greedy_text(url: str) -> str:
    body = dict(model=MODEL, prompt="the sea", max_tokens=12, temperature=0, ignore_eos=True)
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]


def test_fuzz_of_bodies_fields_and_sizes_keeps_health_fast_and_the_text_the_same(tiny_chat, tiny_server):
    """No 5xx; /health answers within 1 s (generous: the machine may be loaded) while each request is processed;
    the same greedy text, generate()'s, before and after."""
    expected = generate(tiny_chat, "the sea", 12, chat=False, ignore_eos=True)
    assert greedy_text(tiny_server) == expected

    @settings(max_examples=60, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(path=PATHS, body=SIZED_BODIES, stream=st.booleans())
    def one_request(path, body, stream):
        content = json.dumps({"max_tokens": 4} | body | ({"stream": True} if stream else {}))
        response, slowest = health_while(tiny_server, lambda: httpx.post(
            f"{tiny_server}{path}", content=content, timeout=120, headers={"content-type": "application/json"}))
        assert response.status_code < 500, (response.status_code, response.text[:500])
        assert slowest < 1.0, f"/health took {slowest:.2f} s while {path} was processed"

    one_request()
    assert greedy_text(tiny_server) == expected


def test_a_huge_body_is_413_and_a_long_prompt_400_while_health_answers(tiny_server):
    prompt = "the sea " * 1_250_000  # 10 MB
    response, slowest = health_while(tiny_server, lambda: httpx.post(
        f"{tiny_server}/v1/completions", json={"prompt": prompt}, timeout=120))
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large", response.text
    assert "at most 1048576" in response.json()["error"]["message"] and slowest < 1.0
    response, slowest = health_while(tiny_server, lambda: httpx.post(  # under the limit, 200000 tokens
        f"{tiny_server}/v1/completions", json={"prompt": prompt[:800_000]}, timeout=120))
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt", response.text
    assert "max_len=256" in response.json()["error"]["message"] and slowest < 1.0


def test_max_request_bytes_is_the_body_limit(tiny_engine):
    with serving(tiny_engine, max_request_bytes=100) as url:
        small, large = {"prompt": "hi", "max_tokens": 1}, {"prompt": "hi " * 40, "max_tokens": 1}
        assert httpx.post(f"{url}/v1/completions", json=small, timeout=60).status_code == 200
        response = httpx.post(f"{url}/v1/completions", json=large, timeout=60)
        assert response.status_code == 413, response.text
        assert "at most 100 (--max-request-bytes)" in response.json()["error"]["message"]


# --- a failing engine ----------------------------------------------------------------------------------------

def failing_step(gate: threading.Event):
    """A stand-in for Engine._step (one dispatch) that runs out of memory once `gate` is set."""
    def step(inputs: dict):
        gate.wait(60)
        raise MemoryError("RESOURCE_EXHAUSTED: out of memory (simulated)")
    return step


def test_a_failing_engine_fails_its_requests_with_a_5xx_and_health_turns_503(tiny_chat):
    gate = threading.Event()
    with Engine(tiny_chat, slots=2, max_len=64) as engine, serving(engine) as url:
        engine._step = failing_step(gate)
        body = dict(prompt="the sea", max_tokens=20, ignore_eos=True)
        whole, streamed = [], []

        def stream():
            with httpx.stream("POST", f"{url}/v1/completions", json=body | {"stream": True}, timeout=60) as response:
                streamed.extend(line for line in response.iter_lines() if line)

        threads = [threading.Thread(target=lambda: whole.append(httpx.post(f"{url}/v1/completions", json=body,
                                                                           timeout=60))),
                   threading.Thread(target=stream)]
        for thread in threads:
            thread.start()
        assert wait_for(lambda: engine.stats()["running"] + engine.stats()["queued"] == 2, 60), "both are in"
        gate.set()
        for thread in threads:
            thread.join(60)
        assert whole[0].status_code == 500, whole[0].text
        error = whole[0].json()["error"]
        assert error["code"] == "engine_failed" and "MemoryError: RESOURCE_EXHAUSTED" in error["message"]
        assert json.loads(streamed[-1].removeprefix("data: "))["error"]["code"] == "engine_failed", streamed
        assert httpx.get(f"{url}/health").status_code == 503
        later = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert later.status_code == 503 and later.json()["error"]["code"] == "engine_failed"


def test_serve_returns_with_engine_failed_when_the_engine_fails(tiny_chat):
    gate, raised = threading.Event(), []
    gate.set()
    engine = Engine(tiny_chat, slots=1, max_len=64)
    engine._step = failing_step(gate)
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()

    def run():
        try:
            serve(create_app(engine, model_name=MODEL), engine, host="127.0.0.1", port=port, deadline=1)
        except EngineFailed as error:
            raised.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    assert wait_for(lambda: reachable(url), 60), "the server did not come up"
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=60).status_code == 500
    thread.join(60)
    assert not thread.is_alive() and "MemoryError" in str(raised[0])


def test_an_engine_failing_at_warm_up_exits_1_with_one_line(tiny_chat_dir, monkeypatch, capsys):
    def out_of_memory(engine):
        raise MemoryError("RESOURCE_EXHAUSTED: out of memory while trying to allocate 48.00GiB (simulated)")

    monkeypatch.setattr(Engine, "_compile_all", out_of_memory)
    monkeypatch.setattr(linnet_jax.serve.app, "serve", lambda *a, **k: pytest.fail("served a dead engine"))
    assert main(["serve", "--model", str(tiny_chat_dir), "--slots", "1", "--port", "0",
                 "--no-compilation-cache"]) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == ("linnet-jax serve: error: the engine failed: MemoryError: RESOURCE_EXHAUSTED: out of memory "
                    "while trying to allocate 48.00GiB (simulated)")


# --- cancellation, queue, keys --------------------------------------------------------------------------------

LONG = dict(model=MODEL, prompt="the sea", max_tokens=240, ignore_eos=True, temperature=0)
UNNAMED = {key: value for key, value in LONG.items() if key != "model"}  # any model name is the served one


def test_disconnect_mid_stream_frees_the_slot(tiny_server):
    before = metric(tiny_server, "linnet_jax_generated_tokens_total")
    with httpx.stream("POST", f"{tiny_server}/v1/completions", json=LONG | {"stream": True}, timeout=60) as response:
        first = next(response.iter_lines())
        assert first.startswith("data: ")
        assert metric(tiny_server, "linnet_jax_busy_slots") >= 0
    assert wait_for(lambda: metric(tiny_server, "linnet_jax_busy_slots") == 0, 5)
    assert metric(tiny_server, "linnet_jax_generated_tokens_total") - before < 240, "cancelled, not run to the end"


def test_cancelled_non_streamed_request_frees_the_slot(tiny_server):
    before = metric(tiny_server, "linnet_jax_generated_tokens_total")
    finished = metric(tiny_server, "linnet_jax_requests_finished_total")
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{tiny_server}/v1/completions", json=LONG, timeout=httpx.Timeout(5, read=0.05))
    assert wait_for(lambda: metric(tiny_server, "linnet_jax_requests_finished_total") == finished + 1, 5)
    assert metric(tiny_server, "linnet_jax_busy_slots") == 0
    assert metric(tiny_server, "linnet_jax_generated_tokens_total") - before < 240, "cancelled, not run to the end"


def test_metrics_report_the_engine(tiny_server):
    text = httpx.get(f"{tiny_server}/metrics").text
    for name in ("linnet_jax_requests_running", "linnet_jax_requests_queued", "linnet_jax_busy_slots",
                 "linnet_jax_generated_tokens_total", "linnet_jax_time_to_first_token_seconds_bucket",
                 "linnet_jax_time_per_output_token_seconds_count"):
        assert name in text
    assert metric(tiny_server, "linnet_jax_time_to_first_token_seconds_count") > 0
    assert metric(tiny_server, "linnet_jax_kv_cache_pages") == 8 * 4  # 8 slots of 256 positions, pages of 64
    assert 0 <= metric(tiny_server, "linnet_jax_kv_cache_pages_held") <= 32


def test_metrics_count_prefix_cache_hits(tiny_chat, tiny_server):
    system = "You are a careful assistant who answers in one short sentence. " * 8
    before = [metric(tiny_server, f"linnet_jax_prefix_cache_{kind}_tokens_total") for kind in ("hit", "lookup")]
    for question in ("What is a cat?", "What is a dog?"):
        body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
                "max_tokens": 2}
        assert httpx.post(f"{tiny_server}/v1/chat/completions", json=body).status_code == 200
    hit, lookup = (metric(tiny_server, f"linnet_jax_prefix_cache_{kind}_tokens_total") - b
                   for kind, b in zip(("hit", "lookup"), before))
    assert lookup > 2 * 64 and hit >= 64  # the second conversation found the shared system prompt's blocks


def test_queue_full_is_429_with_retry_after(tiny_chat):
    with Engine(tiny_chat, slots=1, max_len=64, max_queue=1) as engine, serving(engine) as url:
        running = engine.submit(tokens=[1, 2, 3], max_tokens=60, ignore_eos=True)
        assert wait_for(lambda: engine.stats()["busy_slots"] == 1 or running.done)
        queued = engine.submit(tokens=[1, 2, 3], max_tokens=60, ignore_eos=True)
        response = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        if not queued.done:  # the queued one did not run out of the queue meanwhile
            assert response.status_code == 429, response.text
            assert response.headers["retry-after"] == "1" and response.json()["error"]["code"] == "queue_full"
        for handle in (queued, running):
            handle.cancel()
            assert handle.result(timeout=30).stop_reason in ("cancelled", "length")
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_an_empty_api_key_is_refused(tiny_engine):
    for key in ("", " ", " s3cret"):
        with pytest.raises(ValueError, match="api_key must be a non-empty string without surrounding whitespace"):
            create_app(tiny_engine, model_name=MODEL, api_key=key)


def test_api_key_is_needed_everywhere_but_health(tiny_engine):
    with serving(tiny_engine, api_key="s3cret") as url:
        assert httpx.get(f"{url}/health").status_code == 200
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"}):
            response = httpx.get(f"{url}/v1/models", headers=headers)
            assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "hi"}).status_code == 401
        assert httpx.get(f"{url}/metrics").status_code == 401
        assert httpx.get(f"{url}/tokenizer_info").status_code == 401
        with pytest.raises(openai.AuthenticationError):
            client(url, "wrong").models.list()
        assert [m.id for m in client(url, "s3cret").models.list()] == [MODEL]


# --- the command ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("flags", [["--slots", "0"], ["--port", "70000"], ["--max-len", "x"], ["--max-len", "1"],
                                   ["--shutdown-deadline", "-1"], ["--shutdown-deadline", "inf"],
                                   ["--speculative-config", "{"], ["--speculative-config", '{"method": "eagle"}'],
                                   ["--prefill-chunk", "0"], ["--api-key", ""], ["--host", "192.0.2.1"],
                                   ["--max-request-bytes", "0"], ["--kv-cache-gb", "0"],
                                   ["--kv-cache-gb", "nan"], ["--page-size", "0"], ["--prefill-batch", "4"]])
def test_serve_flags_are_refused_before_loading(monkeypatch, capsys, flags):
    assert flags[0] in refused_flags(monkeypatch, capsys, *flags)


def test_serve_flags_become_the_engines_keywords():
    """What serve's engine flags give `Engine`: the pool's pages and size, chunks and steps, the prefix cache off,
    the speculative config as given."""
    config = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    flags = ["serve", "--page-size", "16", "--kv-cache-gb", "0.5", "--prefill-chunk", "64", "--max-step-tokens", "96",
             "--speculative-config", json.dumps(config)]
    keys = ("page_size", "kv_cache_gb", "prefill_chunk", "max_step_tokens", "prefix_cache", "speculative", "max_len")
    options = engine_options(parser().parse_args(flags))
    assert {key: options[key] for key in keys} == {
        "page_size": 16, "kv_cache_gb": 0.5, "prefill_chunk": 64, "max_step_tokens": 96, "prefix_cache": True,
        "speculative": config, "max_len": None}
    assert engine_options(parser().parse_args(["serve", "--no-prefix-cache"]))["prefix_cache"] is False
    defaults = engine_options(parser().parse_args(["serve"]))
    assert {key: defaults[key] for key in keys} == {
        "page_size": 64, "kv_cache_gb": None, "prefill_chunk": 256, "max_step_tokens": None, "prefix_cache": True,
        "speculative": None, "max_len": None}


def refused_flags(monkeypatch, capsys, *flags: str) -> str:
    """What `linnet-jax serve --model /nowhere FLAGS` says on stderr as it exits 2, without loading any model."""
    monkeypatch.setattr(linnet_jax, "load", lambda *a, **k: pytest.fail("loaded the model"))
    with pytest.raises(SystemExit) as exit:
        main(["serve", "--model", "/nowhere", *flags])
    assert exit.value.code == 2
    return capsys.readouterr().err


def test_default_max_len_is_the_model_context_when_shorter(tiny_chat_dir, tmp_path, monkeypatch):
    short = tmp_path / "short"
    shutil.copytree(tiny_chat_dir, short)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 128}))
    served = []

    def serve_nothing(app, engine, **options):
        served.append(engine.max_len)
        engine.close()

    monkeypatch.setattr(linnet_jax.serve.app, "serve", serve_nothing)
    assert main(["serve", "--model", str(short), "--slots", "1", "--prefill-chunk", "16",
                 "--port", "0", "--no-compilation-cache"]) == 0
    assert served == [128]


def start_server(model_dir, *flags: str) -> tuple[subprocess.Popen, str]:
    """`linnet-jax serve` on a free port (one slot of 4096 positions; flags may override), up and answering: the
    process and its URL."""
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()
    server = subprocess.Popen(
        [sys.executable, "-m", "linnet_jax", "serve", "--model", str(model_dir), "--port", str(port), "--slots", "1",
         "--max-len", "4096", "--prefill-chunk", "16", "--no-compilation-cache", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    if not wait_for(lambda: server.poll() is not None or reachable(url), 180) or server.poll() is not None:
        server.kill()
        raise AssertionError(f"the server did not come up: {server.communicate()[0]}")
    return server, url


def test_signals_in_quick_succession_always_end_the_server(tiny_chat_dir):
    """Signals a few microseconds apart, from the first (some land while the first one's handler runs): the process
    exits, never half-dead or frozen."""
    server, url = start_server(tiny_chat_dir, "--shutdown-deadline", "300")
    try:
        for i in range(40):  # SIGTERM and SIGINT by turns, about 30 µs apart (a busy wait: sleep is coarser)
            os.kill(server.pid, (signal.SIGTERM, signal.SIGINT)[i % 2])
            end = time.perf_counter() + 3e-5
            while time.perf_counter() < end:
                pass
        assert server.wait(60) == 0, server.stdout.read()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_a_draining_server_answers_503_and_a_second_signal_cuts_the_drain_short(tiny_chat_dir):
    server, url = start_server(tiny_chat_dir, "--shutdown-deadline", "300")
    try:
        lines, streaming = [], threading.Event()

        def stream():
            with httpx.stream("POST", f"{url}/v1/completions", json=UNNAMED | {"max_tokens": 4000, "stream": True},
                              timeout=120) as response:
                for line in filter(None, response.iter_lines()):
                    lines.append(line)
                    streaming.set()

        thread = threading.Thread(target=stream)
        thread.start()
        assert streaming.wait(60), "the request is streaming"
        server.send_signal(signal.SIGTERM)
        assert wait_for(lambda: httpx.get(f"{url}/health").status_code == 503, 30), "/health turns 503"
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down", refused.text
        assert thread.is_alive(), "the running request is given its deadline"
        server.send_signal(signal.SIGINT)
        assert server.wait(60) == 0, server.stdout.read()  # well within the 300 s deadline
        thread.join(30)
        finishes = [json.loads(line.removeprefix("data: "))["choices"][0]["finish_reason"]
                    for line in lines if line.startswith("data: {")]
        assert finishes[-1] == "abort" and lines[-1] == "data: [DONE]"
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_sigterm_with_requests_in_flight_exits_cleanly(tiny_chat_dir):
    server, url = start_server(tiny_chat_dir, "--slots", "2", "--shutdown-deadline", "1")
    try:
        outcomes, streaming = [], threading.Semaphore(0)

        def stream():
            with httpx.stream("POST", f"{url}/v1/completions", json=UNNAMED | {"max_tokens": 4000, "stream": True},
                              timeout=60) as response:
                lines = response.iter_lines()
                outcomes.append([next(lines)])
                streaming.release()
                outcomes[-1] += [line for line in lines if line]

        # two run, one waits in the queue; 4000 steps each outlast the 1 s deadline even on a fast machine
        threads = [threading.Thread(target=stream) for _ in range(3)]
        for thread in threads:
            thread.start()
        assert streaming.acquire(timeout=60) and streaming.acquire(timeout=60), "two requests are streaming"
        assert wait_for(lambda: metric(url, "linnet_jax_requests_queued") == 1, 60), "the third one is queued"
        server.send_signal(signal.SIGTERM)
        assert server.wait(60) == 0, server.stdout.read()
        for thread in threads:
            thread.join(30)
        assert len(outcomes) == 3 and all(lines[-1] == "data: [DONE]" for lines in outcomes)
        finishes = [json.loads(lines[-2].removeprefix("data: "))["choices"][0]["finish_reason"] for lines in outcomes]
        assert "abort" in finishes, "the deadline cancelled what was still running"
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    with pytest.raises(ProcessLookupError):
        os.killpg(server.pid, 0)  # no process of its group is left


def reachable(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
