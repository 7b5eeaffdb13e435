"""GGUF (llama.cpp's file format) to and from transformers-named float32 state dicts.

    read_gguf(path)                      -> (hf_config, state, metadata)
    open_gguf(path)                      -> (hf_config, tensors read on access, metadata)
    write_gguf(path, hf_config, state)   -> path

`state` maps transformers tensor names to float32 numpy arrays in transformers' shapes:

    model.embed_tokens.weight                      [V, D]
    model.layers.{i}.self_attn.q_proj.weight       [H*Dh, D]     (+ .bias [H*Dh])
    model.layers.{i}.self_attn.{k,v}_proj.weight   [Hkv*Dh, D]   (+ .bias [Hkv*Dh])
    model.layers.{i}.self_attn.o_proj.weight       [D, H*Dh]
    model.layers.{i}.self_attn.{q,k}_norm.weight   [Dh]          (qwen3)
    model.layers.{i}.mlp.{gate,up}_proj.weight     [F, D]
    model.layers.{i}.mlp.down_proj.weight          [D, F]
    model.layers.{i}.{input,post_attention}_layernorm.weight  [D]
    model.norm.weight                              [D]
    lm_head.weight                                 [V, D]        (absent when tied)

V vocab, D hidden size, F intermediate size, H / Hkv query / key-value heads, Dh head size.

GGUF lists a tensor's dimensions fastest-varying first, the reverse of numpy: a GGUF
`[D, V]` tensor is the numpy `[V, D]` array, and a GGUF row (quantization block axis) is
the last numpy axis. llama.cpp's converter also reorders the rows of llama's q/k
projections within each head, from transformers' half-split RoPE layout
(r0 r1 .. i0 i1 ..) to the interleaved one (r0 i0 r1 i1 ..); reading undoes it, writing
redoes it. qwen2/qwen3 use the half-split layout in llama.cpp too, so they are stored as is.
"""

from __future__ import annotations

import pathlib
import re
from collections.abc import Mapping

import gguf
import numpy as np
from tqdm import tqdm  # the text bar: tqdm.auto needs ipywidgets in notebooks

from linnet_jax.models.params import Int8Blocks

__all__ = ["read_gguf", "open_gguf", "write_gguf", "ARCHITECTURES", "READABLE_TYPES", "WRITABLE_TYPES"]

# GGUF `general.architecture` -> transformers model class.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

_Q = gguf.GGMLQuantizationType
READABLE_TYPES = tuple(_Q[name] for name in (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"))
# tensor_type -> the `general.file_type` llama.cpp records for it.
WRITABLE_TYPES = {
    "F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
    "BF16": gguf.LlamaFileType.MOSTLY_BF16, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
}

# GGUF tensor name -> transformers tensor name; N stands for the layer index.
_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.N.attn_norm.weight": "model.layers.N.input_layernorm.weight",
    "blk.N.ffn_norm.weight": "model.layers.N.post_attention_layernorm.weight",
    "blk.N.attn_q_norm.weight": "model.layers.N.self_attn.q_norm.weight",
    "blk.N.attn_k_norm.weight": "model.layers.N.self_attn.k_norm.weight",
    "blk.N.ffn_gate.weight": "model.layers.N.mlp.gate_proj.weight",
    "blk.N.ffn_up.weight": "model.layers.N.mlp.up_proj.weight",
    "blk.N.ffn_down.weight": "model.layers.N.mlp.down_proj.weight",
    "blk.N.attn_output.weight": "model.layers.N.self_attn.o_proj.weight",
    "blk.N.attn_output.bias": "model.layers.N.self_attn.o_proj.bias",
    **{f"blk.N.attn_{x}.{kind}": f"model.layers.N.self_attn.{x}_proj.{kind}"
       for x in "qkv" for kind in ("weight", "bias")},
}
_TO_GGUF = {hf: gguf_name for gguf_name, hf in _TO_HF.items()}


def _rename(name: str, table: dict[str, str]) -> str | None:
    """`name` through `table`, with the layer index abstracted as N; None when unknown."""
    match = re.fullmatch(r"(blk|model\.layers)\.(\d+)\.(.+)", name)
    if match is None:
        return table.get(name)
    prefix, layer, rest = match.groups()
    renamed = table.get(f"{prefix}.N.{rest}")
    return None if renamed is None else renamed.replace(".N.", f".{layer}.")


def _interleave_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """transformers' half-split rows -> llama.cpp's interleaved rows, per head.

    w: [n_heads*Dh, ...] (a q/k weight [n_heads*Dh, D] or bias [n_heads*Dh]); within each head the
    row order goes from (r0 .. r_{Dh/2-1}, i0 .. i_{Dh/2-1}) to (r0 i0 r1 i1 ..)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _split_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The inverse of `_interleave_rope_rows`: llama.cpp's interleaved rows -> half-split rows."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope_heads(hf_name: str, hf_config: dict) -> int | None:
    """How many heads a llama q/k projection (weight or bias) has; None for every other tensor."""
    if hf_config["model_type"] != "llama":
        return None
    if ".self_attn.q_proj." in hf_name:
        return hf_config["num_attention_heads"]
    if ".self_attn.k_proj." in hf_name:
        return hf_config["num_key_value_heads"]
    return None


def _float32_value(x: float) -> float:
    """A float32 metadata value as the shortest decimal that round-trips (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(x)))


