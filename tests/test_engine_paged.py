"""Engine v3 (a paged KV cache, one token-packed step): chunked prefill, the prefix cache as shared pages, n-gram
speculation and all of them together each give what `generate` gives alone, request for request (greedy and
seeded); a long prompt's chunks ride in the decoding requests' steps; a burst sharing a system prompt computes it
once; a workload larger than the pool completes; attention reads the pages in use, not max_len's;
generate(speculative=...) gives the tokens of generate without it."""

import dataclasses
import importlib

import jax
import numpy as np
import pytest
from test_engine import alone

import linnet_jax
from linnet_jax import generate, train
from linnet_jax.inputs import RequestError
from linnet_jax.serve import Engine
from linnet_jax.serve.engine import page_bytes
from linnet_jax.speculative import Ngram, propose

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
FEATURES = {
    "chunked prefill": dict(prefill_chunk=16, max_step_tokens=48, prefix_cache=False),
    "prefix cache": dict(page_size=16),
    "speculative": dict(speculative=NGRAM, prefix_cache=False),
    "all of them, on adapters too": dict(prefill_chunk=16, page_size=16, speculative=NGRAM, loras={}),
}


@pytest.fixture(scope="module")
def model(tiny_dir):
    return linnet_jax.load(tiny_dir("llama_gqa_llama3")[1], progress=False)


def random_adapters(model) -> dict:
    """Two random rank-4 adapters (B not zero, so each changes the model's tokens), by name."""
    adapters = {}
    for seed in (1, 2):
        lora = train.init_lora(model.config, train.LoraConfig(rank=4, alpha=8.0), jax.random.key(seed))
        adapters[f"adapter{seed}"] = dataclasses.replace(
            lora, b={name: 0.05 * jax.random.normal(jax.random.key(seed + 9), b.shape) for name, b in lora.b.items()})
    return adapters


def shared_prefix_requests(vocab: int, count: int) -> list[dict]:
    """Prompts of 2-100 ids, most starting with one of three shared prefixes (a system prompt, an earlier turn)
    and some repeating a pattern (which n-gram drafts find); budgets of 1-14; every other one sampled."""
    rng = np.random.default_rng(5)
    prefixes = [rng.integers(3, vocab, n).tolist() for n in (32, 40, 64)]
    requests = []
    for i in range(count):
        tail = rng.integers(3, vocab, int(rng.integers(1, 36))).tolist()
        if i % 5 == 4:
            tail = (tail[:4] * 6)[:int(rng.integers(8, 24))]
        prompt = (prefixes[i % 4] if i % 4 < 3 else []) + tail
        sampled = dict(temperature=0.9, top_p=0.9, top_k=30) if i % 2 else {}
        requests.append(dict(tokens=prompt, max_tokens=int(rng.integers(1, 15)), seed=int(rng.integers(0, 2**62)),
                             ignore_eos=True, **sampled))
    return requests


def served(model, requests: list[dict], **options) -> tuple[list, Engine]:
    """Every request submitted at once to an engine of 8 slots of 128; their Generations, and the engine."""
    with Engine(model, slots=8, max_len=128, **options) as engine:
        engine.warmup()
        with engine._wake:  # the engine takes them together, however loaded the machine
            handles = [engine.submit(**request) for request in requests]
        results = [handle.result(timeout=300) for handle in handles]
        assert engine.compiles_after_warmup == 0
    return results, engine


def assert_same(got, expected) -> None:
    for i, (g, want) in enumerate(zip(got, expected)):
        assert (g.tokens, g.stop_reason) == (want.tokens, want.stop_reason), f"request {i}"
        assert np.abs(np.array(g.logprobs) - want.logprobs).max(initial=0) < 1e-4, f"request {i}"


def pool_gb(model, pages: int, page_size: int) -> float:
    """kv_cache_gb for a pool of `pages` pages."""
    return (pages + 0.5) * page_bytes(model, page_size) / 2**30


