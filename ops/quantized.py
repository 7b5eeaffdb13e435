"""Products and lookups that take weight-only quantized weights (`qwix.QArray`) where they take arrays.

A quantized weight holds int8 values of the float weight's shape and float scales that broadcast to it in tiles
(qwix's "generic broadcast"): an axis of size 1 in the scale shares one scale (a product's input axes under
per-output-channel scales), an axis that divides the weight's (GGUF Q8_0's blocks of 32 inputs) has one scale per
tile. Its value is values × scales, in the scales' dtype: attention, norms and the cache stay in that compute dtype.
"""

import math

import jax
import jax.numpy as jnp
import qwix


def is_quantized(weight) -> bool:
    return isinstance(weight, qwix.QArray)


def einsum(spec: str, x: jax.Array, w, **options) -> jax.Array:
    """jnp.einsum(spec, x, w, **options), where w may be quantized (qwix's weight-only product: the int8 values,
    scaled, in the product; XLA fuses the scaling into the dot on GPUs and TPUs)."""
    if is_quantized(w):
        return qwix.einsum(spec, x, w, **options)
    return jnp.einsum(spec, x, w, **options)


def input_block(weight: qwix.QArray, contracted: tuple[int, ...]) -> int | None:
    """How many contiguous inputs share each of a quantized weight's scales, or None when its scales are not laid
    out so (outputs sharing a scale, or blocks that are not contiguous in the flattened input)."""
    tiles = weight.scale_tile_shape
    if any(tiles[axis] != 1 for axis in range(weight.ndim) if axis not in contracted):
        return None
    if all(tiles[axis] == 1 for axis in contracted[:-1]):
        return tiles[contracted[-1]]
    if all(tiles[axis] == weight.shape[axis] for axis in contracted):  # one scale an output
        return math.prod(weight.shape[axis] for axis in contracted)
    return None


def take_rows(table, ids: jax.Array) -> jax.Array:
    """table[ids]: rows of a [V, D] table (quantized or not) for ids of any shape, → [*ids.shape, D]."""
    if is_quantized(table):
        return qwix.dequantize(jax.tree.map(lambda array: jnp.take(array, ids, axis=0), table))
    return jnp.take(table, ids, axis=0)


def dequantized(weight) -> jax.Array:
    """The float weight a quantized one stands for (an array unchanged)."""
    return qwix.dequantize(weight) if is_quantized(weight) else weight
