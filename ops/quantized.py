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
    scaled, in the product; XLA fuses the scaling into the dot on GPUs and TPUs).

    x's leading axes that w lacks and the output leads with (a batch's rows and positions, "bt" in "btd,df->btf")
    run as one axis: the product's gradient for w then contracts one axis of each operand, which XLA:CPU's dot
    takes as it lies, where over two it first copies the output's gradient transposed (a [2048, 1536] copy took
    longer than the product; benchmarks/RESULTS.md)."""
    inputs, out = spec.split("->")
    x_axes, w_axes = inputs.split(",")
    rows = next((n for n, (a, b) in enumerate(zip(x_axes, out)) if a != b or a in w_axes), min(len(x_axes), len(out)))
    if rows > 1:
        merged = x.reshape(-1, *x.shape[rows:])
        y = einsum(f"{x_axes[rows - 1:]},{w_axes}->{out[rows - 1:]}", merged, w, **options)
        return y.reshape(*x.shape[:rows], *y.shape[1:])
    if is_quantized(w):
        return qwix.einsum(spec, x, w, **options)
    return jnp.einsum(spec, x, w, **options)


def einsums(einsum, x: jax.Array, products) -> list[jax.Array]:
    """[einsum(spec, x, w) for spec, w in products]: several products of one input (a layer's q, k and v, its gate
    and up), as one call where `einsum` has a form that takes them together (`einsum.of_one_input`:
    `ops.matvec.einsum`'s, whose kernel reads the input once and hands all of them to the threads at once)."""
    together = getattr(einsum, "of_one_input", None)
    return together(x, products) if together else [einsum(spec, x, w) for spec, w in products]


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
