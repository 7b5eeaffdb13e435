"""Engine v2: chunked and batched prefill, the prefix cache and n-gram speculative decoding each give what
`generate` gives alone, request for request (greedy and seeded); a long prompt holds the decoding slots for one
chunk at a time; generate(speculative=...) gives the tokens of generate without it."""

import importlib

import numpy as np
import pytest
from test_engine import alone

import linnet_jax
from linnet_jax import generate
from linnet_jax.inputs import RequestError, prefill_widths
from linnet_jax.prefix_cache import GIB, block_bytes
from linnet_jax.serve import Engine
from linnet_jax.speculative import Ngram, propose

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
FEATURES = {
    "chunked and batched prefill": dict(prefill_chunk=16, prefill_batch=4, max_step_tokens=32, prefix_cache=False),
    "prefix cache": dict(prefix_block=16),
    "speculative": dict(speculative=NGRAM, prefix_cache=False),
    "all of them": dict(prefill_chunk=16, prefill_batch=2, prefix_block=16, speculative=NGRAM),
}


@pytest.fixture(scope="module")
def model(tiny_dir):
    return linnet_jax.load(tiny_dir("llama_gqa_llama3")[1], progress=False)


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
    with Engine(model, slots=8, max_len=128, steps_per_dispatch=2, **options) as engine:
        engine.warmup()
        handles = [engine.submit(**request) for request in requests]
        results = [handle.result(timeout=300) for handle in handles]
        assert engine.compiles_after_warmup == 0
    return results, engine


def assert_same(got, expected) -> None:
    for i, (g, want) in enumerate(zip(got, expected)):
        assert (g.tokens, g.stop_reason) == (want.tokens, want.stop_reason), f"request {i}"
        assert np.abs(np.array(g.logprobs) - want.logprobs).max() < 1e-4, f"request {i}"


@pytest.mark.parametrize("feature", FEATURES)
def test_each_feature_equals_generate_request_for_request(model, feature):
    requests = shared_prefix_requests(model.config.vocab_size, 32)
    results, engine = served(model, requests, **FEATURES[feature])
    assert_same(results, [alone(model, r) for r in requests])
    kinds = {step.kind for step in engine.step_log}
    if "prefill_chunk" in FEATURES[feature]:  # prompts of up to 100 ids went in chunks of 16, several at once
        prefills = [s for s in engine.step_log if s.kind == "prefill"]
        assert max(s.tokens for s in prefills) <= engine.max_step_tokens
        assert any(s.rows > 1 for s in prefills)
    if FEATURES[feature].get("prefix_cache", True):
        stats = engine.stats()
        assert stats["prefix_cache_hit_tokens"] >= 16 * 20  # most of the 24 prompts with a shared prefix hit
        assert stats["prefix_cache_lookup_tokens"] == sum(len(r["tokens"]) for r in requests)
    if "speculative" in FEATURES[feature]:
        verified = [s for s in engine.step_log if s.kind == "verify"]
        assert "verify" in kinds and sum(s.emitted - s.rows for s in verified) > 0  # some drafts were accepted


def test_prefix_cache_hostile_cases(model):
    """Prompts that share a prefix up to a block boundary and differ right after it, that differ inside the last
    cached block, and a cache of two blocks that evicts while requests come and go: the same results as
    without the cache."""
    rng = np.random.default_rng(9)
    base = rng.integers(3, 256, 48).tolist()
    requests = [dict(tokens=base + [7, 8, 9], max_tokens=6),
                dict(tokens=base[:32] + [10, 11, 12, 13], max_tokens=6),  # differs right after block 2
                dict(tokens=base[:40] + [14, 15, 16, 17, 18, 19, 20, 21, 22], max_tokens=6),  # inside block 3
                dict(tokens=base + [7, 8, 9], max_tokens=6, temperature=1.0, seed=3)]
    expected = [alone(model, r) for r in requests]
    with Engine(model, slots=2, max_len=128, prefix_block=16) as engine:
        first = engine.submit(**requests[0]).result(timeout=300)  # its three blocks are stored
        rest = [engine.submit(**r) for r in requests[1:]]
        assert_same([first] + [h.result(timeout=300) for h in rest], expected)
        assert engine.stats()["prefix_cache_hit_tokens"] == 32 + 32 + 48
    two_blocks = 2 * block_bytes(model.config, 16, model.params.embed.dtype) / GIB
    other = rng.integers(3, 256, 32).tolist()
    requests = [dict(tokens=base[:32] + [5, 6], max_tokens=5),  # fills the cache (2 blocks)
                dict(tokens=base[:32] + [7, 8], max_tokens=5),  # hits both blocks ...
                dict(tokens=other + [9], max_tokens=5),  # ... while this one evicts them
                dict(tokens=base[:32] + [10], max_tokens=5, temperature=1.0, seed=8)]  # evicted: a miss
    expected = [alone(model, r) for r in requests]
    with Engine(model, slots=2, max_len=128, prefix_block=16, prefix_cache_gb=two_blocks) as engine:
        assert engine.prefixes.capacity == 2
        got = [engine.submit(**requests[0]).result(timeout=300)]
        got += [h.result(timeout=300) for h in [engine.submit(**r) for r in requests[1:3]]]
        got.append(engine.submit(**requests[3]).result(timeout=300))
        assert_same(got, expected)
        assert engine.stats()["prefix_cache_hit_tokens"] == 32
    many = shared_prefix_requests(model.config.vocab_size, 16)  # 16 at once through a cache of 2 blocks
    results, engine = served(model, many, prefix_block=16, prefix_cache_gb=two_blocks)
    assert_same(results, [alone(model, r) for r in many])


