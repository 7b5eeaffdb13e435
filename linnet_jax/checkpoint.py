"""Orbax checkpoints of a Model: `save(model, directory)`, read back by `linnet_jax.load(directory)`.

    directory/
      linnet_jax.json          the marker: {"format": "linnet_jax.orbax", "version": 1}
      params/                  the Params pytree, written by orbax-checkpoint's StandardCheckpointer
      config.json              the config (transformers' keys), generation_config.json
      tokenizer.json, ...      the tokenizer files, when the model has a tokenizer
"""

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from linnet_jax.export._common import prepare_target, write_json, write_model_files
from linnet_jax.model import Model
from linnet_jax.models import Config, param_shapes
from linnet_jax.models.params import flatten_params, unflatten_params
from linnet_jax.sharding import placement

MARKER = "linnet_jax.json"
FORMAT = "linnet_jax.orbax"
VERSION = 1
PARAMS = "params"


def save(model: Model, directory, *, overwrite: bool = False) -> Path:
    """Save `model` as an Orbax checkpoint directory that `linnet_jax.load` reads back bit for bit.

    overwrite: an existing non-empty directory is a FileExistsError unless True. Returns the path.
    """
    import orbax.checkpoint as ocp

    target = prepare_target(directory, overwrite).absolute()
    target.mkdir(exist_ok=True)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(target / PARAMS, model.params, force=overwrite)
    write_model_files(target, model.config, model.tokenizer)
    write_json(target / MARKER, {"format": FORMAT, "version": VERSION})
    return target


def is_checkpoint(directory: Path) -> bool:
    """Whether `directory` is one `save` wrote (it holds the marker file)."""
    return (directory / MARKER).is_file()


def load_checkpoint(directory: Path, dtype: str | None = None, layout=None) -> Model:
    """The Model in a directory `save` wrote; dtype None restores the params as saved, a dtype casts them;
    a `sharding.Layout` places them on its mesh."""
    import orbax.checkpoint as ocp

    from linnet_jax.tokenizer import Tokenizer

    directory = directory.absolute()
    marker = json.loads((directory / MARKER).read_text())
    if marker.get("format") != FORMAT or marker.get("version") != VERSION:
        raise ValueError(f"{directory / MARKER}: expected format {FORMAT!r} version {VERSION}, got {marker}; "
                         "it was written by another linnet_jax version")
    saved = Config.from_hf(json.loads((directory / "config.json").read_text()))
    # numpy leaves: Orbax restores them on the host, and `placement` puts them where load() puts any
    # checkpoint's (uncommitted), so the compiled programs are shared with models loaded otherwise.
    target = jax.tree.map(lambda shape: np.empty(shape, jnp.dtype(saved.dtype)), param_shapes(saved),
                          is_leaf=lambda x: isinstance(x, tuple))
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(directory / PARAMS, target)
    config = dataclasses.replace(saved, dtype=dtype or saved.dtype)
    convert = placement(config, config.dtype, layout)
    params = unflatten_params({name: convert(name, array) for name, array in flatten_params(restored).items()})
    return Model(config=config, params=params, tokenizer=Tokenizer.from_hf_dir(directory), layout=layout)
