"""The files a model lives in, read and written by the loaders (`load`, `checkpoint`) and the exporters alike.

Reading: JSON objects, config.json and tensors checked finite, each error naming the file. Writing: a target
that is refused when anything is there (unless overwrite=True, and then only a regular file or a directory is
written over), written under a temporary name and renamed into place, a failure being an OSError naming it; the JSON and tokenizer files that a Hugging Face directory, an Orbax checkpoint and the other
exports all carry.
"""

import contextlib
import json
import os
import re
import shutil
import stat
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from linnet_jax.models import Config

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
# What write_model_files writes: every exporter that calls it replaces these in its target.
MODEL_FILES = ("config.json", "generation_config.json", *TOKENIZER_FILES)
INDEX_FILE = "model.safetensors.index.json"  # a sharded safetensors checkpoint's weight map
# The kinds of file lstat tells apart; an export writes over the first two only.
FILE_KINDS = ((stat.S_ISREG, "regular file"), (stat.S_ISDIR, "directory"), (stat.S_ISLNK, "symbolic link"),
              (stat.S_ISFIFO, "named pipe (FIFO)"), (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
              (stat.S_ISSOCK, "socket"))
# How the writers' libraries name an operating-system error in theirs: safetensors' SafetensorError "(os error
# 27)", Orbax's (TensorStore's) ValueError "[os_error_code='27']".
OS_ERROR_CODE = re.compile(r"\(os error (\d+)\)|\[os_error_code='(\d+)'\]")


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


def file_kind(path: Path) -> str | None:
    """What is at `path`, its last component not followed: None (nothing), "regular file", "directory",
    "symbolic link", "named pipe (FIFO)", "character device", "block device", "socket" or "special file"."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return None
    return next((kind for test, kind in FILE_KINDS if test(mode)), "special file")


def prepare_target(path, overwrite: bool = False) -> Path:
    """`path` as a Path whose parent directory exists, refusing to clobber anything there.

    Anything at the path (a file, a non-empty directory, a symbolic link, a device, a named pipe, a socket) is
    a FileExistsError naming it unless overwrite=True; even then, only a regular file or a directory is
    written over. An empty directory is fine.
    """
    target = Path(path).expanduser()
    kind = file_kind(target)
    if kind not in (None, "regular file", "directory"):
        raise FileExistsError(f"{target} already exists and is a {kind}; an export writes over a regular file or "
                              "a directory only (with overwrite=True), never over anything else")
    if (kind == "regular file" or (kind == "directory" and any(target.iterdir()))) and not overwrite:
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
    temporary directory is removed and the target is left as it was; an OSError (a full disk, say), or a
    writer library's error that stands for one (see `os_error`), is raised as an OSError naming the target.
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
    except Exception as error:
        cause = os_error(error)
        if cause is None:
            raise
        raise OSError(cause.errno, f"could not write {target}: {cause.strerror or cause}; it was left as it was") \
            from error
    finally:
        remove_tree(staging)


def os_error(error: Exception) -> OSError | None:
    """The OSError that `error` is, or that a writer library's error names by its code (see OS_ERROR_CODE:
    a file too large, a full disk); None for any other error."""
    if isinstance(error, OSError):
        return error
    match = OS_ERROR_CODE.search(str(error))
    if match is None:
        return None
    code = int(match.group(1) or match.group(2))
    return OSError(code, os.strerror(code))


def remove_tree(path: Path, seconds: float = 10.0) -> None:
    """Remove a directory tree, again until it is gone (for at most `seconds`): after a failed save, a writer's
    threads (Orbax's, TensorStore's) may still be adding files to it."""
    deadline = time.monotonic() + seconds
    while True:
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.lexists(path) or time.monotonic() > deadline:
            return
        time.sleep(0.05)


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
