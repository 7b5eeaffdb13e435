"""linnet_jax.serve.Engine: results equal generate's, a warm engine compiles nothing, cancel, queue limit, n, sharded."""

import asyncio
import time

import numpy as np
import pytest
from test_export_xla import eight_devices, run_python

import linnet_jax
from linnet_jax import generate
from linnet_jax.inputs import RequestError
from linnet_jax.serve import Engine, QueueFull


def mixed_requests(vocab: int, count: int) -> list[dict]:
    """Mixed prompt lengths, budgets and sampling settings; every other one sampled with its own seed."""
    rng = np.random.default_rng(12)
    requests = []
    for i in range(count):
        sampled = dict(temperature=0.9, top_p=0.9, top_k=30) if i % 2 else {}
        requests.append(dict(tokens=rng.integers(3, vocab, int(rng.integers(2, 50))).tolist(),
                             max_tokens=int(rng.integers(1, 14)), seed=int(rng.integers(0, 2**62)), ignore_eos=True,
                             **sampled))
    return requests


def alone(model, request: dict):
    options = {k: v for k, v in request.items() if k not in ("tokens", "max_tokens")}
    return generate(model, tokens=[request["tokens"]], max_new_tokens=request["max_tokens"], return_details=True,
                    **options)[0]


def test_engine_equals_generate_and_compiles_nothing_once_warm(tiny_dir):
    model = linnet_jax.load(tiny_dir("llama_gqa_llama3")[1], progress=False)
    requests = mixed_requests(model.config.vocab_size, 16)
    expected = [alone(model, r) for r in requests]
    with Engine(model, slots=4, max_len=64) as engine:
        engine.warmup()
        assert engine.compiles_after_warmup == 0
        handles = [engine.submit(**r) for r in requests]
        for handle, want in zip(handles, expected):
            got = handle.result(timeout=300)
            assert got.tokens == want.tokens and got.stop_reason == want.stop_reason
            assert np.abs(np.array(got.logprobs) - want.logprobs).max() < 1e-5
        assert engine.compiles_after_warmup == 0
        assert engine.stats()["tokens_generated"] >= sum(r["max_tokens"] for r in requests)
        assert engine.stats()["busy_slots"] == 0


def test_choices_are_the_rows_of_one_seed(tiny_dir):
    model = linnet_jax.load(tiny_dir("llama_mha")[1], progress=False)
    prompt, options = [7, 8, 9], dict(temperature=1.0, seed=41, ignore_eos=True)
    rows = generate(model, tokens=[prompt] * 3, max_new_tokens=10, **options)
    with Engine(model, slots=2, max_len=32) as engine:
        handles = [engine.submit(tokens=prompt, max_tokens=10, choice=i, **options) for i in range(3)]
        assert [h.result(timeout=300).tokens for h in handles] == rows
        start = time.monotonic()  # a choice's key alone is made (10**5 of them took half a minute)
        engine.submit(tokens=prompt, max_tokens=1, choice=10**5, **options).result(timeout=300)
        assert time.monotonic() - start < 10
        with pytest.raises(RequestError, match=r"choice must be an int in \[0, 2\*\*32\)"):
            engine.submit(tokens=prompt, choice=2**32)


def test_streams_sync_and_async_and_cancel(tiny_dir):
    model = linnet_jax.load(tiny_dir("llama_mha")[1], progress=False)
    with Engine(model, slots=2, max_len=64) as engine:
        handle = engine.submit(tokens=[3, 4, 5], max_tokens=40, ignore_eos=True, top_logprobs=2)
        pieces = list(handle)  # a piece holds what came since the last: on a loaded machine, several dispatches
        assert sum((p.tokens for p in pieces), []) == handle.result().tokens and len(pieces) > 1
        assert all(len(top) == 2 and top[0][1] >= top[1][1] for p in pieces for top in p.top_logprobs)

        async def collect():
            return [piece async for piece in engine.submit(tokens=[3, 4, 5], max_tokens=40, ignore_eos=True)]

        assert sum((p.tokens for p in asyncio.run(collect())), []) == handle.result().tokens
        long = engine.submit(tokens=[3, 4, 5], max_tokens=60, ignore_eos=True)
        next(iter(long))
        long.cancel()
        assert long.result(timeout=60).stop_reason == "cancelled" and len(long.result().tokens) < 60
        assert engine.stats()["busy_slots"] == 0


