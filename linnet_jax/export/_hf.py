"""`export.hf`: a Model as a Hugging Face checkpoint directory that transformers (and vLLM, SGLang,
TGI) loads: config.json, generation_config.json, safetensors (sharded past a size, with
model.safetensors.index.json) and the tokenizer files."""

import dataclasses
import re
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tqdm import tqdm  # the text bar: tqdm.auto needs ipywidgets in notebooks

from linnet_jax.files import INDEX_FILE, MODEL_FILES, prepare_target, staged, write_json, write_model_files
from linnet_jax.models import params_to_hf
from linnet_jax.models.config import DTYPES

SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
SINGLE_FILE = "model.safetensors"
# What an export writes, and so what an overwrite replaces: nothing else in the directory is touched.
OUTPUTS = (SINGLE_FILE, "model-*-of-*.safetensors", INDEX_FILE, *MODEL_FILES)


def hf(model, out_dir, *, dtype=None, max_shard_size="5GB", overwrite: bool = False, progress: bool = True) -> Path:
    """Write `model` as a Hugging Face checkpoint directory; returns its path.

    dtype: None keeps the params' dtype; "float32", "bfloat16" or "float16" converts the weights.
    max_shard_size: bytes per safetensors file, an int or a string such as "5GB", "100KB", "2GiB";
      past it the weights are split into model-0000i-of-0000n.safetensors plus an index.
    overwrite: an existing non-empty out_dir is a FileExistsError unless True; then only what an export
      writes there (OUTPUTS: weights, shards, index, config and tokenizer files) is replaced, so no stale
      shard survives and other files stay. Everything is written under a temporary name first.
    Tied embeddings stay tied: no lm_head tensor is written.
    """
    model = model.dequantized()  # a quantized model's weights are written as the floats they stand for
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; expected None or one of {DTYPES}")
    limit = parse_size(max_shard_size)
    target = prepare_target(out_dir, overwrite)
    config = dataclasses.replace(model.config, dtype=dtype or model.config.dtype)
    state = params_to_hf(model.params, model.config)
    with staged(target, OUTPUTS) as written, tqdm(total=len(state), desc=f"Writing {target.name}", unit="tensor",
                                                  disable=not progress) as bar:
        _write_shards(written, state, np.dtype(config.dtype), limit, bar)
        write_model_files(written, config, model.tokenizer)
    return target


def parse_size(size) -> int:
    """A byte count from an int or a string like "5GB" (powers of 1000) or "2GiB" (powers of 1024)."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(size).upper()) if isinstance(size, str) else None
    if match is None or match.group(2) not in SIZE_UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"max_shard_size {size!r} is not a size; expected a positive int of bytes or a string "
                         "such as '5GB', '500MB', '100KB' or '2GiB'")
    return int(float(match.group(1)) * SIZE_UNITS[match.group(2)])


def _shards(sizes: dict[str, int], limit: int) -> list[list[str]]:
    """Tensor names packed in order into groups of at most `limit` bytes (a larger tensor gets a group of its own)."""
    shards, total = [[]], 0
    for name, size in sizes.items():
        if shards[-1] and total + size > limit:
            shards.append([])
            total = 0
        shards[-1].append(name)
        total += size
    return shards


def _write_shards(directory: Path, state: dict[str, np.ndarray], dtype: np.dtype, limit: int, bar) -> None:
    """`state` cast to dtype as one model.safetensors, or as numbered shards plus model.safetensors.index.json,
    with {"format": "pt"} metadata; one shard's cast copies in memory at a time."""
    sizes = {name: tensor.size * dtype.itemsize for name, tensor in state.items()}
    shards = _shards(sizes, limit)
    files = [SINGLE_FILE] if len(shards) == 1 else [
        f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    for file, names in zip(files, shards):
        tensors = {}
        for name in names:
            tensors[name] = state[name].astype(dtype, copy=False)
            bar.update()
        save_file(tensors, directory / file, metadata={"format": "pt"})
    if len(shards) > 1:
        weight_map = {name: file for file, names in zip(files, shards) for name in names}
        write_json(directory / INDEX_FILE, {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map})