def test_a_burst_sharing_a_prefix_computes_it_once(model):
    """Eight prompts that start with the same three blocks arrive together (a system prompt at a busy moment): the
    first computes the blocks, the other seven wait for them to be stored and copy them, so the cache counts 7 × 48
    hit tokens; each result is generate's alone."""
    rng = np.random.default_rng(11)
    shared = rng.integers(3, 256, 48).tolist()
    requests = [dict(tokens=shared + rng.integers(3, 256, 1 + i).tolist(), max_tokens=4, ignore_eos=True,
                     **(dict(temperature=0.8, seed=i) if i % 2 else {})) for i in range(8)]
    with Engine(model, slots=8, max_len=128, prefix_block=16) as engine:
        engine.warmup()
        with engine._wake:  # the engine admits them together: none is looked up before all are queued
            handles = [engine.submit(**request) for request in requests]
        assert_same([h.result(timeout=300) for h in handles], [alone(model, r) for r in requests])
        assert engine.stats()["prefix_cache_hit_tokens"] == 7 * 48


def test_a_prefill_dispatch_groups_chunks_that_fill_its_width(model):
    """Eight prompts of 18-110 ids arriving together (a chunk of 128 each): the oldest waiting prompt sets each
    dispatch's width and the others that fill it best join it, so the long ones go together at 128 columns and the
    short ones at 32. In arrival order, four at a time, every dispatch would run 128 columns for 48% of tokens."""
    assert prefill_widths(128, 256) == [16, 32, 64, 96, 128]  # warmup compiles these (and 192 under 256 chunks)
    assert prefill_widths(256, 640) == [16, 32, 64, 96, 128, 192, 256]
    lengths = [100, 20, 90, 30, 110, 25, 95, 18]
    requests = [dict(tokens=[3 + (7 * i + j) % 250 for j in range(n)], max_tokens=4, ignore_eos=True)
                for i, n in enumerate(lengths)]
    expected = [alone(model, r) for r in requests]
    with Engine(model, slots=8, max_len=256, prefill_chunk=128, max_step_tokens=512, prefix_cache=False) as engine:
        with engine._wake:  # the engine admits them together (no warm-up: it compiles the two programs it runs)
            handles = [engine.submit(**request) for request in requests]
        assert_same([h.result(timeout=300) for h in handles], expected)
        prefills = [step for step in engine.step_log if step.kind == "prefill"]
    assert [(step.tokens, step.program_rows, step.program_width) for step in prefills] == [(395, 4, 128),
                                                                                          (93, 4, 32)]


def test_a_long_prompt_holds_the_decoding_slots_one_chunk_at_a_time(model, monkeypatch):
    """7 slots decode while a prompt of 120 ids arrives: it is prefilled in chunks of 16, and between two of its
    chunks every decoding slot gets its next token (one decode dispatch of one step, not steps_per_dispatch: the
    prompt joins the decoding rows sooner), as the engine's step log shows. (No dispatch is cut short for its
    steps' time, however loaded the machine: DISPATCH_SECONDS is raised.)"""
    monkeypatch.setattr(importlib.import_module("linnet_jax.serve.engine"), "DISPATCH_SECONDS", 1e9)
    with Engine(model, slots=8, max_len=160, steps_per_dispatch=4, prefill_chunk=16, prefix_cache=False) as engine:
        engine.warmup()
        running = [engine.submit(tokens=[5 + i, 6, 7], max_tokens=150, ignore_eos=True) for i in range(7)]
        for handle in running:
            next(iter(handle))  # each is decoding
        start = len(engine.step_log)
        long = engine.submit(tokens=list(np.random.default_rng(1).integers(3, 256, 120)), max_tokens=4, ignore_eos=True)
        long.result(timeout=300)
        steps = list(engine.step_log)[start:]
        prefills = [i for i, step in enumerate(steps) if step.kind == "prefill"]
        assert len(prefills) == 8 and all(steps[i].tokens <= 16 for i in prefills)  # 7 chunks of 16 and one of 8
        for before, after in zip(prefills, prefills[1:]):  # one decode step of the 7 between any two chunks
            between = [step for step in steps[before + 1:after] if step.kind == "decode"]
            assert len(between) == 1 and between[0].rows >= 7 and between[0].tokens == between[0].rows
        assert [h.result(timeout=300).tokens for h in running] == [
            generate(model, tokens=[[5 + i, 6, 7]], max_new_tokens=150, ignore_eos=True)[0] for i in range(7)]
        assert any(step.kind == "decode" and step.tokens == 4 * step.rows for step in engine.step_log)  # none waits


