"""The unrolled forward (params from `unstack_layers`, a cache from `unstack_cache`) equals the scanned one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import linnet_jax
from linnet_jax.models import forward, init_cache
from linnet_jax.models.decoder import unstack_cache
from linnet_jax.models.params import unstack_layers


def prefill_then_decode(model, params, cache, ids: np.ndarray, positions: np.ndarray, prefill: int) -> np.ndarray:
    """Logits of a prefill of `prefill` tokens, then of one token at a time through the cache: [B, T, V]."""
    step = jax.jit(forward, static_argnums=1)
    out, cache = step(params, model.config, jnp.asarray(ids[:, :prefill]), positions[:, :prefill], cache)
    outs = [np.asarray(out)]
    for t in range(prefill, ids.shape[1]):
        out, cache = step(params, model.config, jnp.asarray(ids[:, t : t + 1]), positions[:, t : t + 1], cache)
        outs.append(np.asarray(out))
    return np.concatenate(outs, axis=1)


@pytest.mark.parametrize("name", ["llama_gqa_llama3", "mistral_sliding", "qwen2_bias_tied", "qwen3_qk_norm"])
def test_unrolled_equals_scanned(name, tiny_dir):
    _, directory = tiny_dir(name)
    model = linnet_jax.load(directory, progress=False)
    unrolled = unstack_layers(model.params)
    assert len(unrolled.layers) == model.config.num_layers
    ids = np.random.default_rng(4).integers(0, model.config.vocab_size, (2, 40))
    positions = np.stack([np.arange(40), np.r_[[-1] * 8, np.arange(32)]])  # the second row left-padded
    full = jax.jit(forward, static_argnums=1)
    assert np.abs(np.asarray(full(unrolled, model.config, ids, positions)[0])
                  - np.asarray(full(model.params, model.config, ids, positions)[0])).max() < 1e-5
    cache = init_cache(model.config, 2, 64)
    scanned = prefill_then_decode(model, model.params, cache, ids, positions, prefill=24)
    got = prefill_then_decode(model, unrolled, unstack_cache(cache), ids, positions, prefill=24)
    assert np.abs(got - scanned).max() < 1e-5


def test_unstacked_cache_needs_unstacked_params(tiny_dir):
    _, directory = tiny_dir("llama_mha")
    model = linnet_jax.load(directory, progress=False)
    cache = unstack_cache(init_cache(model.config, 1, 16))
    with pytest.raises(ValueError, match="unstack_layers"):
        forward(model.params, model.config, jnp.zeros((1, 4), jnp.int32), jnp.arange(4)[None], cache)
