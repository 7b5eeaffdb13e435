"""generate refuses what it cannot honour (issue 11's generate cases), and a property test of its arguments."""

import dataclasses
import math

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import linnet_jax
from linnet_jax import Model, generate
from linnet_jax.inputs import RequestError


def with_smollm2_tokenizer(tiny_dir, smollm2, vocab: int) -> Model:
    """A tiny random model (tied embeddings) of `vocab` ids, with SmolLM2's tokenizer and eos ids."""
    model = linnet_jax.load(tiny_dir("qwen2_bias_tied")[1], progress=False)
    embed = 0.1 * jax.random.normal(jax.random.key(0), (vocab, model.config.hidden_size))
    config = dataclasses.replace(model.config, vocab_size=vocab, eos_token_ids=smollm2.config.eos_token_ids)
    return Model(config=config, params=model.params.replace(embed=embed), tokenizer=smollm2.tokenizer)


@pytest.fixture(scope="module")
def tiny_chat(tiny_dir, smollm2):
    return with_smollm2_tokenizer(tiny_dir, smollm2, smollm2.config.vocab_size)


def test_text_prompt_outside_the_vocabulary_is_refused(tiny_dir, smollm2):
    small = with_smollm2_tokenizer(tiny_dir, smollm2, 1000)
    with pytest.raises(ValueError, match=r"prompt 0 \(as encoded by the tokenizer\) holds id \d+ outside the "
                                         r"vocabulary \[0, 1000\)"):
        generate(small, "What is the capital of France?", 4)


def test_stop_string_across_tokens_cuts_the_tokens_too(smollm2):
    out = generate(smollm2, "What is the capital of France?", 16, stop=["capital of"], return_details=True)
    assert out.stop_reason == "stop" and "capital of" not in out.text
    decoded = smollm2.tokenizer.decode(out.tokens)
    assert out.text.startswith(decoded) and "capital" not in decoded.removeprefix(out.text[:len(decoded)])
    assert len(out.logprobs) == len(out.tokens)


def test_numpy_ints_work_and_bad_values_are_refused(tiny_chat):
    assert len(generate(tiny_chat, tokens=[[5, 6]], max_new_tokens=np.int64(4), ignore_eos=True)[0]) == 4
    with pytest.raises(ValueError, match=r"max_len must be an int in \[1, 4096\]"):
        generate(tiny_chat, "hi", 4, max_len=10**6)
    with pytest.raises(ValueError, match="stop must be a non-empty string"):
        generate(tiny_chat, "hi", 4, stop=[""])
    with pytest.raises(ValueError, match="return_details=True is for a call that returns"):
        generate(tiny_chat, "hi", 4, stream=True, return_details=True)


@pytest.mark.parametrize("arguments, field", [
    (dict(temperature=-1.0), "temperature"), (dict(temperature="hot"), "temperature"), (dict(top_k=-1), "top_k"),
    (dict(top_p=0.0), "top_p"), (dict(min_p=2.0), "min_p"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(seed=2**64), "seed"), (dict(seed=[1, 2]), "seed"), (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-3]), "stop_token_ids"), (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=5000), "max_new_tokens"), (dict(max_len=10**6), "max_len"),
    (dict(stream=True, return_details=True), "stream"), (dict(prompt=[]), "prompt"), (dict(tokens=[[1]]), "prompt"),
])
def test_refusals_are_request_errors_naming_the_argument(tiny_chat, arguments, field):
    with pytest.raises(RequestError) as refused:
        generate(tiny_chat, **({"prompt": "hi"} | arguments))
    assert refused.value.field == field and isinstance(refused.value, ValueError)
    assert str(refused.value) == refused.value.message


@pytest.mark.parametrize("arguments, field, words", [
    (dict(top_k=2**40), "top_k", "top_k must be in [-2147483648, 2147483647] (int32), got 1099511627776"),
    (dict(max_new_tokens=2**63), "max_new_tokens", "exceeds the model's context of 4096 positions"),
    (dict(prompt=None, tokens=[]), "tokens", "tokens is an empty list; expected a list of ids or a list of id lists"),
    (dict(stop=""), "stop", "stop must be a non-empty string"),
    (dict(stop=["."] * 17), "stop", "stop holds 17 strings; at most 16 are supported"),
    (dict(stop="y" * 257), "stop", "a stop string holds 257 characters; at most 256 are supported"),
    # issue 44: a logit_bias key is an int or an id's canonical decimal string, and names its token once
    (dict(logit_bias={" 5": 1.0}), "logit_bias", "(ASCII digits, no sign, space or leading zero), got ' 5'"),
    (dict(logit_bias={"１２": 1.0}), "logit_bias", "(ASCII digits, no sign, space or leading zero), got '１２'"),
    (dict(logit_bias={"05": 1.0}), "logit_bias", "(ASCII digits, no sign, space or leading zero), got '05'"),
    (dict(logit_bias={"1" * 4400: 1.0}), "logit_bias", "logit_bias keys must be token ids in [0, "),
    (dict(logit_bias={5: 1.0, "5": -1.0}), "logit_bias", "logit_bias names token 5 twice"),
])
def test_refusals_say_what_was_expected(tiny_chat, arguments, field, words):
    with pytest.raises(RequestError) as refused:
        generate(tiny_chat, **({"prompt": "hi"} | arguments))
    assert refused.value.field == field and words in refused.value.message


