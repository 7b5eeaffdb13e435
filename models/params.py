"""The weights: a registered dataclass pytree, layer weights stacked on a leading layer axis.

Axis names used in shapes: V vocab, D model width, L layers, H query heads, G key/value heads,
K head dim, F MLP width. Projections are stored input-first ([D, H, K], [D, F], ...), so
every einsum contracts the leading axis; transformers stores them [out, in]. The same axes by
their logical names, which sharding rules map to mesh axes (`param_axes`): vocab, embed,
layers, heads, kv_heads, head_dim, mlp.

`param_shapes(config)` is the one description of the tree: loading, checking and
converting to and from Hugging Face names all read it.
"""

import dataclasses
import math
from collections.abc import Callable, Mapping

import flax.struct
import jax
import numpy as np

from linnet_jax.models.config import Config


@flax.struct.dataclass
class LayerParams:
    """One decoder layer's weights, each with a leading [L] layer axis. Absent features are None."""

    attn_norm: jax.Array  # [L, D]
    wq: jax.Array  # [L, D, H, K]
    wk: jax.Array  # [L, D, G, K]
    wv: jax.Array  # [L, D, G, K]
    wo: jax.Array  # [L, H, K, D]
    mlp_norm: jax.Array  # [L, D]
    w_gate: jax.Array  # [L, D, F]
    w_up: jax.Array  # [L, D, F]
    w_down: jax.Array  # [L, F, D]
    bq: jax.Array | None = None  # [L, H, K]
    bk: jax.Array | None = None  # [L, G, K]
    bv: jax.Array | None = None  # [L, G, K]
    bo: jax.Array | None = None  # [L, D]
    q_norm: jax.Array | None = None  # [L, K]
    k_norm: jax.Array | None = None  # [L, K]


@flax.struct.dataclass
class Params:
    embed: jax.Array  # [V, D]
    layers: LayerParams
    final_norm: jax.Array  # [D]
    lm_head: jax.Array | None = None  # [V, D]; None when tied to embed


# Each layer field: (transformers name inside `model.layers.{i}.`, how many leading axes of ours are
# the projection's input; None for vectors, which only reshape).
LAYER_TENSORS: dict[str, tuple[str, int | None]] = {
    "attn_norm": ("input_layernorm.weight", None),
    "wq": ("self_attn.q_proj.weight", 1),
    "wk": ("self_attn.k_proj.weight", 1),
    "wv": ("self_attn.v_proj.weight", 1),
    "wo": ("self_attn.o_proj.weight", 2),
    "bq": ("self_attn.q_proj.bias", None),
    "bk": ("self_attn.k_proj.bias", None),
    "bv": ("self_attn.v_proj.bias", None),
    "bo": ("self_attn.o_proj.bias", None),
    "q_norm": ("self_attn.q_norm.weight", None),
    "k_norm": ("self_attn.k_norm.weight", None),
    "mlp_norm": ("post_attention_layernorm.weight", None),
    "w_gate": ("mlp.gate_proj.weight", 1),
    "w_up": ("mlp.up_proj.weight", 1),
    "w_down": ("mlp.down_proj.weight", 1),
}
TOP_TENSORS = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "lm_head": "lm_head.weight"}

# The logical axes of each weight (a layer's without its leading "layers" axis).
LAYER_AXES: dict[str, tuple[str, ...]] = {
    "attn_norm": ("embed",), "wq": ("embed", "heads", "head_dim"), "wk": ("embed", "kv_heads", "head_dim"),
    "wv": ("embed", "kv_heads", "head_dim"), "wo": ("heads", "head_dim", "embed"), "bq": ("heads", "head_dim"),
    "bk": ("kv_heads", "head_dim"), "bv": ("kv_heads", "head_dim"), "bo": ("embed",), "q_norm": ("head_dim",),
    "k_norm": ("head_dim",), "mlp_norm": ("embed",), "w_gate": ("embed", "mlp"), "w_up": ("embed", "mlp"),
    "w_down": ("mlp", "embed"),
}
TOP_AXES = {"embed": ("vocab", "embed"), "final_norm": ("embed",), "lm_head": ("vocab", "embed")}


