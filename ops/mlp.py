"""The SwiGLU feed-forward block.

Einsum legend: b batch, t sequence, d model width, f MLP width.
"""

import jax
import jax.numpy as jnp


def swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """down(silu(x @ gate) * (x @ up)).

    x: [B, T, D]; w_gate, w_up: [D, F]; w_down: [F, D]. Returns [B, T, D].
    """
    gate = jnp.einsum("btd,df->btf", x, w_gate)
    up = jnp.einsum("btd,df->btf", x, w_up)
    return jnp.einsum("btf,fd->btd", jax.nn.silu(gate) * up, w_down)
