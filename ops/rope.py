"""Rotary position embeddings in Hugging Face's half-split layout.

HF's layout rotates the pair (x[i], x[i + D/2]) by angle position * inv_freq[i], so q/k
weights from HF checkpoints load without a permutation. Angles are float32 whatever the
activation dtype. Supported scalings: "default", "linear" and "llama3".
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """How the inverse frequencies are stretched for long contexts (hashable: a static config field)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope type {self.rope_type!r} is not supported; expected one of {ROPE_TYPES}")


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling = RopeScaling()) -> np.ndarray:
    """The rotation speed of each of the head_dim/2 pairs: float32 [head_dim // 2].

    Computed in float32 exactly as transformers does, so angles agree bit for bit.
    """
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / (np.float32(theta) ** exponents)).astype(np.float32)
    if scaling.rope_type == "linear":
        return (inv_freq / np.float32(scaling.factor)).astype(np.float32)
    if scaling.rope_type == "llama3":
        return _llama3_frequencies(inv_freq, scaling)
    return inv_freq


def _llama3_frequencies(inv_freq: np.ndarray, s: RopeScaling) -> np.ndarray:
    """Llama 3.1's scaling: long wavelengths divided by factor, short kept, the middle interpolated."""
    wavelength = np.float32(2 * math.pi) / inv_freq
    low_freq_wavelength = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelength = s.original_max_position_embeddings / s.high_freq_factor
    scaled = np.where(wavelength > low_freq_wavelength, inv_freq / np.float32(s.factor), inv_freq)
    smooth = (s.original_max_position_embeddings / wavelength - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelength >= high_freq_wavelength) & (wavelength <= low_freq_wavelength)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray | jax.Array) -> jax.Array:
    """Rotate x by its positions.

    x: [B, T, H, D]; positions: [B, T] int; inv_freq: [D // 2] float32. Returns [B, T, H, D] in x's dtype.
    """
    angles = positions.astype(jnp.float32)[:, :, None] * jnp.asarray(inv_freq, jnp.float32)  # [B, T, D/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)
