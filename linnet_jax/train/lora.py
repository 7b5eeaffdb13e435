"""LoRA: adapters named as in Hugging Face (q_proj ... down_proj), their initialization as PEFT's, and
`merge_lora`, which folds them into a plain model that every export accepts.

Axis names: L layers, R rank, I a projection's input axes, O its output axes (see models/lora.py).
"""

import dataclasses
import math

import jax
import jax.numpy as jnp

from linnet_jax.models.lora import Lora
from linnet_jax.models.params import LayerParams, declared, layer_shapes

# Hugging Face's module name -> the LayerParams field it adapts.
TARGETS = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo", "gate_proj": "w_gate", "up_proj": "w_up",
           "down_proj": "w_down"}
FIELDS = {field: name for name, field in TARGETS.items()}


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Which projections get adapters (HF names), their rank r and alpha; PEFT's scale is alpha / r."""

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = tuple(TARGETS)

    def __post_init__(self):
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoRA rank must be a positive int, got {self.rank!r}")
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown or not self.targets:
            raise ValueError(f"LoRA targets {list(self.targets)}: expected a non-empty subset of {list(TARGETS)}")
        object.__setattr__(self, "targets", tuple(t for t in TARGETS if t in self.targets))  # canonical order

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def split_shape(config, field: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A projection's input axes I and output axes O (without the layer axis), e.g. wq → ((D,), (H, K))."""
    shape = layer_shapes(config)[field]
    inputs = declared(LayerParams)[field]["inputs"]
    return shape[:inputs], shape[inputs:]


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


def lora_config_of(lora: Lora) -> LoraConfig:
    """The LoraConfig these adapters were made with (rank from their shapes, alpha = scale · rank)."""
    rank = next(iter(lora.a.values())).shape[-1]
    alpha = lora.scale * rank
    return LoraConfig(rank=rank, alpha=int(alpha) if float(alpha).is_integer() else alpha,
                      targets=tuple(FIELDS[field] for field in lora.a))


def lora_delta(a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
    """The weight change scale · A B of stacked adapters: a [L, *I, R], b [L, R, *O] → [L, *I, *O], float32."""
    products = jax.vmap(lambda a, b: jnp.tensordot(a, b, axes=1, preferred_element_type=jnp.float32))
    return products(a, b) * scale


def merge_lora(model, lora: Lora):
    """A plain Model whose adapted weights are W + scale · A B (computed in float32, stored in W's dtype)."""
    layers = model.params.layers
    merged = {field: (getattr(layers, field).astype(jnp.float32) + lora_delta(lora.a[field], lora.b[field], lora.scale)
                      ).astype(getattr(layers, field).dtype) for field in lora.a}
    return dataclasses.replace(model, params=model.params.replace(layers=layers.replace(**merged)))
