"""LoRA adapters on the decoder's projections, W x + (alpha / r) · B(A x): the adapters' pytree, their
configuration (rank, alpha, projections named as in Hugging Face) and shapes. Creating adapters for training
and merging them into the weights is `linnet_jax.train.lora`.

Axis names: L layers, R rank, I a projection's input axes, O its output axes (both as in the
weight it adapts: wq [D, H, K] has I = (D,) and O = (H, K); wo [H, K, D] has I = (H, K)); for serving several
adapters at once (`LoraTable`), N table entries and B batch rows, T positions.
The adapted weights are named by their `LayerParams` fields: wq, wk, wv, wo, w_gate, w_up, w_down.
"""

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from linnet_jax.models.config import Config
from linnet_jax.models.params import LayerParams, declared, layer_shapes

# Hugging Face's module name -> the LayerParams field it adapts.
TARGETS = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo", "gate_proj": "w_gate", "up_proj": "w_up",
           "down_proj": "w_down"}
FIELDS = {field: name for name, field in TARGETS.items()}


@flax.struct.dataclass
class Lora:
    """Low-rank adapters: for each adapted weight, a [L, *I, R] and b [L, R, *O] (one layer's
    slices inside the layer scan); scale = alpha / r, as PEFT's."""

    a: dict[str, jax.Array]
    b: dict[str, jax.Array]
    # Static (not a leaf) for flax.struct and for jax.tree_util.register_dataclass (the generated JAX source).
    scale: float = dataclasses.field(metadata={"pytree_node": False, "static": True})
    layer_major = True  # stacked on [L] first: the layer scan can carry them

    def layer(self, layer: int) -> "Lora":
        """One layer's adapters: a [*I, R], b [R, *O]."""
        return jax.tree.map(lambda w: w[layer], self)

    def add(self, out: jax.Array, name: str, x: jax.Array) -> jax.Array:
        """out + scale · B(A x) when weight `name` is adapted, else out. x: [B, T, *I]; out: [B, T, *O]."""
        if name not in self.a:
            return out
        return out + lora_term(x, self.a[name], self.b[name], self.scale)


def lora_term(x: jax.Array, a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
    """scale · B(A x): x [B, T, *I]; a [*I, R]; b [R, *O] → [B, T, *O].

    The products run over the B·T tokens as one axis: the gradient of b then contracts one axis of each operand,
    which XLA:CPU's dot takes as it lies, where over two axes (B, T) it first copied the output's gradient
    transposed (74 against 4.5 ms for an MLP projection's adapters at 4 × 512 tokens; benchmarks/RESULTS.md)."""
    low = jnp.tensordot(x.reshape(-1, *a.shape[:-1]), a, axes=a.ndim - 1)  # [B·T, R]
    return (jnp.tensordot(low, b, axes=1) * scale).reshape(*x.shape[:2], *b.shape[1:])


@flax.struct.dataclass
class LoraTable:
    """N adapters in one table of fixed shape, so that rows of one batch each use their own (PEFT's multi-LoRA
    serving, as vLLM's): for each adapted weight a [N, L, *I, R] and b [N, L, R, *O] (one layer's [N, *I, R] and
    [N, R, *O] once `layer` has sliced them); scale [N] float32, each entry's alpha / r (an array: putting a new
    adapter in changes no program); index [B] int32, each row's entry (set by `rows`). Entry 0 is all zeros:
    the base model. An adapter of a lower rank than the table's is zero-padded, one without a weight has zeros
    there."""

    a: dict[str, jax.Array]
    b: dict[str, jax.Array]
    scale: jax.Array
    index: jax.Array | None = None
    layer_major = False  # entries first: the decoder runs its layers unrolled

    def rows(self, index: jax.Array) -> "LoraTable":
        """The table with each row's entry, index [B] int32."""
        return self.replace(index=index)

    def layer(self, layer: int) -> "LoraTable":
        """One layer's adapters of every entry: a [N, *I, R], b [N, R, *O]."""
        take = lambda weights: {name: w[:, layer] for name, w in weights.items()}  # noqa: E731
        return self.replace(a=take(self.a), b=take(self.b))

    def add(self, out: jax.Array, name: str, x: jax.Array) -> jax.Array:
        """out + each row's scale · B(A x) with its entry's adapters. x: [B, T, *I]; out: [B, T, *O]."""
        if name not in self.a:
            return out
        return out + table_term(x, self.a[name], self.b[name], self.scale, self.index)


def table_term(x: jax.Array, a: jax.Array, b: jax.Array, scale: jax.Array, index: jax.Array) -> jax.Array:
    """Each row's scale · B(A x) with its own entry: x [B, T, *I]; a [N, *I, R]; b [N, R, *O]; scale [N];
    index [B] → [B, T, *O]. Every entry's A x is computed and each row keeps its own entry's (one-hot weights
    times the scale), so each adapter is read once per step however many rows use it."""
    inputs = a.ndim - 2
    low = jnp.tensordot(x, a, axes=(tuple(range(2, 2 + inputs)), tuple(range(1, 1 + inputs))))  # [B, T, N, R]
    weights = jnp.where(index[:, None] == jnp.arange(a.shape[0]), scale, 0).astype(low.dtype)  # [B, N]
    return jnp.tensordot(low * weights[:, None, :, None], b, axes=2)  # [B, T, *O]


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Which projections get adapters (HF names), their rank r and alpha; PEFT's scale is alpha / r."""

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = tuple(TARGETS)

    def __post_init__(self):
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoRA rank must be a positive int, got {self.rank!r}")
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown or not self.targets:
            raise ValueError(f"LoRA targets {list(self.targets)}: expected a non-empty subset of {list(TARGETS)}")
        object.__setattr__(self, "targets", tuple(t for t in TARGETS if t in self.targets))  # canonical order

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def split_shape(config: Config, field: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A projection's input axes I and output axes O (without the layer axis), e.g. wq → ((D,), (H, K))."""
    shape = layer_shapes(config)[field]
    inputs = declared(LayerParams)[field]["inputs"]
    return shape[:inputs], shape[inputs:]


def lora_config_of(lora: Lora) -> LoraConfig:
    """The LoraConfig these adapters were made with (rank from their shapes, alpha = scale · rank)."""
    rank = next(iter(lora.a.values())).shape[-1]
    alpha = lora.scale * rank
    return LoraConfig(rank=rank, alpha=int(alpha) if float(alpha).is_integer() else alpha,
                      targets=tuple(FIELDS[field] for field in lora.a))


def lora_shapes(config: Config, field: str, rank: int) -> dict[str, tuple[int, ...]]:
    """The shapes of weight `field`'s adapters of rank `rank`, stacked on the layers: {"a": [L, *I, R],
    "b": [L, R, *O]}."""
    inputs, outputs = split_shape(config, field)
    return {"a": (config.num_layers, *inputs, rank), "b": (config.num_layers, rank, *outputs)}


def check_shapes(config: Config, lora: Lora) -> None:
    """A ValueError naming the first adapter whose shape does not fit the model's config."""
    rank = lora_config_of(lora).rank
    for field in lora.a:
        for part, shape in lora_shapes(config, field, rank).items():
            got = tuple(getattr(lora, part)[field].shape)
            if got != shape:
                raise ValueError(f"LoRA {part}[{field!r}] has shape {got}, expected {shape} for this model")
