"""Primitives of the Llama-family decoder: pure functions on arrays, no model knowledge."""

from linnet_jax.ops.attention import attention
from linnet_jax.ops.mlp import swiglu
from linnet_jax.ops.norm import rms_norm
from linnet_jax.ops.rope import RopeScaling, apply_rope, inverse_frequencies

__all__ = ["RopeScaling", "apply_rope", "attention", "inverse_frequencies", "rms_norm", "swiglu"]
