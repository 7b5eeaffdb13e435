"""The weights: a registered dataclass pytree, layer weights stacked on a leading layer axis.

Each weight is declared once, as a field of `LayerParams` or `Params` carrying its logical axes,
its transformers name, how many of its leading axes are a projection's input, and the config
flag it exists under; shapes, sharding axes and the Hugging Face mapping are derived from that.
Logical axes (which sharding rules map to mesh axes, `param_axes`) and their sizes: vocab V,
embed D, layers L, heads H, kv_heads G, head_dim K, mlp F. Projections are stored input-first
([D, H, K], [D, F], ...), so every einsum contracts the leading axis; transformers stores them
[out, in].

`quantize_params` (and `load(..., quantize="int8")`, a tensor at a time) keeps the products' weights (the
projections, the embedding and the lm head) as int8 values with float scales, `qwix.QArray`s: one scale per
output channel, or per output and block of inputs, as GGUF's Q8_0 stores them (`Int8Blocks`, read as they are).
The norms and biases stay in the compute dtype (`Params.dtype`).
"""

import dataclasses
import math
from collections.abc import Callable, Mapping

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import qwix

from linnet_jax.models.config import Config
from linnet_jax.ops.quantized import dequantized, input_block, is_quantized


HOST_ALIGNMENT = 64  # bytes: what XLA:CPU needs to use a host buffer in place


def weight(axes: tuple[str, ...], hf_name: str, inputs: int | None = None, when: str | None = None):
    """A weight field: logical axes (a layer weight's without "layers"), transformers name (a layer's
    inside `model.layers.{i}.`), how many leading axes are the projection's input (None: a vector,
    which only reshapes), and the Config flag it exists under (None: always; "untied": the lm head)."""
    return dataclasses.field(default=None, metadata=dict(axes=axes, hf_name=hf_name, inputs=inputs, when=when))


@flax.struct.dataclass
class LayerParams:
    """The decoder layers' weights, each with a leading [L] layer axis (none once unstacked). Absent ones are None."""

    attn_norm: jax.Array = weight(("embed",), "input_layernorm.weight")
    wq: jax.Array = weight(("embed", "heads", "head_dim"), "self_attn.q_proj.weight", inputs=1)
    wk: jax.Array = weight(("embed", "kv_heads", "head_dim"), "self_attn.k_proj.weight", inputs=1)
    wv: jax.Array = weight(("embed", "kv_heads", "head_dim"), "self_attn.v_proj.weight", inputs=1)
    wo: jax.Array = weight(("heads", "head_dim", "embed"), "self_attn.o_proj.weight", inputs=2)
    mlp_norm: jax.Array = weight(("embed",), "post_attention_layernorm.weight")
    w_gate: jax.Array = weight(("embed", "mlp"), "mlp.gate_proj.weight", inputs=1)
    w_up: jax.Array = weight(("embed", "mlp"), "mlp.up_proj.weight", inputs=1)
    w_down: jax.Array = weight(("mlp", "embed"), "mlp.down_proj.weight", inputs=1)
    bq: jax.Array | None = weight(("heads", "head_dim"), "self_attn.q_proj.bias", when="qkv_bias")
    bk: jax.Array | None = weight(("kv_heads", "head_dim"), "self_attn.k_proj.bias", when="qkv_bias")
    bv: jax.Array | None = weight(("kv_heads", "head_dim"), "self_attn.v_proj.bias", when="qkv_bias")
    bo: jax.Array | None = weight(("embed",), "self_attn.o_proj.bias", when="o_bias")
    q_norm: jax.Array | None = weight(("head_dim",), "self_attn.q_norm.weight", when="qk_norm")
    k_norm: jax.Array | None = weight(("head_dim",), "self_attn.k_norm.weight", when="qk_norm")


@flax.struct.dataclass
class Params:
    """All weights: the embedding, the decoder layers (stacked, or a tuple of per-layer LayerParams), the
    final norm and, when untied, the lm head."""

    embed: jax.Array = weight(("vocab", "embed"), "model.embed_tokens.weight")
    layers: LayerParams = None
    final_norm: jax.Array = weight(("embed",), "model.norm.weight")
    lm_head: jax.Array | None = weight(("vocab", "embed"), "lm_head.weight", when="untied")

    @property
    def dtype(self):
        """The compute dtype (quantized weights dequantize to it): the final norm's."""
        return self.final_norm.dtype

    @property
    def sharding(self):
        """Where the weights lie: the final norm's sharding (every device the params span)."""
        return self.final_norm.sharding


