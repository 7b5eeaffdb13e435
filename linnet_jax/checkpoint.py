"""Orbax checkpoints of a Model: `save(model, directory)`, read back by `linnet_jax.load(directory)`.

    directory/
      linnet_jax.json          the marker: {"format": "linnet_jax.orbax", "version": 2, "params": {name:
                               {"shape", "dtype", "sha256"}}}, each array as saved, checked at load
      params/                  the Params pytree, written by orbax-checkpoint's StandardCheckpointer
      config.json              the config (transformers' keys), generation_config.json
      tokenizer.json, ...      the tokenizer files, when the model has a tokenizer
"""

import dataclasses
import hashlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from linnet_jax.files import (MODEL_FILES, finite, prepare_target, read_config, read_json, staged, write_json,
                              write_model_files)
from linnet_jax.loaded import Model
from linnet_jax.models import Config, param_shapes
from linnet_jax.models.params import flatten_params, param_axes, unflatten_params
from linnet_jax.sharding import host, placement

MARKER = "linnet_jax.json"
FORMAT = "linnet_jax.orbax"
VERSION = 2
PARAMS = "params"
OUTPUTS = (PARAMS, MARKER, *MODEL_FILES)
# The config.json field that sizes each logical axis of the params.
AXIS_FIELDS = {"vocab": "vocab_size", "embed": "hidden_size", "layers": "num_hidden_layers",
               "heads": "num_attention_heads", "kv_heads": "num_key_value_heads", "head_dim": "head_dim",
               "mlp": "intermediate_size"}


def save(model: Model, directory, *, overwrite: bool = False) -> Path:
    """Save `model` as an Orbax checkpoint directory that `linnet_jax.load` reads back bit for bit.

    Each array's shape, dtype and sha256 go in the marker file, and load checks them. Everything is written
    under a temporary name first. overwrite: an existing non-empty directory is a FileExistsError unless True
    (then only OUTPUTS are replaced). Returns the path. A quantized model is refused: save the float model, and
    load it with quantize="int8".
    """
    import orbax.checkpoint as ocp

    if model.quantization:
        raise ValueError(f"save keeps float weights; this model's are {model.quantization}: save the model loaded "
                         f"without quantize, and pass quantize={model.quantization!r} to load")
    target = prepare_target(directory, overwrite).absolute()
    with staged(target, OUTPUTS) as written:
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(written / PARAMS, model.params)
        write_model_files(written, model.config, model.tokenizer)
        records = {name: record(host(array)) for name, array in flatten_params(model.params).items()}
        write_json(written / MARKER, {"format": FORMAT, "version": VERSION, "params": records})
    return target


def record(array: np.ndarray) -> dict:
    """What the marker keeps of one saved array: its shape, dtype and the sha256 of its bytes."""
    digest = hashlib.sha256(np.ascontiguousarray(array).view(np.uint8)).hexdigest()
    return {"shape": list(array.shape), "dtype": array.dtype.name, "sha256": digest}


def is_checkpoint(directory: Path) -> bool:
    """Whether `directory` is one `save` wrote (it holds the marker file)."""
    return (directory / MARKER).is_file()


def check_config(directory: Path, config: Config, records: dict[str, dict]) -> None:
    """A ValueError naming the config.json field (or dtype) that does not match the arrays saved."""
    config_file = directory / "config.json"
    expected = flatten_params(param_shapes(config))
    if set(expected) != set(records):
        raise ValueError(f"{config_file} does not match the saved params: it implies {sorted(expected)}, the "
                         f"checkpoint holds {sorted(records)}")
    axes = param_axes(config)
    for name, shape in expected.items():
        saved = tuple(records[name]["shape"])
        if saved != shape:
            fields = sorted({AXIS_FIELDS[axis] for axis, a, b in zip(axes[name], saved, shape) if a != b})
            raise ValueError(f"{config_file}: {', '.join(fields)} do(es) not match the saved params: {name!r} was "
                             f"saved with shape {saved}, the config implies {shape}")
        if records[name]["dtype"] != config.dtype:
            raise ValueError(f"{config_file}: dtype {config.dtype!r} does not match the saved params: {name!r} was "
                             f"saved as {records[name]['dtype']}")


def load_checkpoint(directory: Path, dtype: str | None = None, layout=None) -> Model:
    """The Model in a directory `save` wrote; dtype None restores the params as saved, a dtype casts them;
    a `sharding.Layout` places them on its mesh. The config must match the arrays saved, and every array
    restored must match its recorded shape, dtype and sha256 (corrupt bytes are a ValueError) and be finite."""
    import orbax.checkpoint as ocp

    from linnet_jax.tokenizer import Tokenizer

    directory = directory.absolute()
    marker = read_json(directory / MARKER)
    if marker.get("format") != FORMAT or marker.get("version") != VERSION:
        raise ValueError(f"{directory / MARKER}: expected format {FORMAT!r} version {VERSION}, got "
                         f"{ {key: marker.get(key) for key in ('format', 'version')} }; it was written by another "
                         "linnet_jax version")
    saved = read_config(directory / "config.json")
    check_config(directory, saved, marker["params"])
    # numpy leaves: Orbax restores them on the host, and `placement` puts them where load() puts any
    # checkpoint's (uncommitted), so the compiled programs are shared with models loaded otherwise.
    target = jax.tree.map(lambda shape: np.empty(shape, jnp.dtype(saved.dtype)), param_shapes(saved),
                          is_leaf=lambda x: isinstance(x, tuple))
    with ocp.StandardCheckpointer() as checkpointer:
        restored = flatten_params(checkpointer.restore(directory / PARAMS, target))
    for name, array in restored.items():
        if record(array) != marker["params"][name]:
            raise ValueError(f"{directory}: the saved params {name!r} do not match the shape, dtype and sha256 "
                             "recorded when they were saved; the checkpoint is corrupt")
        finite(name, array, directory)
    config = dataclasses.replace(saved, dtype=dtype or saved.dtype)
    convert = placement(config, config.dtype, layout)
    params = unflatten_params({name: convert(name, array) for name, array in restored.items()})
    return Model(config=config, params=params, tokenizer=Tokenizer.from_hf_dir(directory), layout=layout)