def test_queue_limit_and_bad_requests(tiny_dir):
    model = linnet_jax.load(tiny_dir("llama_mha")[1], progress=False)
    with Engine(model, slots=1, max_len=64, max_queue=2) as engine:
        with pytest.raises(QueueFull, match="max_queue=2"):
            for _ in range(4):
                engine.submit(tokens=[3, 4], max_tokens=50, ignore_eos=True)
        with pytest.raises(ValueError, match="max_len=64"):
            engine.submit(tokens=[3] * 64)
        with pytest.raises(ValueError, match="top_logprobs must be"):
            engine.submit(tokens=[3], top_logprobs=21)
        with pytest.raises(RequestError, match=r"tokens is an empty list; expected"):
            engine.submit(tokens=[])
        for options, field in ((dict(max_tokens=0), "max_tokens"), (dict(temperature=-1), "temperature"),
                               (dict(stop=[""]), "stop"), (dict(stop_token_ids=[10**6]), "stop_token_ids")):
            with pytest.raises(RequestError) as refused:
                engine.submit(tokens=[3] * 40, **options)
            assert refused.value.field == field
    with pytest.raises(ValueError, match="slots must be a positive int"):
        Engine(model, slots=0)
    for size in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="kv_cache_gb must be a finite number > 0"):
            Engine(model, kv_cache_gb=size)
    with pytest.raises(ValueError, match="fewer than one request of max_len=64 needs"):
        Engine(model, max_len=64, kv_cache_gb=1e-6)


def test_stop_strings_as_generate(smollm2):
    prompt = [{"role": "user", "content": "List the numbers from one to ten, in words."}]
    full = generate(smollm2, prompt, max_new_tokens=24)
    word = full.split()[3].strip(",.")
    want = generate(smollm2, prompt, max_new_tokens=24, stop=[word], return_details=True)
    with Engine(smollm2, slots=2, max_len=128) as engine:
        got = engine.submit(prompt, max_tokens=24, stop=[word]).result(timeout=300)
    assert (got.text, got.tokens, got.stop_reason) == (want.text, want.tokens, want.stop_reason) and word not in got.text


@pytest.mark.parametrize("mesh", ["data=8", "data=2, tensor=2"])
def test_engine_on_a_sharded_model(shardable_dir, tmp_path, mesh):
    run_python(f"""
import jax, numpy as np, linnet_jax
from linnet_jax import sharding
from linnet_jax.serve import Engine
assert jax.device_count() == 8
plain = linnet_jax.load({str(shardable_dir)!r}, progress=False)
model = linnet_jax.load({str(shardable_dir)!r}, mesh=sharding.mesh({mesh}), progress=False)
rng = np.random.default_rng(0)
prompts = [rng.integers(3, plain.config.vocab_size, int(rng.integers(2, 180))).tolist() for _ in range(10)]
want = [linnet_jax.generate(plain, tokens=[p], max_new_tokens=8, ignore_eos=True)[0] for p in prompts]
assert model.plan.key_block == 128  # later chunks of 16 read 128 or all 192 slots of the sharded cache
with Engine(model, slots=8, max_len=192, prefill_chunk=16) as engine:
    got = [h.result(timeout=300).tokens for h in [engine.submit(tokens=p, max_tokens=8, ignore_eos=True) for p in prompts]]
assert got == want, (got, want)
""", tmp_path, eight_devices())