def test_ids_no_numpy_int_holds_are_outside_the_vocabulary(tiny_chat):
    """Issue 44: an id past 64 bits (or past 2**63 beside a negative one) is named as any id outside the
    vocabulary is, not by the NumPy dtype it would need."""
    vocab = tiny_chat.config.vocab_size
    for tokens, bad in (([2**64], 2**64), ([[1, 2], [3, -(2**70)]], -(2**70)), ([-1, 2**63], -1)):
        with pytest.raises(ValueError, match=rf"tokens\[\d\] holds id {bad} outside the vocabulary \[0, {vocab}\)"):
            generate(tiny_chat, tokens=tokens, max_new_tokens=2)


def test_seeds_are_signed_64_bit(tiny_chat):
    sampled = dict(tokens=[[5, 6, 7]], max_new_tokens=16, temperature=1.0, ignore_eos=True)
    assert generate(tiny_chat, seed=2**32, **sampled) != generate(tiny_chat, seed=0, **sampled)
    assert generate(tiny_chat, seed=2**31, **sampled) != generate(tiny_chat, seed=-(2**31), **sampled)
    assert generate(tiny_chat, seed=np.int64(-5), **sampled) == generate(tiny_chat, seed=-5, **sampled)


def test_generated_model_py_refuses_bad_requests_and_a_full_cache(tiny_dir, tmp_path):
    import importlib.util

    model = linnet_jax.load(tiny_dir("llama_mha")[1], progress=False)
    out = linnet_jax.export.jax_source(model, tmp_path / "src")
    spec = importlib.util.spec_from_file_location("tiny_generated", out / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    params = module.load_weights()
    for bad in (0, -3):
        with pytest.raises(ValueError, match="max_new_tokens must be a positive int"):
            module.generate(params, [1, 2], bad)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 256\)"):
        module.generate(params, [1, 10**6], 2)
    cache = module.init_cache(module.CONFIG, 1, 4)
    _, cache = module.step(params, np.array([[1, 2, 3]]), np.array([[0, 1, 2]]), cache)
    _, cache = module.step(params, np.array([[4]]), np.array([[3]]), cache)
    with pytest.raises(ValueError, match="the cache is full"):
        module.step(params, np.array([[5]]), np.array([[4]]), cache)


FINISH = {"eos", "stop", "length"}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(prompt=st.text(max_size=60), max_new_tokens=st.integers(-2, 24), max_len=st.none() | st.integers(-4, 160),
       temperature=st.floats(-1, 3) | st.just(float("nan")), top_k=st.integers(-2, 60), top_p=st.floats(-0.5, 1.5),
       min_p=st.floats(-0.5, 1.5), seed=st.integers(-(2**65), 2**65),
       stop=st.none() | st.lists(st.text(max_size=4), max_size=3),
       stop_token_ids=st.none() | st.lists(st.integers(-3, 50000), max_size=3), chat=st.sampled_from([None, False]))
def test_any_arguments_give_a_well_formed_result_or_a_clear_error(tiny_chat, prompt, max_new_tokens, max_len,
                                                                   temperature, top_k, top_p, min_p, seed, stop,
                                                                   stop_token_ids, chat):
    try:
        out = generate(tiny_chat, prompt, max_new_tokens, max_len=max_len, temperature=temperature, top_k=top_k,
                       top_p=top_p, min_p=min_p, seed=seed, stop=stop, stop_token_ids=stop_token_ids, chat=chat,
                       return_details=True)
    except (ValueError, TypeError) as error:
        assert str(error)
        return
    assert out.stop_reason in FINISH and len(out.tokens) == len(out.logprobs) <= max_new_tokens
    assert all(math.isfinite(lp) and lp <= 0 for lp in out.logprobs)
    assert out.text.startswith(tiny_chat.tokenizer.decode(out.tokens)) or out.stop_reason == "stop"
    assert not any(s and s in out.text for s in stop or [])
