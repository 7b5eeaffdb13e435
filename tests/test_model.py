"""Parity of the model with transformers eager float32, and of cached decode with one full forward."""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_CONFIGS, record_parity, reference_logits

import linnet_jax
from linnet_jax.models import forward, init_cache

TINY_BOUND = 1e-4
CACHE_BOUND_TINY = 1e-5


def random_ids(vocab: int, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, shape)


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_tiny_parity(name, tiny_dir):
    reference, directory = tiny_dir(name)
    model = linnet_jax.load(directory, progress=False)
    # Long enough to pass the sliding window (16) and, for llama3 scaling, the 256-token original context.
    length = 1100 if name == "llama_gqa_llama3" else 64
    ids = random_ids(model.config.vocab_size, (2, length))
    expected = reference_logits(reference, ids)
    got = np.asarray(linnet_jax.logits(model, ids))
    assert got.shape == expected.shape and got.dtype == np.float32
    assert np.abs(expected).std() > 0.3, "logits too flat for a meaningful comparison"
    diff = float(np.abs(got - expected).max())
    record_parity(f"tiny {name}, {length} tokens", diff)
    assert diff < TINY_BOUND


def test_llama3_scaling_is_exercised_past_1024(tiny_dir):
    """Positions past 1024 must differ from an unscaled model: the scaling is not a no-op."""
    _, directory = tiny_dir("llama_gqa_llama3")
    model = linnet_jax.load(directory, progress=False)
    import dataclasses

    from linnet_jax.ops import RopeScaling

    plain = dataclasses.replace(model, config=dataclasses.replace(model.config, rope_scaling=RopeScaling()))
    ids = random_ids(model.config.vocab_size, (1, 1100))
    scaled, unscaled = np.asarray(linnet_jax.logits(model, ids)), np.asarray(linnet_jax.logits(plain, ids))
    assert np.abs(scaled[:, 1024:] - unscaled[:, 1024:]).max() > 1e-2


def test_padding_left_and_right(tiny_dir):
    """A padded row's logits equal the unpadded row's at its real tokens; right padding matches transformers."""
    reference, directory = tiny_dir("llama_gqa_llama3")
    model = linnet_jax.load(directory, progress=False)
    ids = random_ids(model.config.vocab_size, (1, 24))
    alone = np.asarray(linnet_jax.logits(model, ids))[0]
    pad = np.zeros((1, 8), ids.dtype)
    left = np.concatenate([pad, ids], 1), np.concatenate([np.zeros((1, 8)), np.ones((1, 24))], 1)
    right = np.concatenate([ids, pad], 1), np.concatenate([np.ones((1, 24)), np.zeros((1, 8))], 1)
    got = np.asarray(linnet_jax.logits(model, np.concatenate([left[0], right[0]]), np.concatenate([left[1], right[1]])))
    assert np.abs(got[0, 8:] - alone).max() < 1e-5
    assert np.abs(got[1, :24] - alone).max() < 1e-5
    expected = reference_logits(reference, right[0], right[1].astype(np.int64))
    assert np.abs(got[1, :24] - expected[0, :24]).max() < TINY_BOUND


def cached_logits(model, ids: np.ndarray, prefill: int, max_len: int) -> np.ndarray:
    """Prefill `prefill` tokens, then decode the rest one token at a time through the cache."""
    import jax

    step = jax.jit(forward, static_argnums=1)
    batch, length = ids.shape
    positions = np.broadcast_to(np.arange(length), ids.shape)
    cache = init_cache(model.config, batch, max_len)
    out, cache = step(model.params, model.config, jnp.asarray(ids[:, :prefill]), positions[:, :prefill], cache)
    outs = [np.asarray(out)]
    for t in range(prefill, length):
        out, cache = step(model.params, model.config, jnp.asarray(ids[:, t : t + 1]), positions[:, t : t + 1], cache)
        outs.append(np.asarray(out))
    written = np.abs(np.asarray(cache.k[0])).sum(axis=-1) > 0  # [B * G, S]: slot i holds position i
    assert written[:, :length].all() and not written[:, length:].any()
    return np.concatenate(outs, axis=1)


@pytest.mark.parametrize("name", ["llama_gqa_llama3", "mistral_sliding", "qwen2_bias_tied", "qwen3_qk_norm"])
def test_cached_decode_equals_full_forward(name, tiny_dir):
    _, directory = tiny_dir(name)
    model = linnet_jax.load(directory, progress=False)
    ids = random_ids(model.config.vocab_size, (2, 40), seed=1)
    full = np.asarray(linnet_jax.logits(model, ids))
    diff = float(np.abs(cached_logits(model, ids, prefill=24, max_len=64) - full).max())
    record_parity(f"tiny {name}: prefill 24 + 16 decode steps vs full forward", diff)
    assert diff < CACHE_BOUND_TINY



