"""Helpers shared by the exporters: preparing an output path, and the JSON and tokenizer files that a
Hugging Face directory and an Orbax checkpoint both carry."""

import json
from pathlib import Path

from linnet_jax.models import Config

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


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


def generation_config(config: Config, tokenizer) -> dict:
    """generation_config.json's fields: every eos id (the config's, then the tokenizer's), bos and pad ids."""
    eos = list(dict.fromkeys([*config.eos_token_ids, *(tokenizer.eos_token_ids if tokenizer else ())]))
    bos = config.bos_token_id if config.bos_token_id is not None else getattr(tokenizer, "bos_token_id", None)
    pad = config.pad_token_id if config.pad_token_id is not None else getattr(tokenizer, "pad_token_id", None)
    fields = {"bos_token_id": bos, "eos_token_id": eos[0] if len(eos) == 1 else (eos or None), "pad_token_id": pad}
    return {key: value for key, value in fields.items() if value is not None}


def write_json(path: Path, value: dict) -> None:
    """`value` as indented JSON in `path`."""
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_model_files(directory: Path, config: Config, tokenizer) -> None:
    """config.json (transformers' keys, legacy and v5), generation_config.json and, when there is a
    tokenizer, its files (tokenizer.json, tokenizer_config.json, special_tokens_map.json, chat_template.jinja).
    Tokenizer files an earlier export left are removed first, so none outlives an overwrite."""
    directory.mkdir(parents=True, exist_ok=True)
    for stale in TOKENIZER_FILES:
        (directory / stale).unlink(missing_ok=True)
    write_json(directory / "config.json", config.to_hf())
    write_json(directory / "generation_config.json", generation_config(config, tokenizer))
    if tokenizer is not None:
        tokenizer.save(directory)
