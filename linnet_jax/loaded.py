"""`Model`: a config, its params and its tokenizer; and `logits`, a full forward with no cache."""

import dataclasses
import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from linnet_jax.backend import Plan, decode_params, plan_for
from linnet_jax.models import Config, Params, forward
from linnet_jax.models.params import any_quantized, dequantize_params, quantize_params
from linnet_jax.sharding import placed_params, put

if TYPE_CHECKING:
    from linnet_jax.sharding import Layout
    from linnet_jax.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class Model:
    """What `load` returns: `.config` (static), `.params` (a pytree of arrays), `.tokenizer` (or None),
    `.layout` (the mesh and sharding rules the params are placed by, or None on one device)."""

    config: Config
    params: Params
    tokenizer: "Tokenizer | None" = None
    layout: "Layout | None" = None

    @functools.cached_property
    def plan(self) -> Plan:
        """The hardware plan for the devices the params lie on (`linnet_jax.backend`). Made once."""
        return plan_for(self.params)

    @functools.cached_property
    def decode_params(self) -> Params:
        """The params the cached programs (prefill, decode) take under the plan (`backend.decode_params`):
        per-layer views of the weights on the CPU, the stacked weights themselves elsewhere. Made once."""
        return decode_params(self.params, self.plan)

    @property
    def quantization(self) -> str | None:
        """"int8" when the products' weights are int8 (`load(..., quantize="int8")`, `quantized`), else None."""
        return "int8" if any_quantized(self.params) else None

    def quantized(self) -> "Model":
        """The same model with the products' weights as int8 values and per-output-channel scales
        (`models.params.quantize_params`), placed as the float ones were; itself when already quantized."""
        if self.quantization:
            return self
        params = quantize_params(self.params)
        return dataclasses.replace(self, params=params if self.layout is None else
                                   placed_params(params, self.config, self.layout))

    def dequantized(self) -> "Model":
        """The float model a quantized one stands for (itself when not quantized): what exports write."""
        return dataclasses.replace(self, params=dequantize_params(self.params)) if self.quantization else self

    def __repr__(self) -> str:
        c = self.config
        placed = "" if self.layout is None else f", mesh={dict(self.layout.mesh.shape)}"
        quantized = f", weights={self.quantization}" if self.quantization else ""
        return (
            f"Model({c.architecture}, layers={c.num_layers}, heads={c.num_heads}/{c.num_kv_heads} kv, "
            f"hidden={c.hidden_size}, vocab={c.vocab_size}, params={_human(c.num_params())}, dtype={c.dtype}"
            f"{quantized}{placed})"
        )


def _human(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


@functools.partial(jax.jit, static_argnums=(1, 4))
def _full_forward(params: Params, config: Config, tokens: jax.Array, positions: jax.Array,
                  layout: "Layout | None") -> jax.Array:
    return forward(params, config, tokens, positions, constrain=layout and layout.constrain)[0]


def on_device(model: Model, arrays: dict[str, np.ndarray], axes: tuple[str, ...]) -> dict[str, jax.Array]:
    """Host inputs of the model's programs on its device or, sharded, on its mesh by their logical axes."""
    if model.layout is None:
        return {name: jnp.asarray(array) for name, array in arrays.items()}
    return {name: put(array, model.layout.sharding(name, axes, array.shape)) for name, array in arrays.items()}


def as_token_batch(token_ids, vocab_size: int, name: str = "token_ids") -> np.ndarray:
    """token_ids ([T] or [B, T] ints, list or array) as an int32 [B, T] array, checked against the vocabulary."""
    ids = np.asarray(token_ids)
    # Python ints that no integer dtype holds (past 64 bits, or past 2**63 beside negative ones) are kept as objects
    wide = ids.dtype.kind in "fO" and ids.size > 0 and all(
        isinstance(t, int) and not isinstance(t, bool) for t in np.asarray(token_ids, object).flat)
    if wide:
        ids = np.asarray(token_ids, object)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.shape[1] == 0 or (ids.size and not (wide or np.issubdtype(ids.dtype, np.integer))):
        raise ValueError(f"{name} must be a non-empty [T] or [B, T] array of ints, got shape {ids.shape} dtype {ids.dtype}")
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise ValueError(f"{name} holds id {int(bad[0])} outside the vocabulary [0, {vocab_size})")
    return ids.astype(np.int32)


def positions_from_mask(attention_mask: np.ndarray) -> np.ndarray:
    """Positions counting only the real tokens of each row; -1 at padding. [B, T] → [B, T]."""
    mask = attention_mask.astype(bool)
    return np.where(mask, np.cumsum(mask, axis=1) - 1, -1).astype(np.int32)


def logits(model: Model, token_ids, attention_mask=None) -> jax.Array:
    """Float32 logits [B, T, vocab] of a full forward (no cache).

    token_ids: ints, [T] (batch 1) or [B, T]. attention_mask: same shape, 1 for real tokens and
    0 for padding (left or right). Padding is never attended to, and positions count real
    tokens only, so a padded row's logits equal the unpadded row's at its real tokens.
    """
    ids = as_token_batch(token_ids, model.config.vocab_size)
    mask = np.ones_like(ids) if attention_mask is None else np.asarray(attention_mask)
    if mask.ndim == 1:
        mask = mask[None]
    if mask.shape != ids.shape:
        raise ValueError(f"attention_mask has shape {mask.shape}, expected the shape of token_ids {ids.shape}")
    inputs = on_device(model, {"token_ids": ids, "positions": positions_from_mask(mask)}, ("batch", "seq"))
    return _full_forward(model.params, model.config, inputs["token_ids"], inputs["positions"], model.layout)