def layer_shapes(config: Config) -> dict[str, tuple[int, ...]]:
    """The shape of one layer's tensors (no layer axis), only the ones this config has."""
    d, f, h, g, k = (config.hidden_size, config.intermediate_size, config.num_heads, config.num_kv_heads,
                     config.head_dim)
    shapes = {
        "attn_norm": (d,), "wq": (d, h, k), "wk": (d, g, k), "wv": (d, g, k), "wo": (h, k, d),
        "mlp_norm": (d,), "w_gate": (d, f), "w_up": (d, f), "w_down": (f, d),
    }
    if config.qkv_bias:
        shapes |= {"bq": (h, k), "bk": (g, k), "bv": (g, k)}
    if config.o_bias:
        shapes["bo"] = (d,)
    if config.qk_norm:
        shapes |= {"q_norm": (k,), "k_norm": (k,)}
    return shapes


def param_shapes(config: Config) -> Params:
    """The tree of shapes (tuples as leaves) this config's params have."""
    top = {"embed": (config.vocab_size, config.hidden_size), "final_norm": (config.hidden_size,)}
    if not config.tie_word_embeddings:
        top["lm_head"] = (config.vocab_size, config.hidden_size)
    layers = {name: (config.num_layers, *shape) for name, shape in layer_shapes(config).items()}
    return Params(layers=LayerParams(**layers), **top)


def param_axes(config: Config) -> dict[str, tuple[str, ...]]:
    """The logical axes of every weight this config has, by flat name (`flatten_params`'s names)."""
    names = flatten_params(param_shapes(config))
    return {name: ("layers", *LAYER_AXES[name.removeprefix("layers.")]) if name.startswith("layers.") else TOP_AXES[name]
            for name in names}


def hf_tensor_names(config: Config) -> list[str]:
    """Every transformers tensor name this config reads or writes."""
    names = [TOP_TENSORS[name] for name in ("embed", "final_norm", "lm_head")
             if name != "lm_head" or not config.tie_word_embeddings]
    for i in range(config.num_layers):
        names += [f"model.layers.{i}.{LAYER_TENSORS[field][0]}" for field in layer_shapes(config)]
    return names


def checked(name: str, tensor: np.ndarray, expected: tuple[int, ...]) -> np.ndarray:
    """The tensor, or a ValueError naming it when its shape is not the expected one."""
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(expected)}")
    return tensor


def from_hf_layer_tensor(name: str, tensor: np.ndarray, shape: tuple[int, ...], input_axes: int | None) -> np.ndarray:
    """One layer's transformers tensor ([out, in] for projections, flat for vectors) in our layout and shape."""
    if input_axes is None:
        return checked(name, tensor, (math.prod(shape),)).reshape(shape)
    hf_shape = (math.prod(shape[input_axes:]), math.prod(shape[:input_axes]))
    return checked(name, tensor, hf_shape).T.reshape(shape)


def to_hf_layer_tensor(tensor: np.ndarray, input_axes: int | None) -> np.ndarray:
    """The inverse of from_hf_layer_tensor: [in..., out...] → transformers' [out, in]; vectors flatten."""
    if input_axes is None:
        return tensor.reshape(-1)
    n_in = math.prod(tensor.shape[:input_axes])
    return np.ascontiguousarray(tensor.reshape(n_in, -1).T)


def params_from_hf(
    read: Callable[[str], np.ndarray],
    config: Config,
    convert: Callable[[str, np.ndarray], jax.Array],
    on_tensor: Callable[[str], None] = lambda name: None,
) -> Params:
    """Build Params from transformers-named tensors.

    read(name) returns one tensor (raising a clear error when absent); convert(our flat name,
    array) turns each of our stacked numpy arrays into a device array (dtype cast, placement);
    on_tensor reports progress.
    """

    def top(field: str) -> jax.Array:
        shape = getattr(param_shapes(config), field)
        name = TOP_TENSORS[field]
        on_tensor(name)
        return convert(field, checked(name, read(name), shape))

    def layer(field: str, shape: tuple[int, ...]) -> jax.Array:
        suffix, input_axes = LAYER_TENSORS[field]
        stacked = []
        for i in range(config.num_layers):
            name = f"model.layers.{i}.{suffix}"
            on_tensor(name)
            stacked.append(from_hf_layer_tensor(name, read(name), shape, input_axes))
        return convert(f"layers.{field}", np.stack(stacked))

    layers = LayerParams(**{field: layer(field, shape) for field, shape in layer_shapes(config).items()})
    lm_head = None if config.tie_word_embeddings else top("lm_head")
    return Params(embed=top("embed"), layers=layers, final_norm=top("final_norm"), lm_head=lm_head)


