"""generate(): greedy parity with transformers, batching, no retraces, sampling sets, stops, streaming, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import linnet_jax
from linnet_jax import generate
from linnet_jax.generate import TRACES
from linnet_jax.ops import SamplingParams, sample

NEAR_TIE = 1e-3


def reference_greedy(model, prompt: list[int], max_new_tokens: int, eos=None) -> tuple[list[int], list[float]]:
    """transformers' greedy ids and, per step, the gap between its two best logits."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, output_scores=True,
                             return_dict_in_generate=True, eos_token_id=eos, pad_token_id=0)
    gaps = [float(torch.topk(score[0], 2).values.diff().abs()) for score in out.scores]
    return out.sequences[0, len(prompt):].tolist(), gaps


def agreed_steps(ours: list[int], theirs: list[int], gaps: list[float]) -> tuple[int, int]:
    """(steps compared: up to the first near-tie in the reference, steps that agree among them)."""
    # The near-tie step itself may go either way: compare the steps before it.
    compared = min(next((i for i, gap in enumerate(gaps) if gap < NEAR_TIE), len(gaps)), len(theirs))
    agree = next((i for i in range(compared) if i >= len(ours) or ours[i] != theirs[i]), compared)
    return compared, agree


@pytest.mark.parametrize("chat", [False, True])
def test_smollm2_greedy_matches_transformers(smollm2, smollm2_reference, chat):
    prompt = "The three most important inventions of the nineteenth century were"
    details = generate(smollm2, prompt, max_new_tokens=64, chat=chat, return_details=True)
    ids = smollm2.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True) if chat \
        else smollm2.tokenizer.encode(prompt, add_special_tokens=True)
    theirs, gaps = reference_greedy(smollm2_reference, ids, 64, eos=list(smollm2.tokenizer.eos_token_ids))
    ours = details.tokens + ([theirs[len(details.tokens)]] if details.stop_reason == "eos" else [])
    compared, agree = agreed_steps(ours, theirs[:64], gaps)
    print(f"SmolLM2 greedy ({'chat' if chat else 'plain'}): {agree}/{compared} identical before the first near-tie"
          f" ({len(theirs)} generated)")
    assert agree == compared and compared >= min(48, len(theirs))  # all of it when eos comes earlier
    assert details.text == smollm2.tokenizer.decode(details.tokens)


def test_batch_of_different_lengths_equals_each_alone_and_transformers(tiny_dir):
    reference, directory = tiny_dir("llama_gqa_llama3")
    model = linnet_jax.load(directory, progress=False)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 256, n).tolist() for n in (3, 17, 40)]
    batch = generate(model, tokens=prompts, max_new_tokens=64, ignore_eos=True)
    for prompt, ours in zip(prompts, batch):
        assert ours == generate(model, tokens=[prompt], max_new_tokens=64, ignore_eos=True)[0]
        theirs, gaps = reference_greedy(reference, prompt, 64)
        compared, agree = agreed_steps(ours, theirs, gaps)
        assert agree == compared and compared >= 48, (agree, compared)


def test_no_retrace_inside_buckets(tiny_dir):
    model = linnet_jax.load(tiny_dir("llama_mha")[1], progress=False)
    generate(model, tokens=[list(range(1, 10))], max_new_tokens=10)
    before = dict(TRACES)
    for length in (3, 7, 11, 14, 16):
        generate(model, tokens=[list(range(1, length + 1))], max_new_tokens=10)
    generate(model, tokens=[[5, 6, 7]], max_new_tokens=13)
    generate(model, tokens=[[5, 6, 7]], max_new_tokens=13, temperature=0.7, top_p=0.9, top_k=20, min_p=0.05,
             repetition_penalty=1.3, seed=11)
    generate(model, tokens=[[5, 6, 7]], max_new_tokens=13, stop_token_ids=[3, 4])
    assert TRACES == before
    generate(model, tokens=[list(range(1, 40))], max_new_tokens=10)  # a new prompt bucket does trace
    assert TRACES["extend"] == before["extend"] + 1