@pytest.mark.parametrize("feature", FEATURES)
def test_each_feature_equals_generate_request_for_request(model, feature):
    """32 mixed requests through 8 slots, all submitted at once (with adapters: a third on each of two adapters,
    against generate with that adapter)."""
    requests, options = shared_prefix_requests(model.config.vocab_size, 32), dict(FEATURES[feature])
    expected = [alone(model, r) for r in requests]
    if "loras" in options:
        options["loras"] = adapters = random_adapters(model)
        for i, request in enumerate(requests):
            if i % 3:
                request["lora"] = f"adapter{i % 3}"
                expected[i] = alone(model, {**request, "lora": adapters[request["lora"]]})
    results, engine = served(model, requests, **options)
    assert_same(results, expected)
    steps = list(engine.step_log)
    assert max(step.tokens for step in steps) <= engine.max_step_tokens
    assert max(step.decoding + step.prefilling for step in steps) <= 8
    assert any(step.decoding and step.prefilling for step in steps)  # decodes and prompt chunks in one dispatch
    if "prefill_chunk" in FEATURES[feature]:  # prompts of up to 100 ids went in chunks of 16, several at once
        assert any(step.prefilling > 1 for step in steps)
    if FEATURES[feature].get("prefix_cache", True):
        stats = engine.stats()
        assert stats["prefix_cache_hit_tokens"] >= 16 * 20  # most of the 24 prompts with a shared prefix hit
        assert stats["prefix_cache_lookup_tokens"] == sum(len(r["tokens"]) for r in requests)
    if "speculative" in FEATURES[feature]:  # some drafts were accepted: a step gave a request several tokens
        assert sum(step.drafts for step in steps) > 0
        assert any(step.emitted > step.decoding + step.prefilling for step in steps)


def test_prefix_cache_hostile_cases(model):
    """Prompts that share a prefix up to a page boundary and differ right after it, that differ inside the last
    cached page, and a pool so small that cached pages are evicted while requests come and go: the same results as
    without the cache."""
    rng = np.random.default_rng(9)
    base = rng.integers(3, 256, 48).tolist()
    requests = [dict(tokens=base + [7, 8, 9], max_tokens=6),
                dict(tokens=base[:32] + [10, 11, 12, 13], max_tokens=6),  # differs right after page 2
                dict(tokens=base[:40] + [14, 15, 16, 17, 18, 19, 20, 21, 22], max_tokens=6),  # inside page 3
                dict(tokens=base + [7, 8, 9], max_tokens=6, temperature=1.0, seed=3)]
    expected = [alone(model, r) for r in requests]
    with Engine(model, slots=2, max_len=128, page_size=16) as engine:
        first = engine.submit(**requests[0]).result(timeout=300)  # its three full pages are published
        rest = [engine.submit(**r) for r in requests[1:]]
        assert_same([first] + [h.result(timeout=300) for h in rest], expected)
        assert engine.stats()["prefix_cache_hit_tokens"] == 32 + 32 + 48
    other = rng.integers(3, 256, 100).tolist()
    requests = [dict(tokens=base[:32] + [5, 6], max_tokens=5),  # publishes 2 pages
                dict(tokens=base[:32] + [7, 8], max_tokens=5),  # hits both
                dict(tokens=other + [9], max_tokens=5),  # needs 7 of the 8 pages: evicts them
                dict(tokens=base[:32] + [10], max_tokens=5, temperature=1.0, seed=8)]  # its first page is left
    expected = [alone(model, r) for r in requests]
    with Engine(model, slots=2, max_len=128, page_size=16, kv_cache_gb=pool_gb(model, 8, 16)) as engine:
        assert engine.pool.pages == 8
        got = [engine.submit(**requests[0]).result(timeout=300)]
        got += [h.result(timeout=300) for h in [engine.submit(**r) for r in requests[1:3]]]
        got.append(engine.submit(**requests[3]).result(timeout=300))
        assert_same(got, expected)
        # a request's last pages are evicted first (released last to first): the fourth still shares the first page
        assert engine.stats()["prefix_cache_hit_tokens"] == 32 + 16 and engine.pool.counters["evicted_pages"] > 0
    many = shared_prefix_requests(model.config.vocab_size, 16)  # 16 at once through a pool of one request
    results, engine = served(model, many, page_size=16, kv_cache_gb=pool_gb(model, 8, 16))
    assert_same(results, [alone(model, r) for r in many])