def params_to_hf(params: Params, config: Config) -> dict[str, np.ndarray]:
    """The transformers state dict of these params (numpy, in the params' dtype)."""
    state = {TOP_TENSORS["embed"]: np.asarray(params.embed), TOP_TENSORS["final_norm"]: np.asarray(params.final_norm)}
    if params.lm_head is not None:
        state[TOP_TENSORS["lm_head"]] = np.asarray(params.lm_head)
    for field in layer_shapes(config):
        suffix, input_axes = LAYER_TENSORS[field]
        stacked = np.asarray(getattr(params.layers, field))
        for i in range(config.num_layers):
            state[f"model.layers.{i}.{suffix}"] = to_hf_layer_tensor(stacked[i], input_axes)
    return state


def flatten_params(tree: Params | LayerParams, prefix: str = "") -> dict[str, jax.Array]:
    """Params as one flat {name: array} in field order: "embed", "layers.attn_norm", ..., "final_norm".

    Unstacked layers (`unstack_layers`) are named per layer: "layers.0.attn_norm", ... Absent (None)
    fields are left out. These are the names of the exports that take plain containers (StableHLO,
    the generated JAX source, and their safetensors files).
    """
    flat = {}
    for field in dataclasses.fields(tree):
        value = getattr(tree, field.name)
        if isinstance(value, tuple) and field.name == "layers":  # unstacked layers (a shape tree's leaves are tuples)
            for i, layer in enumerate(value):
                flat |= flatten_params(layer, f"{prefix}{field.name}.{i}.")
        elif dataclasses.is_dataclass(value):
            flat |= flatten_params(value, f"{prefix}{field.name}.")
        elif value is not None:
            flat[prefix + field.name] = value
    return flat


def unflatten_params(flat: dict[str, jax.Array]) -> Params:
    """The inverse of flatten_params (stacked or per-layer names)."""
    layers = {name.removeprefix("layers."): array for name, array in flat.items() if name.startswith("layers.")}
    top = {name: array for name, array in flat.items() if not name.startswith("layers.")}
    if not all("." in name for name in layers):
        return Params(layers=LayerParams(**layers), **top)
    per_layer = [{} for _ in range(1 + max(int(name.split(".")[0]) for name in layers))]
    for name, array in layers.items():
        index, field = name.split(".")
        per_layer[int(index)][field] = array
    return Params(layers=tuple(LayerParams(**fields) for fields in per_layer), **top)


def unstack_layers(params: Params) -> Params:
    """The same weights with `layers` as a tuple of per-layer LayerParams (no layer axis).

    The forward unrolls its layers over such params; on XLA:CPU that decodes faster than the scan
    over the stacked arrays, whose per-layer slices are copied before every product.
    """
    leaves, treedef = jax.tree.flatten(params.layers)
    slices = [layer_slices(leaf) for leaf in leaves]
    count = len(slices[0])
    return params.replace(layers=tuple(jax.tree.unflatten(treedef, [s[i] for s in slices]) for i in range(count)))


def layer_slices(stacked: jax.Array) -> list[jax.Array]:
    """stacked [L, ...] as L arrays: on a single CPU device views of its memory (`np.asarray` exposes
    that memory and `device_put` may alias host memory there), else copies."""
    devices = stacked.devices()
    if len(devices) == 1 and next(iter(devices)).platform == "cpu":
        host = np.asarray(stacked)
        return [jax.device_put(layer, stacked.sharding, may_alias=True) for layer in host]
    return list(stacked)


def count(params: Params | Mapping) -> int:
    """The number of scalars in a params tree."""
    return sum(x.size for x in jax.tree.leaves(params))
