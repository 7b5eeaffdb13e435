"""LoRA for training: fresh adapters initialized as PEFT's, and `merge_lora`, which folds trained ones into a
plain model that every export accepts. The adapters' pytree, configuration and shapes are `models/lora.py`'s.

Axis names: L layers, R rank, I a projection's input axes, O its output axes (see models/lora.py).
"""

import dataclasses
import math

import jax
import jax.numpy as jnp

from linnet_jax.models.lora import TARGETS, Lora, LoraConfig, split_shape
from linnet_jax.ops.quantized import dequantized


def init_lora(config, lora_config: LoraConfig, key: jax.Array, dtype=None) -> Lora:
    """Fresh adapters: A uniform in ±1/sqrt(fan_in) (PEFT's kaiming_uniform(a=sqrt(5))), B zero, so the
    adapted model starts equal to the base. A: [L, *I, R], B: [L, R, *O], in the params dtype."""
    dtype = dtype or config.dtype
    a, b = {}, {}
    for name, subkey in zip(lora_config.targets, jax.random.split(key, len(lora_config.targets))):
        field = TARGETS[name]
        inputs, outputs = split_shape(config, field)
        bound = 1 / math.sqrt(math.prod(inputs))
        a[field] = jax.random.uniform(subkey, (config.num_layers, *inputs, lora_config.rank), dtype, -bound, bound)
        b[field] = jnp.zeros((config.num_layers, lora_config.rank, *outputs), dtype)
    return Lora(a=a, b=b, scale=lora_config.scale)


def lora_delta(a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
    """The weight change scale · A B of stacked adapters: a [L, *I, R], b [L, R, *O] → [L, *I, *O], float32."""
    products = jax.vmap(lambda a, b: jnp.tensordot(a, b, axes=1, preferred_element_type=jnp.float32))
    return products(a, b) * scale


def merge_lora(model, lora: Lora):
    """A plain Model whose adapted weights are W + scale · A B (computed in float32, stored in W's dtype; a quantized
    W dequantized first, so the merged weight is float)."""
    layers = model.params.layers
    merged = {field: (dequantized(getattr(layers, field)).astype(jnp.float32)
                      + lora_delta(lora.a[field], lora.b[field], lora.scale)).astype(getattr(layers, field).dtype)
              for field in lora.a}
    return dataclasses.replace(model, params=model.params.replace(layers=layers.replace(**merged)))