@pytest.mark.parametrize("speculative", [None, NGRAM])
def test_decode_runs_over_the_leading_rows_that_hold_requests(model, speculative):
    """Slots are given lowest first and a decode (or verify) dispatch runs the program of the fewest leading rows
    that hold every decoding request: a lone request on 8 slots costs a one-row step, three at once a four-row one."""
    requests = [dict(tokens=[5 + i, 9, 13, 2 * i + 3] * 2, max_tokens=12, seed=i, temperature=0.8 * (i % 2),
                     ignore_eos=True) for i in range(3)]
    with Engine(model, slots=8, max_len=128, prefix_cache=False, speculative=speculative) as engine:
        engine.warmup()
        lone = engine.submit(**requests[0]).result(timeout=120)
        alone_rows = {(step.kind, step.program_rows) for step in engine.step_log if step.kind != "prefill"}
        engine.step_log.clear()
        with engine._wake:  # the engine admits the three together, however loaded the machine
            handles = [engine.submit(**request) for request in requests]
        together = [handle.result(timeout=120) for handle in handles]
        together_rows = {(step.rows, step.program_rows) for step in engine.step_log if step.kind != "prefill"}
        assert engine.compiles_after_warmup == 0
    assert {rows for _, rows in alone_rows} == {1}
    assert ("verify", 1) in alone_rows or not speculative  # its drafts were verified on the one-row program too
    assert (3, 4) in together_rows and max(rows for _, rows in together_rows) == 4
    assert_same([lone, *together], [alone(model, request) for request in [requests[0], *requests]])


def test_a_dispatch_of_slow_steps_is_one_step(model, monkeypatch):
    """A decode dispatch runs as many steps as take DISPATCH_SECONDS (at least one), so a request arriving during
    it waits little for its prefill: with 0 s, the first dispatch (no step timed yet) runs steps_per_dispatch and
    every later one one step; the tokens are generate's."""
    monkeypatch.setattr(importlib.import_module("linnet_jax.serve.engine"), "DISPATCH_SECONDS", 0.0)
    with Engine(model, slots=2, max_len=64, steps_per_dispatch=4, prefix_cache=False) as engine:
        engine.warmup()
        handle = engine.submit(tokens=[5, 6, 7], max_tokens=12, ignore_eos=True)
        assert handle.result(timeout=300).tokens == generate(model, tokens=[[5, 6, 7]], max_new_tokens=12,
                                                             ignore_eos=True)[0]
        decodes = [step.tokens for step in engine.step_log if step.kind == "decode"]
    assert decodes == [4] + [1] * 7  # the prefill gave the first token, four then seven one at a time


@pytest.mark.parametrize("cancelled", [False, True])
def test_a_request_arriving_during_a_prefill_waits_one_decode_step(model, monkeypatch, cancelled):
    """A request submitted while a prefill dispatch runs (here: right after it, before the scheduler's next decode
    dispatch) takes its free slot at once, so the decode dispatch that follows is one step, not steps_per_dispatch,
    and its prefill comes next; both requests' tokens are generate's. One cancelled meanwhile ends without a slot:
    that dispatch runs its steps."""
    monkeypatch.setattr(importlib.import_module("linnet_jax.serve.engine"), "DISPATCH_SECONDS", 1e9)
    with Engine(model, slots=2, max_len=64, steps_per_dispatch=4, prefix_cache=False) as engine:
        engine.warmup()
        prefill, late = engine._prefill, []

        def prefill_then_arrive():
            prefill()
            if not late and engine.step_log:  # the first request's prefill has run: the second arrives now
                late.append(engine.submit(tokens=[8, 9, 10], max_tokens=6, ignore_eos=True))
                if cancelled:
                    late[0].cancel()

        monkeypatch.setattr(engine, "_prefill", prefill_then_arrive)
        first = engine.submit(tokens=[5, 6, 7], max_tokens=12, ignore_eos=True)
        assert first.result(timeout=300).tokens == generate(model, tokens=[[5, 6, 7]], max_new_tokens=12,
                                                            ignore_eos=True)[0]
        second = late[0].result(timeout=300)
        kinds = [(step.kind, step.tokens) for step in engine.step_log]
    if cancelled:
        assert (second.stop_reason, second.tokens) == ("cancelled", [])
        assert kinds[:2] == [("prefill", 3), ("decode", 4)]
    else:
        assert second.tokens == generate(model, tokens=[[8, 9, 10]], max_new_tokens=6, ignore_eos=True)[0]
        assert kinds[:3] == [("prefill", 3), ("decode", 1), ("prefill", 3)]


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