def test_a_burst_sharing_a_prefix_computes_it_once(model):
    """Eight prompts that start with the same three pages arrive together (a system prompt at a busy moment): the
    first computes the pages, the other seven wait for them to be published and share them, so the cache counts
    7 × 48 hit tokens; each result is generate's alone."""
    rng = np.random.default_rng(11)
    shared = rng.integers(3, 256, 48).tolist()
    requests = [dict(tokens=shared + rng.integers(3, 256, 1 + i).tolist(), max_tokens=4, ignore_eos=True,
                     **(dict(temperature=0.8, seed=i) if i % 2 else {})) for i in range(8)]
    results, engine = served(model, requests, page_size=16)
    assert_same(results, [alone(model, r) for r in requests])
    assert engine.stats()["prefix_cache_hit_tokens"] == 7 * 48


def test_a_long_prompt_rides_in_the_decoding_requests_steps(model):
    """7 requests decode while a prompt of 120 ids arrives: it is prefilled in chunks of at most 16, each in one step
    with every decoding request's next token (none of them waits a step), each chunk cut to fill the step's program
    (16 tokens: 7 decodes and 9 of the prompt) rather than padding it to 32, as the engine's step log shows."""
    with Engine(model, slots=8, max_len=160, prefill_chunk=16, max_step_tokens=32, prefix_cache=False) as engine:
        engine.warmup()
        running = [engine.submit(tokens=[5 + i, 6, 7], max_tokens=150, ignore_eos=True) for i in range(7)]
        for handle in running:
            next(iter(handle))  # each is decoding
        start = len(engine.step_log)
        long = engine.submit(tokens=list(np.random.default_rng(1).integers(3, 256, 120)), max_tokens=4, ignore_eos=True)
        long.result(timeout=300)
        steps = [step for step in list(engine.step_log)[start:] if step.prefilling]
        assert [step.tokens - step.decoding for step in steps] == [9] * 13 + [3]
        assert all(step.decoding == 7 for step in steps) and all(step.program_tokens == 16 for step in steps)
        assert [h.result(timeout=300).tokens for h in running] == [
            generate(model, tokens=[[5 + i, 6, 7]], max_new_tokens=150, ignore_eos=True)[0] for i in range(7)]


def test_a_workload_larger_than_the_pool_waits_and_completes(model):
    """12 requests of up to 60 positions each (720 in all) through a pool of 8 pages of 16 (128 positions): each
    waits for pages, none fails, and each equals generate."""
    rng = np.random.default_rng(4)
    requests = [dict(tokens=rng.integers(3, 256, 20 + 3 * i).tolist(), max_tokens=8 + i % 3, ignore_eos=True,
                     **(dict(temperature=0.7, seed=i) if i % 2 else {})) for i in range(12)]
    results, engine = served(model, requests, page_size=16, kv_cache_gb=pool_gb(model, 8, 16))
    assert_same(results, [alone(model, r) for r in requests])
    assert max(step.decoding + step.prefilling for step in engine.step_log) < 8  # the pool, not the slots, bound it
    assert engine.pool.available == engine.pool.pages and engine.scheduler.promised == 0


def test_a_step_reads_the_pages_in_use_not_max_lens(model):
    """On the model with an 8,192-position context, served at its whole context: requests of about 100 tokens step
    with the program of 16 tokens and read their 2 pages of 64, not max_len's 128."""
    config = dataclasses.replace(model.config, max_position_embeddings=8192)
    wide = dataclasses.replace(model, config=config)
    requests = [dict(tokens=list(range(3, 100 + i)), max_tokens=6, ignore_eos=True) for i in range(3)]
    with Engine(wide, slots=4, kv_cache_gb=0.05) as engine:
        assert engine.max_len == 8192 and engine.runner.columns == 128
        got = [h.result(timeout=300) for h in [engine.submit(**r) for r in requests]]
        decodes = [step for step in engine.step_log if not step.prefilling]
    assert_same(got, [alone(wide, r) for r in requests])
    assert {(step.program_tokens, step.columns) for step in decodes} == {(16, 2)}


