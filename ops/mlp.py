"""The SwiGLU feed-forward block.

Einsum legend: b batch, t sequence, d model width, f MLP width.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp

import linnet_jax.ops.quantized as quantized


def swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
           adapt: Callable[[jax.Array, str, jax.Array], jax.Array] | None = None, einsum=jnp.einsum) -> jax.Array:
    """down(silu(x @ gate) * (x @ up)).

    x: [B, T, D]; w_gate, w_up: [D, F]; w_down: [F, D]. Returns [B, T, D].
    adapt(output, name, input): optional, each projection's output changed given its input, by name
    ("w_gate", "w_up", "w_down"); LoRA adds its low-rank term this way. einsum: how the products run
    (jnp.einsum, or `ops.matvec.einsum`).
    """
    adapt = adapt or (lambda out, name, inputs: out)
    gate, up = quantized.einsums(einsum, x, [("btd,df->btf", w_gate), ("btd,df->btf", w_up)])
    gate, up = adapt(gate, "w_gate", x), adapt(up, "w_up", x)
    hidden = jax.nn.silu(gate) * up
    return adapt(einsum("btf,fd->btd", hidden, w_down), "w_down", hidden)
