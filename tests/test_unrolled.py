"""Per-layer weights (`unstack_layers`, what XLA:CPU's programs take) give what the stacked ones give."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import linnet_jax
from linnet_jax.models import forward, init_cache
from linnet_jax.models.params import decode_params, unstack_layers, unstacks_layers


def prefill_then_decode(model, params, ids: np.ndarray, positions: np.ndarray, prefill: int) -> np.ndarray:
    """Logits of a prefill of `prefill` tokens, then of one token at a time through the cache: [B, T, V]."""
    step = jax.jit(forward, static_argnums=1)
    cache = init_cache(model.config, ids.shape[0], 64)
    out, cache = step(params, model.config, jnp.asarray(ids[:, :prefill]), positions[:, :prefill], cache)
    outs = [np.asarray(out)]
    for t in range(prefill, ids.shape[1]):
        out, cache = step(params, model.config, jnp.asarray(ids[:, t : t + 1]), positions[:, t : t + 1], cache)
        outs.append(np.asarray(out))
    return np.concatenate(outs, axis=1)


@pytest.mark.parametrize("name", ["llama_gqa_llama3", "mistral_sliding", "qwen2_bias_tied", "qwen3_qk_norm"])
def test_per_layer_weights_equal_stacked(name, tiny_dir):
    _, directory = tiny_dir(name)
    model = linnet_jax.load(directory, progress=False)
    unrolled = unstack_layers(model.params)
    assert len(unrolled.layers) == model.config.num_layers
    ids = np.random.default_rng(4).integers(0, model.config.vocab_size, (2, 40))
    positions = np.stack([np.arange(40), np.r_[[-1] * 8, np.arange(32)]])  # the second row left-padded
    full = jax.jit(forward, static_argnums=1)
    assert np.abs(np.asarray(full(unrolled, model.config, ids, positions)[0])
                  - np.asarray(full(model.params, model.config, ids, positions)[0])).max() < 1e-5
    stacked = prefill_then_decode(model, model.params, ids, positions, prefill=24)
    got = prefill_then_decode(model, unrolled, ids, positions, prefill=24)
    assert np.abs(got - stacked).max() < 1e-5


def test_the_platform_switch(tiny_dir):
    model = linnet_jax.load(tiny_dir("llama_mha")[1], progress=False)
    assert unstacks_layers("cpu") and not unstacks_layers("gpu") and not unstacks_layers("tpu")
    views = decode_params(model.params)  # on this CPU: per-layer arrays that share the stacked ones' memory
    assert isinstance(views.layers, tuple)
    assert np.shares_memory(np.asarray(views.layers[1].wq), np.asarray(model.params.layers.wq))