def test_cancelled_requests_free_their_rows_and_pages(model):
    """Cancelled while queued or while decoding: each ends "cancelled", and the pool is whole again."""
    with Engine(model, slots=1, max_len=64, page_size=16) as engine:
        running = engine.submit(tokens=[5, 6, 7], max_tokens=60, ignore_eos=True)
        next(iter(running))
        queued = engine.submit(tokens=[8, 9], max_tokens=4)
        queued.cancel()
        running.cancel()
        assert [h.result(timeout=60).stop_reason for h in (running, queued)] == ["cancelled", "cancelled"]
        after = engine.submit(tokens=[5, 6, 7], max_tokens=5, ignore_eos=True).result(timeout=60)
        assert after.tokens == generate(model, tokens=[[5, 6, 7]], max_new_tokens=5, ignore_eos=True)[0]
        assert engine.stats()["kv_cache_pages_held"] == 0


def test_generate_speculative_gives_the_same_tokens_in_fewer_steps(model, monkeypatch):
    prompts = [([9, 10, 11, 12] * 8)[:30], list(range(40, 70)) + list(range(40, 50))]
    module = importlib.import_module("linnet_jax.generate")  # the module (linnet_jax.generate is the function)
    calls = []
    verify = module.verify
    monkeypatch.setattr(module, "verify", lambda *a, **k: calls.append(1) or verify(*a, **k))
    for options in ({}, dict(temperature=0.8, top_k=20, seed=4)):
        plain = generate(model, tokens=prompts, max_new_tokens=40, ignore_eos=True, return_details=True, **options)
        calls.clear()
        fast = generate(model, tokens=prompts, max_new_tokens=40, ignore_eos=True, return_details=True,
                        speculative=NGRAM, **options)
        assert [g.tokens for g in fast] == [g.tokens for g in plain]
        assert max(np.abs(np.array(f.logprobs) - p.logprobs).max() for f, p in zip(fast, plain)) < 1e-4
    calls.clear()  # greedy, the first prompt's output loops: drafts from it are accepted
    fast = generate(model, tokens=prompts[:1], max_new_tokens=40, ignore_eos=True, speculative=NGRAM)
    assert fast == generate(model, tokens=prompts[:1], max_new_tokens=40, ignore_eos=True)
    assert 0 < len(calls) < 30  # 39 tokens after the first in fewer than 30 steps
    monkeypatch.setattr(module, "propose", lambda *args: [])
    calls.clear()  # no row has a draft: plain steps, never a verify
    assert generate(model, tokens=prompts, max_new_tokens=40, ignore_eos=True, speculative=NGRAM) == generate(
        model, tokens=prompts, max_new_tokens=40, ignore_eos=True) and not calls
    with pytest.raises(RequestError, match="method 'eagle' is not supported"):
        generate(model, tokens=prompts, speculative={"method": "eagle"})
    with pytest.raises(RequestError, match="num_speculative_tokens must be a positive int"):
        generate(model, tokens=prompts, speculative={"num_speculative_tokens": 0})


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    config = Ngram(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=2)
    assert propose([1, 2, 3, 4, 5, 9, 1, 2, 3], config, 10) == [4, 5, 9]  # the 3-gram [1, 2, 3]
    assert propose([7, 2, 3, 8, 2, 3, 6, 0, 2, 3], config, 10) == [6, 0, 2]  # the latest [2, 3]
    assert propose([1, 2, 3, 4, 5, 9, 1, 2, 3], config, 2) == [4, 5]  # no more than the room
    assert propose([1, 2, 3, 4], config, 10) == []  # no earlier match
    assert propose([5], config, 10) == []