def declared(tree: type) -> dict[str, dict]:
    """The weight declarations of LayerParams or Params, by field name (layers excluded)."""
    return {f.name: dict(f.metadata) for f in dataclasses.fields(tree) if "axes" in f.metadata}


def present(config: Config, when: str | None) -> bool:
    """Whether a weight declared under `when` exists in this config."""
    return when is None or (not config.tie_word_embeddings if when == "untied" else getattr(config, when))


def axis_sizes(config: Config) -> dict[str, int]:
    return {"vocab": config.vocab_size, "embed": config.hidden_size, "heads": config.num_heads,
            "kv_heads": config.num_kv_heads, "head_dim": config.head_dim, "mlp": config.intermediate_size,
            "layers": config.num_layers}


def param_axes(config: Config) -> dict[str, tuple[str, ...]]:
    """The logical axes of every weight this config has, by flat name, in `flatten_params`'s order."""
    axes = {}
    for name, d in declared(Params).items():
        if name == "final_norm":  # the layers come between embed and final_norm, as the fields do
            axes |= {f"layers.{field}": ("layers", *e["axes"]) for field, e in declared(LayerParams).items()
                     if present(config, e["when"])}
        if present(config, d["when"]):
            axes[name] = d["axes"]
    return axes


def param_shapes(config: Config) -> Params:
    """The tree of shapes (tuples as leaves) this config's params have."""
    sizes = axis_sizes(config)
    return unflatten_params({name: tuple(sizes[a] for a in axes) for name, axes in param_axes(config).items()})


def layer_shapes(config: Config) -> dict[str, tuple[int, ...]]:
    """The shape of one layer's tensors (no layer axis), only the ones this config has."""
    stacked = flatten_params(param_shapes(config).layers)
    return {name: shape[1:] for name, shape in stacked.items()}


def hf_tensor_names(config: Config) -> list[str]:
    """Every transformers tensor name this config reads or writes."""
    top = [d["hf_name"] for d in declared(Params).values() if present(config, d["when"])]
    return top + [f"model.layers.{i}.{declared(LayerParams)[field]['hf_name']}" for i in range(config.num_layers)
                  for field in layer_shapes(config)]


@dataclasses.dataclass(frozen=True)
class Int8Blocks:
    """A tensor stored quantized (GGUF's Q8_0): int8 values [..., n] and float32 scales [..., n / block], one for
    each block of contiguous values along the last axis (a transformers tensor's input axis)."""

    values: np.ndarray
    scales: np.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def block(self) -> int:
        return self.values.shape[-1] // self.scales.shape[-1]

    def dequantized(self) -> np.ndarray:
        """The float32 tensor the blocks stand for."""
        blocks = self.values.reshape(*self.scales.shape, self.block)
        return (blocks * self.scales[..., None].astype(np.float32)).reshape(self.values.shape)


def contracted_axes(name: str) -> tuple[int, ...] | None:
    """The axes a weight's products contract, by stacked flat name: a layer projection's input axes (after the layer
    axis), the embedding's and lm head's embed axis (the head's product); None for a vector (norms, biases)."""
    if name in ("embed", "lm_head"):
        return (1,)
    inputs = declared(LayerParams)[name.removeprefix("layers.")]["inputs"] if name.startswith("layers.") else None
    return None if inputs is None else tuple(range(1, 1 + inputs))


def quantize_weight(weight: jax.Array, contracted: tuple[int, ...], block: int | None = None) -> qwix.QArray:
    """weight as int8 values and scales (qwix, absmax): one scale per output channel (block None), or per output
    and block of `block` contiguous inputs (each input axis but the last per index, the last in blocks).

    Quantized in float32, the scales then stored in the weight's dtype (the compute dtype): qwix takes a scale
    under sqrt(finfo(dtype).tiny) for an all-zero channel's and makes it 1, and float16's is 2^-7, so a float16
    channel whose largest |weight| is under 127 · 2^-7 ≈ 0.99 (nearly every one of an LLM) came out all zeros."""
    channels = tuple(axis for axis in range(weight.ndim) if axis not in contracted)
    tiles = None if block is None else {**{axis: 1 for axis in contracted[:-1]}, contracted[-1]: block}
    return qwix.quantize(weight.astype(jnp.float32), jnp.int8, channelwise_axes=channels, tiled_axes=tiles,
                         scale_dtype=weight.dtype)


