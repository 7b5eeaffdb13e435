"""LoRA adapters on the decoder's projections: W x + (alpha / r) · B(A x).

Axis names: L layers, R rank, I a projection's input axes, O its output axes (both as in the
weight it adapts: wq [D, H, K] has I = (D,) and O = (H, K); wo [H, K, D] has I = (H, K)).
The adapted weights are named by their `LayerParams` fields: wq, wk, wv, wo, w_gate, w_up, w_down.
"""

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class Lora:
    """Low-rank adapters: for each adapted weight, a [L, *I, R] and b [L, R, *O] (one layer's
    slices inside the layer scan); scale = alpha / r, as PEFT's."""

    a: dict[str, jax.Array]
    b: dict[str, jax.Array]
    # Static (not a leaf) for flax.struct and for jax.tree_util.register_dataclass (the generated JAX source).
    scale: float = dataclasses.field(metadata={"pytree_node": False, "static": True})

    def add(self, out: jax.Array, name: str, x: jax.Array) -> jax.Array:
        """out + scale · B(A x) when weight `name` is adapted, else out. x: [B, T, *I]; out: [B, T, *O]."""
        if name not in self.a:
            return out
        return out + lora_term(x, self.a[name], self.b[name], self.scale)


def lora_term(x: jax.Array, a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
    """scale · B(A x): x [B, T, *I]; a [*I, R]; b [R, *O] → [B, T, *O]."""
    low = jnp.tensordot(x, a, axes=a.ndim - 1)  # [B, T, R]
    return jnp.tensordot(low, b, axes=1) * scale