def draws(logits: np.ndarray, n: int, **settings) -> np.ndarray:
    """n samples from one row of logits, each from its own key."""
    def full(value, dtype):
        return jnp.full((n,), value, dtype)

    params = SamplingParams(
        temperature=full(settings.get("temperature", 1.0), jnp.float32), top_k=full(settings.get("top_k", 0), jnp.int32),
        top_p=full(settings.get("top_p", 1.0), jnp.float32), min_p=full(settings.get("min_p", 0.0), jnp.float32),
        repetition_penalty=full(1.0, jnp.float32), presence_penalty=full(0.0, jnp.float32),
        frequency_penalty=full(0.0, jnp.float32), bias_ids=jnp.zeros((n, 1), jnp.int32), bias=jnp.zeros((n, 1)),
        keys=jax.random.split(jax.random.PRNGKey(0), n))
    return np.asarray(sample(jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (n, logits.size)), params, 0))


PROBS = np.array([0.3, 0.25, 0.2, 0.1, 0.08, 0.05, 0.02])


@pytest.mark.parametrize("settings, allowed", [
    (dict(top_k=3), {0, 1, 2}),
    (dict(top_p=0.6), {0, 1, 2}),  # 0.3 + 0.25 < 0.6: the third is needed to reach it
    (dict(top_p=0.5), {0, 1}),
    (dict(min_p=0.5), {0, 1, 2}),  # ≥ 0.15
    (dict(top_k=5, min_p=0.3), {0, 1, 2, 3}),  # ≥ 0.09
    (dict(top_k=2, top_p=0.9), {0, 1}),
    (dict(top_k=0), set(range(7))),
    (dict(top_p=1e-39), {0}),  # a float32 subnormal, flushed to zero: still the most likely token
])
def test_sampling_never_leaves_its_allowed_set(settings, allowed):
    chosen = draws(np.log(PROBS), 4000, **settings)
    assert set(chosen.tolist()) == allowed  # every allowed token drawn, nothing else


def test_sampling_without_filters_skips_the_sort_and_draws_the_same():
    """No row filters: the tempered logits as they are; the same draws as a filter that keeps everything."""
    assert (draws(np.log(PROBS), 500) == draws(np.log(PROBS), 500, top_k=7)).all()


def test_sampling_follows_the_distribution():
    chosen = draws(np.log(PROBS), 20000)
    assert np.abs(np.bincount(chosen, minlength=7) / 20000 - PROBS).max() < 0.015


def test_the_two_level_draw_follows_the_distribution_across_blocks():
    """V = 1000 (four blocks of 256, the last padded): mass in three blocks, -inf everywhere else, and
    uniforms at the ends of [0, 1): every draw is an allowed token, at its probability."""
    from linnet_jax.ops.sampling import inverse_cdf_draw

    probs = {3: 0.2, 255: 0.1, 256: 0.3, 700: 0.15, 999: 0.25}  # a block's first and last, and the padded one's
    logits = np.full(1000, -np.inf, np.float32)
    logits[list(probs)] = np.log(list(probs.values()))
    uniform = np.concatenate([np.random.default_rng(0).random(20000), [0.0, np.nextafter(1, 0, dtype=np.float32)]])
    chosen = np.asarray(inverse_cdf_draw(jnp.broadcast_to(jnp.asarray(logits), (uniform.size, 1000)),
                                         jnp.asarray(uniform, jnp.float32)))
    assert set(chosen.tolist()) == set(probs)
    frequency = np.bincount(chosen[:20000], minlength=1000) / 20000
    assert max(abs(frequency[token] - p) for token, p in probs.items()) < 0.015


def test_greedy_choice_is_argmaxs_first_index():
    """`first_max_index` (greedy's choice) equals jnp.argmax: ties go to the first, a row of -inf to index 0."""
    from linnet_jax.ops.sampling import first_max_index

    logits = np.random.default_rng(0).standard_normal((6, 49152)).astype(np.float32)
    logits[1, [7, 40000]] = logits[2, [40000, 7]] = 30.0  # tied maxima, in either order of writing
    logits[3] = -np.inf
    logits[4, -1] = np.inf
    logits[5, :100] = -np.inf
    chosen = np.asarray(first_max_index(jnp.asarray(logits))).tolist()
    assert chosen == np.argmax(logits, axis=-1).tolist()
    assert chosen[1:5] == [7, 7, 0, 49151]


def test_seeds(smollm2):
    prompt = "Tell me a story about a lighthouse."
    first = generate(smollm2, prompt, max_new_tokens=24, temperature=1.0, seed=1)
    assert generate(smollm2, prompt, max_new_tokens=24, temperature=1.0, seed=1) == first
    assert generate(smollm2, prompt, max_new_tokens=24, temperature=1.0, seed=2) != first
    rows = generate(smollm2, [prompt, prompt], max_new_tokens=24, temperature=1.0, seed=1)
    assert rows[0] != rows[1]  # each row its own stream