def test_each_token_goes_to_the_slot_of_its_position(tiny_dir):
    """One cached call, two rows: row 0 at positions 0..7; row 1 its positions out of order between padding
    (-1). Padding writes no slot, every token lands at its position's slot, and each token's logits are those
    of the row's tokens ordered by position (a full forward without a cache)."""
    import jax

    model = linnet_jax.load(tiny_dir("llama_gqa_llama3")[1], progress=False)
    ids = random_ids(model.config.vocab_size, (2, 8), seed=5)
    positions = np.array([np.arange(8), [3, -1, 0, -1, 1, 2, -1, -1]])
    out, cache = jax.jit(forward, static_argnums=1)(model.params, model.config, jnp.asarray(ids), positions,
                                                    init_cache(model.config, 2, 16))
    heads = model.config.num_kv_heads
    written = (np.abs(np.asarray(cache.k[0])).sum(axis=-1) > 0).reshape(2, heads, 16)  # [B, G, S]
    assert written[0, :, :8].all() and not written[0, :, 8:].any()
    assert written[1, :, :4].all() and not written[1, :, 4:].any()  # 4 tokens, positions 0..3; padding nowhere
    columns = [int(np.flatnonzero(positions[1] == p)[0]) for p in range(4)]
    ordered = np.asarray(linnet_jax.logits(model, ids[1:, columns]))[0]  # [4, V]
    assert np.abs(np.asarray(out)[1, columns] - ordered).max() < CACHE_BOUND_TINY
    assert np.abs(np.asarray(out)[0] - np.asarray(linnet_jax.logits(model, ids[:1]))[0]).max() < CACHE_BOUND_TINY

def test_smollm2_parity(smollm2, smollm2_reference):
    ids = random_ids(smollm2.config.vocab_size, (1, 300), seed=2)
    expected = reference_logits(smollm2_reference, ids)
    got = np.asarray(linnet_jax.logits(smollm2, ids))
    diff = float(np.abs(got - expected).max())
    record_parity("SmolLM2-135M-Instruct (GGUF Q4_1 dequantized), 300 tokens", diff)
    assert diff < 1e-3


def test_smollm2_cached_decode(smollm2):
    ids = random_ids(smollm2.config.vocab_size, (1, 272), seed=3)
    full = np.asarray(linnet_jax.logits(smollm2, ids))
    diff = float(np.abs(cached_logits(smollm2, ids, prefill=256, max_len=288) - full).max())
    record_parity("SmolLM2: prefill 256 + 16 decode steps vs full forward", diff)
    # Float32 summation order (cache of 288 slots vs 272 keys) at logits up to ~35: measured 6.5e-5 to 1.5e-4
    # over seeds, i.e. 20-40 ulps; a real cache bug (a wrong slot, mask or position) gives differences of ~1.
    assert diff < 2e-4


def test_attention_over_the_spans_the_queries_see_equals_attention_over_every_slot():
    """`key_block`: attention reads the fewest of `key_spans` slots that hold every key a query sees (chosen on the
    device, one branch each) and equals attention over all slots: at a span's last slot and one past it, under a
    sliding window, with padding queries, and with rows that see different numbers of slots."""
    import jax

    from linnet_jax.ops.attention import attention, key_spans

    b, t, h, g, d, s, block = 2, 4, 4, 2, 8, 40, 8
    assert key_spans(t, s, block) == [8, 16, 32, 40] and key_spans(8, s, block) == [16, 32, 40]
    assert key_spans(t, 8, block) == [8] and key_spans(t, 12, block) == [8, 12]
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(b * g, s, d)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(b * g, d, s)), jnp.float32)
    slots = jnp.broadcast_to(jnp.arange(s), (b, s))
    spanned = lambda positions, window: attention(q, k, v, positions, slots, window, key_block=block)  # noqa: E731
    switches = [eqn for eqn in jax.make_jaxpr(spanned)(jnp.zeros((b, t), int), 0).eqns if eqn.primitive.name == "cond"]
    assert [len(eqn.params["branches"]) for eqn in switches] == [4]  # one switch over the four spans
    spanned = jax.jit(spanned)
    for last in (7, 8, 15, 16, 31, 32, 39):  # the last position a query holds: slots up to last + 1 are read
        positions = np.stack([[2, 3, -1, -1], np.arange(last - t + 1, last + 1)])  # row 0: two queries see nothing
        for window in (0, 5):
            got = spanned(jnp.asarray(positions), window)
            expected = attention(q, k, v, jnp.asarray(positions), slots, window)
            np.testing.assert_allclose(np.asarray(got)[positions >= 0], np.asarray(expected)[positions >= 0],
                                       atol=1e-6)
    assert np.isfinite(np.asarray(got)).all()


def test_causal_attention_equals_attention_and_its_gradient():
    """Blocked causal attention (queries past CAUSAL_BLOCK read fewer keys) equals the one-block form, values and
    gradients, over packed documents, a sliding window and padding, at a length that leaves a partial last block."""
    import jax

    from linnet_jax.ops import attention
    from linnet_jax.ops.attention import CAUSAL_BLOCK

    b, t, h, g, d = 2, 2 * CAUSAL_BLOCK + 44, 4, 2, 8
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(b * g, t, d)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(b * g, d, t)), jnp.float32)
    segments = np.ones((b, t), np.int32)
    segments[0, 150:] = 2  # two documents in row 0
    segments[1, 250:] = 0  # padding at the end of row 1
    positions = np.where(segments > 0, np.arange(t), -1)
    positions[0, 150:] -= 150
    cotangent = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    real = (segments > 0)[:, :, None, None]
    for window in (0, 40):
        outputs = [jax.vjp(lambda *qkv: attention(*qkv, jnp.maximum(positions, 0), positions, window, segments,
                                                 causal=causal), q, k, v) for causal in (False, True)]
        (blocked, blocked_vjp), (whole, whole_vjp) = outputs[1], outputs[0]
        np.testing.assert_allclose(np.where(real, blocked, 0), np.where(real, whole, 0), atol=1e-5)
        masked_cotangent = jnp.where(real, cotangent, 0)  # a padding query's output is not the model's
        for got, expected in zip(blocked_vjp(masked_cotangent), whole_vjp(masked_cotangent)):
            np.testing.assert_allclose(got, expected, atol=1e-5)