def quantize_params(params: Params) -> Params:
    """The same model with the products' weights (projections, embedding, lm head) quantized per output channel
    (`quantize_weight`); stacked params only."""
    return unflatten_params({name: array if (axes := contracted_axes(name)) is None or is_quantized(array)
                             else quantize_weight(array, axes)
                             for name, array in flatten_params(params).items()})


def dequantize_params(params: Params) -> Params:
    """The float model quantized params stand for (float params unchanged)."""
    return jax.tree.map(dequantized, params, is_leaf=is_quantized)


def any_quantized(params: Params) -> bool:
    """Whether any weight of params is quantized."""
    return any(map(is_quantized, flatten_params(params).values()))


def checked(name: str, tensor: np.ndarray, expected: tuple[int, ...]) -> np.ndarray:
    """The tensor, or a ValueError naming it when its shape is not the expected one."""
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(expected)}")
    return tensor


def from_hf_layer_tensor(name: str, tensor: np.ndarray | Int8Blocks, shape: tuple[int, ...], input_axes: int | None
                         ) -> np.ndarray | Int8Blocks:
    """One layer's transformers tensor ([out, in] for projections, flat for vectors) in our layout and shape. Int8Blocks
    keep their blocks when they lie along our last input axis (else they come dequantized, float32)."""
    if isinstance(tensor, Int8Blocks):
        block, last = tensor.block, input_axes - 1
        if shape[last] % block:
            return from_hf_layer_tensor(name, tensor.dequantized(), shape, input_axes)
        block_shape = (*shape[:last], shape[last] // block, *shape[input_axes:])
        return Int8Blocks(from_hf_layer_tensor(name, tensor.values, shape, input_axes),
                          from_hf_layer_tensor(f"{name} (scales)", tensor.scales, block_shape, input_axes))
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

    read(name) returns one tensor, an array or `Int8Blocks` (raising a clear error when absent); convert(our flat
    name, array or Int8Blocks) turns each of our stacked tensors into a device array (dtype cast, placement) or a
    quantized one;
    on_tensor reports progress. Each of our arrays is filled in place in a fresh aligned host buffer
    (`aligned_empty`), one transformers tensor at a time, so that XLA:CPU can adopt it uncopied.
    """
    shapes = flatten_params(param_shapes(config))
    top, layers = declared(Params), declared(LayerParams)

    def tensor(name: str) -> np.ndarray | Int8Blocks:
        if not name.startswith("layers."):
            on_tensor(top[name]["hf_name"])
            return host_copy(checked(top[name]["hf_name"], read(top[name]["hf_name"]), shapes[name]))
        field = layers[name.removeprefix("layers.")]
        stacked = None
        for i in range(config.num_layers):
            hf_name = f"model.layers.{i}.{field['hf_name']}"
            on_tensor(hf_name)
            layer = from_hf_layer_tensor(hf_name, read(hf_name), shapes[name][1:], field["inputs"])
            stacked = stacked_like(layer, config.num_layers) if stacked is None else stacked
            put_layer(stacked, i, layer)
        return stacked

    return unflatten_params({name: convert(name, tensor(name)) for name in shapes})


def stacked_like(layer: np.ndarray | Int8Blocks, layers: int) -> np.ndarray | Int8Blocks:
    """Empty aligned host buffers (`aligned_empty`) for `layers` layers of a tensor like `layer`."""
    if isinstance(layer, Int8Blocks):
        return Int8Blocks(stacked_like(layer.values, layers), stacked_like(layer.scales, layers))
    return aligned_empty((layers, *layer.shape), layer.dtype)


def put_layer(stacked: np.ndarray | Int8Blocks, index: int, layer: np.ndarray | Int8Blocks) -> None:
    """stacked[index] = layer, in place (values and scales alike; a layer that came dequantized dequantizes them
    all: a GGUF may mix quantization types across layers)."""
    if isinstance(stacked, Int8Blocks):
        if not isinstance(layer, Int8Blocks):
            raise ValueError("a stacked tensor mixes Q8_0 layers with other types; load it without quantize")
        stacked.values[index], stacked.scales[index] = layer.values, layer.scales
    else:
        stacked[index] = layer.dequantized() if isinstance(layer, Int8Blocks) else layer


def aligned_empty(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialised C-contiguous host array whose data starts on a 64-byte boundary: XLA:CPU adopts such
    an array without copying it (`jax.device_put(array, may_alias=True)`), where numpy's own allocations
    (16-byte aligned) are copied."""
    dtype = np.dtype(dtype)
    raw = np.empty(math.prod(shape) * dtype.itemsize + HOST_ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % HOST_ALIGNMENT
    return raw[start:start + math.prod(shape) * dtype.itemsize].view(dtype).reshape(shape)


def host_copy(array: np.ndarray | Int8Blocks) -> np.ndarray | Int8Blocks:
    """`array` copied into an `aligned_empty` buffer (Int8Blocks: each part)."""
    if isinstance(array, Int8Blocks):
        return Int8Blocks(host_copy(array.values), host_copy(array.scales))
    copy = aligned_empty(array.shape, array.dtype)
    copy[...] = array
    return copy


def params_to_hf(params: Params, config: Config, block: int | None = None) -> dict[str, np.ndarray | Int8Blocks]:
    """The transformers state dict of these params (numpy, in the params' dtype). A quantized weight comes
    dequantized, or as Int8Blocks where its scales cover blocks of `block` contiguous inputs (a Q8_0 writer's)."""
    top, layers = declared(Params), declared(LayerParams)
    state = {}
    for name, weight in flatten_params(params).items():
        array = on_host(name, weight, block)
        if not name.startswith("layers."):
            state[top[name]["hf_name"]] = array
            continue
        field = layers[name.removeprefix("layers.")]
        for i in range(config.num_layers):
            hf_name = f"model.layers.{i}.{field['hf_name']}"
            if isinstance(array, Int8Blocks):
                state[hf_name] = Int8Blocks(to_hf_layer_tensor(array.values[i], field["inputs"]),
                                            to_hf_layer_tensor(array.scales[i], field["inputs"]))
            else:
                state[hf_name] = to_hf_layer_tensor(array[i], field["inputs"])
    return state


def on_host(name: str, weight, block: int | None = None) -> np.ndarray | Int8Blocks:
    """A stacked weight on the host: an array, a quantized one dequantized, or its values and scales (Int8Blocks,
    our layout) where its scales cover blocks of `block` contiguous inputs."""
    if block is not None and is_quantized(weight) and input_block(weight, contracted_axes(name)) == block:
        return Int8Blocks(np.asarray(weight.qvalue), np.asarray(weight.scale, np.float32))
    return np.asarray(dequantized(weight))


def flatten_params(tree: Params | LayerParams, prefix: str = "") -> dict[str, jax.Array]:
    """Params as one flat {name: array} in field order: "embed", "layers.attn_norm", ..., "final_norm".

    Unstacked layers (`unstack_layers`) are named per layer: "layers.0.attn_norm", ... Absent (None)
    fields are left out. These are the names of the exports that take plain containers (StableHLO,
    the generated JAX source, and their safetensors files).
    """
    flat = {}
    for field in dataclasses.fields(tree):
        value = getattr(tree, field.name)
        if field.name == "layers" and isinstance(value, tuple):  # unstacked layers (a shape is a tuple too)
            for i, layer in enumerate(value):
                flat |= flatten_params(layer, f"{prefix}{field.name}.{i}.")
        elif isinstance(value, LayerParams):
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


def unstack_layers(params: Params, views: bool = False) -> Params:
    """The same weights with `layers` as a tuple of per-layer LayerParams (no layer axis).
    views: per-layer views of the stacked arrays' memory (`layer_slices`; host memory only), else copies."""
    leaves, treedef = jax.tree.flatten(params.layers)
    slices = [layer_slices(leaf) if views else list(leaf) for leaf in leaves]
    count = len(slices[0])
    return params.replace(layers=tuple(jax.tree.unflatten(treedef, [s[i] for s in slices]) for i in range(count)))


def layer_slices(stacked: jax.Array) -> list[jax.Array]:
    """stacked [L, ...] in host memory (XLA:CPU) as L arrays [...], sharded as it is: views of each shard's
    memory (`np.asarray` exposes it and `device_put` may alias host memory)."""
    sharding = stacked.sharding
    if isinstance(sharding, jax.sharding.NamedSharding):  # the layer axis is never split
        sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*sharding.spec[1:]))
    shards = [(shard.device, np.asarray(shard.data)) for shard in stacked.addressable_shards]
    return [jax.make_array_from_single_device_arrays(
        stacked.shape[1:], sharding, [jax.device_put(view[layer], device, may_alias=True) for device, view in shards])
        for layer in range(stacked.shape[0])]


def count(params: Params | Mapping) -> int:
    """The number of scalars in a params tree."""
    return sum(x.size for x in jax.tree.leaves(params))
