"""RMSNorm, computed in float32 whatever the input dtype."""

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Root-mean-square norm over the last axis.

    x: [..., D] any float dtype; weight: [D]. Returns [..., D] in x's dtype (then scaled by weight,
    exactly as transformers' LlamaRMSNorm: normalise in float32, cast back, multiply).
    """
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)
