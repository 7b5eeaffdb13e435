"""The files a model lives in, read and written by the loaders (`load`, `checkpoint`) and the exporters alike.

Reading: JSON objects, config.json and tensors checked finite, each error naming the file. Writing: a target
that is refused when something is there (unless overwrite=True), written under a temporary name and renamed
into place; the JSON and tokenizer files that a Hugging Face directory, an Orbax checkpoint and the other
exports all carry.
"""

import contextlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from linnet_jax.models import Config

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
# What write_model_files writes: every exporter that calls it replaces these in its target.
MODEL_FILES = ("config.json", "generation_config.json", *TOKENIZER_FILES)
INDEX_FILE = "model.safetensors.index.json"  # a sharded safetensors checkpoint's weight map


def read_json(path: Path) -> dict:
    """A file holding one JSON object, or a ValueError naming it."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from error
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got a {type(value).__name__}")
    return value


def write_json(path: Path, value: dict) -> None:
    """`value` as indented JSON in `path`."""
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def read_config(path: Path) -> Config:
    """The Config in a config.json file, or an error naming the file and the field."""
    if not path.exists():
        raise FileNotFoundError(f"{path.parent}: no config.json (expected a Hugging Face model directory)")
    hf_config = read_json(path)
    try:
        return Config.from_hf(hf_config)
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from error


def finite(name: str, tensor: np.ndarray, source: Path) -> np.ndarray:
    """The tensor, or a ValueError naming it when it holds a NaN or an infinity (one vectorized pass over it,
    as llama.cpp's tensor validation)."""
    bad = ~np.isfinite(tensor)
    if bad.any():
        first = np.flatnonzero(bad)[0]
        raise ValueError(f"{source}: tensor {name!r} holds {int(bad.sum())} non-finite value(s) (the first, "
                         f"{tensor.flat[first]}, at flat index {first}); the weights are corrupt")
    return tensor


def prepare_target(path, overwrite: bool = False) -> Path:
    """`path` as a Path whose parent directory exists, refusing to clobber existing output.

    An existing file, or an existing non-empty directory, is a FileExistsError naming it unless
    overwrite=True (then the exporter writes over it). An empty directory is fine.
    """
    target = Path(path).expanduser()
    occupied = target.is_file() or (target.is_dir() and any(target.iterdir()))
    if occupied and not overwrite:
        raise FileExistsError(f"{target} already exists and is not empty; pass overwrite=True to write over it")
    target.parent.mkdir(parents=True, exist_ok=True)
    return target


@contextlib.contextmanager
def staged(target: Path, replaces: tuple[str, ...] | None = None) -> Iterator[Path]:
    """Write `target` (from prepare_target) under a temporary name in its parent directory, then rename it
    into place, so that the target is either complete or untouched.

    Yields the path to write: `<parent>/.<name>.partial-<random>/<name>` (the same name, so progress bars
    and messages read as usual). replaces None: the target is one file, replaced whole. replaces a tuple
    of glob patterns: the target is a directory (yielded created); when it already exists, only the entries matching
    these patterns (what the exporter writes, stale shards included) are removed, then every entry written
    is renamed into it, and anything else there (another model's files) stays. On any error the
    temporary directory is removed and the target is left as it was; an OSError (a full disk, say) is
    raised again naming the target.
    """
    if replaces is None and target.is_dir():
        raise IsADirectoryError(f"{target} is a directory; this export writes one file (e.g. {target / 'model.gguf'})")
    if replaces is not None and target.is_file():
        raise NotADirectoryError(f"{target} is a file; this export writes a directory")
    staging = target.parent / f".{target.name}.partial-{uuid.uuid4().hex[:8]}"
    try:
        staging.mkdir()
        written = staging / target.name
        if replaces is not None:
            written.mkdir()
        yield written
        if replaces is not None and target.is_dir():
            _replace_entries(written, target, replaces)
        else:
            os.replace(written, target)
    except OSError as error:
        raise OSError(error.errno, f"could not write {target}: {error.strerror or error}; it was left as it was") \
            from error
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _replace_entries(written: Path, target: Path, replaces: tuple[str, ...]) -> None:
    """Remove target's entries matching `replaces`, then rename every entry of `written` into target."""
    for pattern in replaces:
        for stale in target.glob(pattern):
            if stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale)
            else:
                stale.unlink()
    for entry in written.iterdir():
        os.replace(entry, target / entry.name)


def generation_config(config: Config, tokenizer) -> dict:
    """generation_config.json's fields: every eos id (the config's, then the tokenizer's), bos and pad ids."""
    eos = list(dict.fromkeys([*config.eos_token_ids, *(tokenizer.eos_token_ids if tokenizer else ())]))
    bos = config.bos_token_id if config.bos_token_id is not None else getattr(tokenizer, "bos_token_id", None)
    pad = config.pad_token_id if config.pad_token_id is not None else getattr(tokenizer, "pad_token_id", None)
    fields = {"bos_token_id": bos, "eos_token_id": eos[0] if len(eos) == 1 else (eos or None), "pad_token_id": pad}
    return {key: value for key, value in fields.items() if value is not None}


def write_model_files(directory: Path, config: Config, tokenizer) -> None:
    """config.json (transformers' keys, legacy and v5), generation_config.json and, when there is a
    tokenizer, its files (tokenizer.json, tokenizer_config.json, special_tokens_map.json, chat_template.jinja)."""
    directory.mkdir(parents=True, exist_ok=True)
    write_json(directory / "config.json", config.to_hf())
    write_json(directory / "generation_config.json", generation_config(config, tokenizer))
    if tokenizer is not None:
        tokenizer.save(directory)
