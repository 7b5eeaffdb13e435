"""Primitives of the Llama-family decoder: pure functions on arrays, no model knowledge."""

from linnet_jax.ops import quantized
from linnet_jax.ops.attention import attention
from linnet_jax.ops.mlp import swiglu
from linnet_jax.ops.norm import rms_norm
from linnet_jax.ops.rope import RopeScaling, apply_rope, inverse_frequencies
from linnet_jax.ops.sampling import (SamplingParams, bitmask_words, filtered_logits, masked, penalize_repeats, penalized,
                                     sample)

__all__ = ["RopeScaling", "SamplingParams", "apply_rope", "attention", "bitmask_words", "filtered_logits",
           "inverse_frequencies", "masked", "penalize_repeats", "penalized", "quantized", "rms_norm", "sample",
           "swiglu"]
