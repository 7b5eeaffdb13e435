"""Per-layer weights (`unstack_layers`, what XLA:CPU's programs take) give what the stacked ones give."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import linnet_jax
from linnet_jax.models import forward, init_cache
from linnet_jax.backend import decode_params, plan_for, plan_for_platform
from linnet_jax.models.params import unstack_layers
from linnet_jax.ops import quantized


def prefill_then_decode(model, params, ids: np.ndarray, positions: np.ndarray, prefill: int, plan=None
                        ) -> np.ndarray:
    """Logits of a prefill of `prefill` tokens, then of one token at a time through the cache: [B, T, V]."""
    step = jax.jit(forward, static_argnums=1, static_argnames="plan")
    cache = init_cache(model.config, ids.shape[0], 64)
    out, cache = step(params, model.config, jnp.asarray(ids[:, :prefill]), positions[:, :prefill], cache, plan=plan)
    outs = [np.asarray(out)]
    for t in range(prefill, ids.shape[1]):
        out, cache = step(params, model.config, jnp.asarray(ids[:, t : t + 1]), positions[:, t : t + 1], cache,
                          plan=plan)
        outs.append(np.asarray(out))
    return np.concatenate(outs, axis=1)


@pytest.mark.parametrize("name", ["llama_gqa_llama3", "mistral_sliding", "qwen2_bias_tied", "qwen3_qk_norm"])
def test_per_layer_weights_equal_stacked(name, tiny_dir):
    _, directory = tiny_dir(name)
    model = linnet_jax.load(directory, progress=False)
    unrolled = unstack_layers(model.params)
    assert len(unrolled.layers) == model.config.num_layers
    ids = np.random.default_rng(4).integers(0, model.config.vocab_size, (3, 40))
    # a full row, a shorter one right-padded (its decode steps past 32 are padding), one left-padded
    positions = np.stack([np.arange(40), np.r_[np.arange(32), [-1] * 8], np.r_[[-1] * 8, np.arange(32)]])
    full = jax.jit(forward, static_argnums=1)
    assert np.abs(np.asarray(full(unrolled, model.config, ids, positions)[0])
                  - np.asarray(full(model.params, model.config, ids, positions)[0])).max() < 1e-5
    stacked = prefill_then_decode(model, model.params, ids, positions, prefill=24)
    got = prefill_then_decode(model, unrolled, ids, positions, prefill=24)
    assert np.abs(got - stacked).max() < 1e-5


def test_the_plan(tiny_dir):
    model = linnet_jax.load(tiny_dir("llama_mha")[1], progress=False)
    assert model.plan == plan_for(model.params) and model.plan.platform == "cpu" and model.plan.unstacked_layers
    for accelerator in ("gpu", "cuda", "rocm", "tpu"):
        plan = plan_for_platform(accelerator)
        assert not plan.unstacked_layers and not plan.matvec_kernels and plan.einsum is quantized.einsum
        assert decode_params(model.params, plan) is model.params  # the stacked weights themselves
        assert plan.attention_key_block(256) is None  # a switch's predicate would cost a GPU a host round trip
    assert model.plan.attention_key_block(16) == 128 and model.plan.attention_key_block(15) is None  # chunks only
    assert not plan_for_platform("cpu", devices=8).matvec_kernels  # a mesh keeps XLA's products
    assert plan_for_platform("cpu", devices=8).key_block == 128  # and reads a later chunk's spans
    assert hash(model.plan) == hash(plan_for_platform("cpu"))  # hashable: a static argument
    with pytest.raises(ValueError, match="platform must be one of"):
        plan_for_platform("metal")
    views = decode_params(model.params, model.plan)  # on this CPU: per-layer arrays sharing the stacked ones' memory
    assert isinstance(views.layers, tuple)
    assert np.shares_memory(np.asarray(views.layers[1].wq), np.asarray(model.params.layers.wq))