def test_stop_reasons_and_eos_ids(tiny_dir):
    import dataclasses

    model = linnet_jax.load(tiny_dir("llama_mha")[1], progress=False)
    prompt = [[9, 8, 7, 6]]
    free = generate(model, tokens=prompt, max_new_tokens=20, ignore_eos=True, return_details=True)[0]
    assert free.stop_reason == "length" and len(free.tokens) == 20 and len(free.logprobs) == 20
    assert all(lp <= 0 for lp in free.logprobs)
    target = free.tokens[6]
    first = free.tokens.index(target)
    stopped = generate(model, tokens=prompt, max_new_tokens=20, stop_token_ids=[target], ignore_eos=True,
                       return_details=True)[0]
    assert stopped.stop_reason == "stop" and stopped.tokens == free.tokens[:first]
    several = dataclasses.replace(model, config=dataclasses.replace(model.config, eos_token_ids=(255, target)))
    ended = generate(several, tokens=prompt, max_new_tokens=20, return_details=True)[0]
    assert ended.stop_reason == "eos" and ended.tokens == free.tokens[:first]
    assert generate(several, tokens=prompt, max_new_tokens=20, ignore_eos=True) == [free.tokens]


def test_stop_strings_and_streaming(smollm2):
    prompt = [{"role": "user", "content": "List the numbers from one to twenty, in words, separated by commas."}]
    full = generate(smollm2, prompt, max_new_tokens=48, return_details=True)
    assert full.stop_reason in ("eos", "length") and len(full.text) > 20
    word = full.text[len(full.text) // 2:].split()[0].strip(",.")
    cut = generate(smollm2, prompt, max_new_tokens=48, stop=[word, "zzz-never"], return_details=True)
    assert cut.stop_reason == "stop" and cut.text == full.text[: full.text.index(word)]
    assert smollm2.tokenizer.decode(cut.tokens).startswith(cut.text)
    pieces = list(generate(smollm2, prompt, max_new_tokens=48, stream=True))
    assert len(pieces) > 3 and "".join(pieces) == full.text
    assert "".join(generate(smollm2, prompt, max_new_tokens=48, stream=True, stop=word)) == cut.text


def test_conversations_and_batches_of_text(smollm2):
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    one = generate(smollm2, conversation, max_new_tokens=8)
    assert isinstance(one, str)
    assert generate(smollm2, [conversation, conversation], max_new_tokens=8) == [one, one]
    assert generate(smollm2, "Name a colour.", max_new_tokens=8, chat=True) == generate(
        smollm2, [{"role": "user", "content": "Name a colour."}], max_new_tokens=8)
    ids = smollm2.tokenizer.apply_chat_template(conversation, tokenize=True)
    assert smollm2.tokenizer.decode(generate(smollm2, tokens=[ids], max_new_tokens=8)[0]) == one


def test_bad_requests(smollm2, tiny_dir):
    with pytest.raises(ValueError, match="exceeds the model's context of 8192 positions"):
        generate(smollm2, tokens=[[1] * 8000], max_new_tokens=500)
    with pytest.raises(ValueError, match="max_len=32 is too small"):
        generate(smollm2, tokens=[[1] * 20], max_new_tokens=20, max_len=32)
    with pytest.raises(ValueError, match="stream=True takes one text prompt"):
        generate(smollm2, ["a", "b"], stream=True)
    with pytest.raises(ValueError, match="exactly one of prompt"):
        generate(smollm2, "a", tokens=[[1]])
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        generate(smollm2, "a", top_p=0.0)
    with pytest.raises(ValueError, match="max_new_tokens must be a positive int"):
        generate(smollm2, "a", max_new_tokens=0)
    with pytest.raises(ValueError, match="chat=False, but the prompt is a conversation"):
        generate(smollm2, [{"role": "user", "content": "hi"}], chat=False)
    with pytest.raises(ValueError, match=r"tokens\[1\] holds id 49152 outside the vocabulary"):
        generate(smollm2, tokens=[[1], [49152]])
    tiny = linnet_jax.load(tiny_dir("llama_mha")[1], progress=False)
    with pytest.raises(ValueError, match="no tokenizer: pass tokens"):
        generate(tiny, "hello")