def _metadata(reader: gguf.GGUFReader) -> dict:
    """The key/value fields as plain Python values; GGUF's own header counts left out."""
    metadata = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        if field.types == [gguf.GGUFValueType.FLOAT32]:
            value = _float32_value(value)
        metadata[key] = value
    return metadata


def _open(path: pathlib.Path) -> tuple[gguf.GGUFReader, dict]:
    """The reader and the metadata of the GGUF file at `path`, or a clear error."""
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if len(magic) < 4:
        raise ValueError(f"{path} is not a readable GGUF file: it is truncated ({len(magic)} bytes)")
    if magic != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file: it starts with {magic!r}, not b'GGUF'")
    try:
        reader = gguf.GGUFReader(path)
        return reader, _metadata(reader)
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not a readable GGUF file: it is truncated or corrupt ({e})") from e


def _required(metadata: dict, key: str, path: pathlib.Path):
    if key not in metadata:
        raise ValueError(f"{path}: required GGUF metadata key {key!r} is missing")
    return metadata[key]


def _architecture(metadata: dict, path: pathlib.Path) -> str:
    arch = _required(metadata, "general.architecture", path)
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path}: architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
    return arch


def _hf_config(metadata: dict, arch: str, tensor_shapes: dict[str, tuple[int, ...]], path: pathlib.Path) -> dict:
    """transformers config.json fields from GGUF metadata; `tensor_shapes` maps HF names to numpy shapes."""

    def required(key: str):
        return _required(metadata, key, path)

    heads = required(f"{arch}.attention.head_count")
    config = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": tensor_shapes["model.embed_tokens.weight"][0],
        "hidden_size": required(f"{arch}.embedding_length"),
        "intermediate_size": required(f"{arch}.feed_forward_length"),
        "num_hidden_layers": required(f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": metadata.get(f"{arch}.attention.head_count_kv", heads),
        "rms_norm_eps": required(f"{arch}.attention.layer_norm_rms_epsilon"),
        "rope_theta": metadata.get(f"{arch}.rope.freq_base", 10000.0),
        "max_position_embeddings": required(f"{arch}.context_length"),
        "tie_word_embeddings": "lm_head.weight" not in tensor_shapes,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if f"{arch}.attention.key_length" in metadata:
        config["head_dim"] = metadata[f"{arch}.attention.key_length"]
    if arch != "qwen2":  # qwen2 always has q/k/v biases; llama and qwen3 say so in their config
        config["attention_bias"] = "model.layers.0.self_attn.q_proj.bias" in tensor_shapes
    scaling = metadata.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": required(f"{arch}.rope.scaling.factor")}
    elif scaling != "none":
        raise ValueError(f"{path}: rope scaling {scaling!r} is not supported; supported: none, linear")
    for key in ("bos_token_id", "eos_token_id", "padding_token_id"):
        if f"tokenizer.ggml.{key}" in metadata:
            config[key.replace("padding", "pad")] = metadata[f"tokenizer.ggml.{key}"]
    return config


def read_gguf(path, *, progress: bool = True) -> tuple[dict, dict[str, np.ndarray], dict]:
    """Read a GGUF file as (hf_config, state, metadata).

    hf_config: transformers config.json fields (architectures, model_type, sizes, rope_theta,
      rope_scaling for linear scaling, tie_word_embeddings, bos/eos/pad ids, torch_dtype "float32").
    state: transformers names -> float32 arrays in transformers' shapes (see the module docstring),
      every tensor dequantized, llama's q/k row permutation undone.
    metadata: every GGUF key/value field as a plain Python value (strings, lists, numbers).

    Raises FileNotFoundError for a missing file, ValueError naming the file for a file that is not
    GGUF or is truncated, an unsupported architecture, quant type or tensor, or a missing key.
    """
    hf_config, tensors, metadata = open_gguf(path)
    names = tqdm(tensors, desc=f"Reading {pathlib.Path(path).name}", unit="tensor", disable=not progress)
    return hf_config, {name: tensors[name] for name in names}, metadata


class GGUFTensors(Mapping):
    """A GGUF file's tensors by transformers name, each dequantized to float32 (a fresh array, nothing
    keeping the memmap open) only when it is read: a loader holds one tensor at a time, not the file."""

    def __init__(self, tensors: dict, shapes: dict[str, tuple[int, ...]], hf_config: dict):
        self._tensors, self._shapes, self._hf_config = tensors, shapes, hf_config

    def __getitem__(self, hf_name: str) -> np.ndarray:
        tensor = self._tensors[hf_name]
        w = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(self._shapes[hf_name])
        if (heads := _rope_heads(hf_name, self._hf_config)) is not None:
            w = _split_rope_rows(w, heads)
        return np.array(w, dtype=np.float32)

    def q8_0(self, hf_name: str) -> Int8Blocks:
        """A Q8_0 tensor's blocks as stored (fresh arrays): int8 values in transformers' shape and a float32 scale
        (the file's float16) for each block of 32 along the last axis."""
        tensor, shape = self._tensors[hf_name], self._shapes[hf_name]
        if tensor.tensor_type != _Q.Q8_0:
            raise ValueError(f"tensor {hf_name!r} is {tensor.tensor_type.name}, not Q8_0")
        block, size = gguf.GGML_QUANT_SIZES[_Q.Q8_0]
        raw = np.asarray(tensor.data).reshape(-1, size)  # each block: a float16 scale, then its int8 values
        scales = raw[:, :2].copy().view(np.float16).astype(np.float32).reshape(*shape[:-1], shape[-1] // block)
        values = raw[:, 2:].copy().view(np.int8).reshape(shape)
        if (heads := _rope_heads(hf_name, self._hf_config)) is not None:
            values, scales = _split_rope_rows(values, heads), _split_rope_rows(scales, heads)
        return Int8Blocks(values, scales)

    def q8_0_names(self) -> set[str]:
        """The transformers names of the Q8_0 tensors whose every layer is Q8_0 (what quantize reads as stored: a
        stacked weight is all blocks or all floats)."""
        fields: dict[str, list[str]] = {}
        for name in self._tensors:
            fields.setdefault(re.sub(r"^model\.layers\.\d+\.", "", name), []).append(name)
        return {name for names in fields.values() if all(self._tensors[n].tensor_type == _Q.Q8_0 for n in names)
                for name in names}

    def __iter__(self):
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def open_gguf(path) -> tuple[dict, GGUFTensors, dict]:
    """`read_gguf` without reading the tensors: (hf_config, tensors dequantized on access, metadata).
    The same checks and errors, all raised here."""
    path = pathlib.Path(path)
    reader, metadata = _open(path)
    arch = _architecture(metadata, path)
    tensors = {}
    for tensor in reader.tensors:
        hf_name = _rename(tensor.name, _TO_HF)
        if hf_name is None:
            raise ValueError(f"{path}: tensor {tensor.name!r} has no transformers equivalent here")
        if tensor.tensor_type not in READABLE_TYPES:
            raise ValueError(
                f"{path}: tensor {tensor.name!r} has quant type {tensor.tensor_type.name}, which cannot be read; "
                f"supported: {', '.join(t.name for t in READABLE_TYPES)}")
        tensors[hf_name] = tensor
    shapes = {name: tuple(int(d) for d in reversed(t.shape)) for name, t in tensors.items()}
    if "model.embed_tokens.weight" not in shapes:
        raise ValueError(f"{path}: tensor 'token_embd.weight' is missing")
    hf_config = _hf_config(metadata, arch, shapes, path)
    return hf_config, GGUFTensors(tensors, shapes, hf_config), metadata


def _q8_0_bytes(values: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Q8_0's bytes for int8 values [rows, n] and their scales [rows, n / 32]: each block its float16 scale, then
    its 32 values ([rows, n / 32 * 34] uint8, what gguf's writer takes)."""
    rows, blocks = scales.shape
    scale_bytes = scales.astype(np.float16).reshape(rows, blocks, 1).view(np.uint8)
    value_bytes = values.reshape(rows, blocks, -1).view(np.uint8)
    return np.concatenate([scale_bytes, value_bytes], axis=-1).reshape(rows, -1)


def _add_metadata_value(writer: gguf.GGUFWriter, key: str, value) -> None:
    """Add one key with the GGUF type llama.cpp uses for it: ints as uint32 (int32 when negative),
    floats as float32, lists typed by their first item (int32 / float32 / string / bool)."""
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int) and value >= 0:
        writer.add_uint32(key, value)
    elif isinstance(value, int):
        writer.add_int32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, (list, tuple)):
        writer.add_array(key, list(value))
    else:
        raise ValueError(f"GGUF metadata key {key!r}: cannot write a value of type {type(value).__name__}")


def write_gguf(path, hf_config: dict, state: dict[str, np.ndarray | Int8Blocks], *, tensor_type: str = "F32",
               tokenizer_metadata: dict | None = None, progress: bool = True) -> pathlib.Path:
    """Write a transformers-named state dict (see the module docstring) and its config as GGUF.

    Matrices are stored as `tensor_type` (one of WRITABLE_TYPES, quantized by gguf.quants; a matrix
    whose row length is not a multiple of the quant block size falls back to F16, as llama.cpp does);
    1-D tensors (norms, biases) stay F32. llama's q/k rows are permuted to llama.cpp's layout. A tensor given as
    Int8Blocks of 32 is written as they are under Q8_0 (its scales as the file's float16), else dequantized first.
    `tokenizer_metadata` (tokenizer.* keys, e.g. from `Tokenizer.gguf_metadata()`) is added as is.
    lm_head.weight is left out when tie_word_embeddings is true (when the config does not say, the
    embeddings count as tied exactly when state has no lm_head.weight). Returns the path written.
    """
    path = pathlib.Path(path)
    if tensor_type not in WRITABLE_TYPES:
        raise ValueError(f"tensor_type {tensor_type!r} is not supported; supported: {', '.join(WRITABLE_TYPES)}")

    def required(key: str):
        if key not in hf_config:
            raise ValueError(f"hf_config is missing required key {key!r} (writing {path})")
        return hf_config[key]

    arch = required("model_type")
    if arch not in ARCHITECTURES:
        raise ValueError(f"architecture {arch!r} cannot be written to GGUF; supported: {', '.join(ARCHITECTURES)}")
    hidden, heads = required("hidden_size"), required("num_attention_heads")
    kv_heads = hf_config.get("num_key_value_heads") or heads
    head_dim = hf_config.get("head_dim") or hidden // heads
    tied = hf_config.get("tie_word_embeddings", "lm_head.weight" not in state)
    # transformers v5 writes rope_parameters, earlier versions rope_theta / rope_scaling.
    rope = hf_config.get("rope_parameters") or {}
    scaling = hf_config.get("rope_scaling") or rope
    scaling_kind = scaling.get("rope_type", scaling.get("type", "default"))
    if scaling_kind not in ("default", "linear"):
        raise ValueError(f"rope scaling {scaling_kind!r} cannot be written to GGUF; supported: linear")
    config = {**hf_config, "num_key_value_heads": kv_heads}

    writer = gguf.GGUFWriter(path, arch)
    if name := hf_config.get("_name_or_path"):
        writer.add_name(str(name))
    writer.add_context_length(required("max_position_embeddings"))
    writer.add_embedding_length(hidden)
    writer.add_block_count(required("num_hidden_layers"))
    writer.add_feed_forward_length(required("intermediate_size"))
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(required("rms_norm_eps"))
    writer.add_rope_freq_base(hf_config.get("rope_theta") or rope.get("rope_theta", 10000.0))
    writer.add_vocab_size(required("vocab_size"))
    if "head_dim" in hf_config:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    if scaling_kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(scaling["factor"])
    writer.add_file_type(WRITABLE_TYPES[tensor_type])
    if tensor_type not in ("F32", "F16", "BF16"):
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    tokenizer_metadata = dict(tokenizer_metadata or {})
    for key, gguf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                          ("pad_token_id", "padding_token_id")):
        value = hf_config.get(key)
        if isinstance(value, list):  # several eos ids: GGUF holds one
            value = value[0] if value else None
        if value is not None:
            tokenizer_metadata.setdefault(f"tokenizer.ggml.{gguf_key}", value)
    for key, value in tokenizer_metadata.items():
        _add_metadata_value(writer, key, value)

    if not tied and "lm_head.weight" not in state:
        raise ValueError("state has no 'lm_head.weight' but hf_config says tie_word_embeddings is false")
    names = [name for name in state if not (tied and name == "lm_head.weight")]
    for hf_name in tqdm(names, desc=f"Writing {path.name}", unit="tensor", disable=not progress):
        gguf_name = _rename(hf_name, _TO_GGUF)
        if gguf_name is None:
            raise ValueError(f"tensor {hf_name!r} has no GGUF equivalent (writing {path})")
        value, n = state[hf_name], _rope_heads(hf_name, config)
        if isinstance(value, Int8Blocks) and tensor_type == "Q8_0" and value.block == gguf.GGML_QUANT_SIZES[_Q.Q8_0][0]:
            values, scales = (value.values, value.scales) if n is None else (
                _interleave_rope_rows(value.values, n), _interleave_rope_rows(value.scales, n))
            writer.add_tensor(gguf_name, _q8_0_bytes(values, scales), raw_dtype=_Q.Q8_0)
            continue
        w = value.dequantized() if isinstance(value, Int8Blocks) else np.asarray(value, dtype=np.float32)
        if n is not None:
            w = _interleave_rope_rows(w, n)
        qtype = _Q.F32 if w.ndim == 1 else _Q[tensor_type]
        if w.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
            qtype = _Q.F16
        writer.add_tensor(gguf_name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
