"""`export.stablehlo`: the model as serialized `jax.export` programs, StableHLO text and a weights file.

The programs are `models.forward` itself, wrapped so that their arguments are plain containers and
a loader needs jax (with flatbuffers), numpy and safetensors, not linnet_jax:

    weights  {name: array}, the per-layer names of `models.params.flatten_params` ("embed", "layers.0.wq",
             ..., "layers.29.w_down", "final_norm"): the programs unroll the layers over arrays read
             where they lie, as generate's do on XLA:CPU, and any platform reads per-layer arrays as well
    cache    {"k.0", ..., "v.0", ...}, as `init_cache` makes them (manifest: shape, dtype, fill): max_len
             slots per row, a token written at the slot of its position
    prefill_T{T}: (weights, tokens [B, T] int32, positions [B, T] int32, cache) -> (logits [B, V] float32, cache)
             one per prompt bucket T; left padding has position -1; logits are the last position's
    decode:  (weights, token [B] int32, position [B] int32, cache) -> (logits [B, V] float32, cache)

The cache argument is donated. Weights are arguments, never constants, so each program is small.

A sharded model (`model.layout` set) exports programs for its mesh: every argument and result
carries its sharding (`sdy.sharding` in the .mlir, Shardy's form), the activations the layout's
constraints, and `nr_devices` is the mesh's size. The manifest then records the mesh (`"mesh"`:
axis names and sizes) and each argument's PartitionSpec as a JSON list (`"spec"` of every weight
and cache field; `"specs"` of each program's tokens, positions and logits), so that a loader can
rebuild a mesh of the same shape with `jax.make_mesh` and place each array with
`NamedSharding(mesh, PartitionSpec(*spec))`.

Every export carries that loader as `load.py`: a verbatim copy of `stablehlo_loader.py`, which imports no
linnet_jax.
"""

import dataclasses
import functools
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file
from tqdm import tqdm  # the text bar: tqdm.auto needs ipywidgets in notebooks

from linnet_jax.files import (MODEL_FILES, generation_config, prepare_target, staged, write_json,
                              write_model_files)
from linnet_jax.inputs import bucket
from linnet_jax.models import Config, KVCache, Params, forward, init_cache

from linnet_jax.models.params import flatten_params, unflatten_params, unstack_layers
from linnet_jax.sharding import Layout, host

MANIFEST = "manifest.json"
WEIGHTS = "weights.safetensors"
LOADER = "load.py"  # every export's copy of stablehlo_loader.py
# What an export writes, and so what an overwrite replaces (stale programs of other buckets included).
OUTPUTS = ("prefill_T*.bin", "prefill_T*.mlir", "decode.bin", "decode.mlir", WEIGHTS, MANIFEST, LOADER, *MODEL_FILES)


def stablehlo(model, out_dir, *, batch: int = 1, max_len: int = 1024, platforms=None, overwrite: bool = False,
              progress: bool = True) -> Path:
    """Export `model` as jax.export artifacts in the directory out_dir; returns its path.

    Writes prefill_T{T}.bin / .mlir for every prompt bucket T (powers of two from 16 below max_len),
    decode.bin / .mlir, weights.safetensors, manifest.json, the config and tokenizer files, and load.py (the
    standalone loader, `stablehlo_loader.py`).
    batch, max_len: the rows and cache slots the programs are compiled for.
    platforms: jax.export platforms, e.g. ("cpu", "cuda"); None: the default backend.
    overwrite: an existing non-empty out_dir is a FileExistsError unless True (then only OUTPUTS are replaced;
    everything is written under a temporary name first).
    A sharded model (`linnet_jax.load(..., mesh=...)`, `linnet_jax.shard`) exports programs for its mesh,
    with every argument's sharding, and records the mesh and PartitionSpecs in the manifest.
    """
    model = model.dequantized()  # a quantized model's weights are written as the floats they stand for
    config = model.config
    buckets = prompt_buckets(config, batch, max_len)
    target = prepare_target(out_dir, overwrite)
    with staged(target, OUTPUTS) as written:
        write_programs(model, written, buckets, batch, max_len, platforms, progress)
    return target


def write_programs(model, target: Path, buckets: list[int], batch: int, max_len: int, platforms,
                   progress: bool) -> None:
    """The programs, weights, manifest, config and tokenizer files, written into the directory target."""
    config = model.config
    layout = model.layout
    weights = save_weights(unstack_layers(model.params), target / WEIGHTS)
    cache = jax.eval_shape(lambda: cache_dict(init_cache(config, batch, max_len, model.params.dtype)))
    programs = {f"prefill_T{t}": ((batch, t), last_logits) for t in buckets} | {"decode": ((batch,), decode_step)}
    placed = None if layout is None else Placement.of(layout, config, batch, max_len)
    specs = {}
    for name, (token_shape, function) in tqdm(programs.items(), desc=f"Exporting {target.name}", unit="program",
                                              disable=not progress):
        ids = jax.ShapeDtypeStruct(token_shape, jnp.int32)  # the tokens' and the positions' shape
        if layout is None:
            program = jax.jit(functools.partial(function, config), donate_argnums=3)
            args = (spec_of(weights), ids, ids, cache)
        else:
            ids_sharding, logits_sharding = placed.ids(token_shape), placed.logits(batch, config.vocab_size)
            program = jax.jit(functools.partial(function, config, constrain=layout.constrain),
                              in_shardings=(placed.weights, ids_sharding, ids_sharding, placed.cache),
                              out_shardings=(logits_sharding, placed.cache), donate_argnums=3)
            sharded_ids = with_sharding(ids, ids_sharding)
            args = (spec_of(weights, placed.weights), sharded_ids, sharded_ids,
                    {field: with_sharding(spec, placed.cache[field]) for field, spec in cache.items()})
            specs[name] = {"tokens": spec_json(ids_sharding), "positions": spec_json(ids_sharding),
                           "logits": spec_json(logits_sharding)}
        exported = jax.export.export(program, platforms=platforms)(*args)
        (target / f"{name}.bin").write_bytes(exported.serialize())
        (target / f"{name}.mlir").write_text(exported.mlir_module())
    write_model_files(target, config, model.tokenizer)
    shutil.copyfile(Path(__file__).with_name("stablehlo_loader.py"), target / LOADER)
    contents = manifest(model, weights, cache, buckets, exported.platforms, batch, max_len)
    if placed is not None:
        add_sharding(contents, layout, placed, specs)
    write_json(target / MANIFEST, contents)


@dataclasses.dataclass(frozen=True)
class Placement:
    """A sharded export's argument shardings: weights by flat name, the cache by field, tokens by shape."""

    layout: Layout
    weights: dict[str, jax.sharding.NamedSharding]
    cache: dict[str, jax.sharding.NamedSharding]

    @classmethod
    def of(cls, layout: Layout, config: Config, batch: int, max_len: int) -> "Placement":
        stacked = layout.param_shardings(config)
        weights = {name: stacked[name] for name in stacked if not name.startswith("layers.")}
        for name, sharding in stacked.items():  # each layer's weight: the stacked one's sharding, less the layer axis
            if name.startswith("layers."):
                per_layer = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*sharding.spec[1:]))
                weights |= {f"layers.{i}.{name.removeprefix('layers.')}": per_layer for i in range(config.num_layers)}
        return cls(layout, weights, cache_dict(layout.cache_shardings(config, batch, max_len)))

    def ids(self, shape: tuple[int, ...]) -> jax.sharding.NamedSharding:
        """tokens and positions: [B, T] by ("batch", "seq"), or [B] by ("batch",) for decode."""
        return self.layout.sharding("tokens", ("batch", "seq")[:len(shape)], shape)

    def logits(self, batch: int, vocab: int) -> jax.sharding.NamedSharding:
        return self.layout.sharding("logits", ("batch", "vocab"), (batch, vocab))


def with_sharding(spec: jax.ShapeDtypeStruct, sharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(spec.shape, spec.dtype, sharding=sharding)


def spec_json(sharding: jax.sharding.NamedSharding) -> list:
    """A PartitionSpec as JSON: one entry per split dim, null (not split), a mesh axis or a list of them
    (`PartitionSpec(*spec)` takes it back)."""
    return [list(dim) if isinstance(dim, tuple) else dim for dim in sharding.spec]


def add_sharding(contents: dict, layout: Layout, placed: Placement, specs: dict[str, dict]) -> None:
    """The mesh, and every argument's and result's PartitionSpec, into the manifest."""
    contents["mesh"] = {"axis_names": list(layout.mesh.axis_names),
                        "axis_sizes": [int(layout.mesh.shape[a]) for a in layout.mesh.axis_names]}
    for tensor in contents["weights"]["tensors"]:
        tensor["spec"] = spec_json(placed.weights[tensor["name"]])
    for field, entry in contents["cache"].items():
        entry["spec"] = spec_json(placed.cache[field])
    for t, entry in contents["prefill"].items():
        entry["specs"] = specs[f"prefill_T{t}"]
    contents["decode"]["specs"] = specs["decode"]


def prompt_buckets(config: Config, batch: int, max_len: int) -> list[int]:
    """The prefill lengths: generate's buckets (powers of two from 16) below max_len, after checking the sizes."""
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be a positive int, got {batch!r}")
    if not isinstance(max_len, int) or not bucket(1) < max_len <= config.max_position_embeddings:
        raise ValueError(f"max_len must be an int in ({bucket(1)}, {config.max_position_embeddings}] (more than the "
                         f"smallest prompt bucket, at most the model's context), got {max_len!r}")
    buckets = [bucket(1)]
    while buckets[-1] * 2 < max_len:
        buckets.append(buckets[-1] * 2)
    return buckets


def save_weights(params: Params, path: Path) -> dict[str, np.ndarray]:
    """Write the params as one safetensors file of flat names; returns them, {name: numpy array}."""
    weights = {name: host(array) for name, array in flatten_params(params).items()}
    save_file(weights, path)
    return weights


def spec_of(arrays: dict, shardings: dict | None = None) -> dict[str, jax.ShapeDtypeStruct]:
    """Shapes and dtypes only (and shardings, by name, when given), for tracing."""
    shardings = shardings or {}
    return {name: jax.ShapeDtypeStruct(array.shape, array.dtype, sharding=shardings.get(name))
            for name, array in arrays.items()}


def cache_dict(cache: KVCache) -> dict[str, jax.Array]:
    """The cache as a plain dict of its fields, the per-layer keys and values as "k.0", "k.1", ..., "v.0", ..."""
    fields = {field.name: getattr(cache, field.name) for field in dataclasses.fields(cache)}
    return {f"{name}.{i}" if isinstance(value, tuple) else name: item
            for name, value in fields.items() for i, item in enumerate(value if isinstance(value, tuple) else [value])}


def dict_cache(arrays: dict[str, jax.Array]) -> KVCache:
    """The inverse of cache_dict."""
    def field(name: str):
        layers = sorted((int(key.split(".")[1]), array) for key, array in arrays.items() if key.startswith(f"{name}."))
        return tuple(array for _, array in layers) if name in ("k", "v") else arrays[name]

    return KVCache(**{f.name: field(f.name) for f in dataclasses.fields(KVCache)})


def last_logits(config: Config, weights: dict, tokens: jax.Array, positions: jax.Array,
                cache: dict, constrain=None) -> tuple[jax.Array, dict]:
    """forward over tokens [B, T] in plain containers: (float32 logits [B, V] at position T - 1, cache dict).
    constrain: forward's sharding constraints (`Layout.constrain`), None unsharded."""
    logits_at = jnp.full((tokens.shape[0],), tokens.shape[1] - 1, jnp.int32)
    logits, new_cache = forward(unflatten_params(weights), config, tokens, positions, dict_cache(cache), logits_at,
                                constrain)
    return logits[:, 0], cache_dict(new_cache)


def decode_step(config: Config, weights: dict, token: jax.Array, position: jax.Array,
                cache: dict, constrain=None) -> tuple[jax.Array, dict]:
    """One token per row: token, position [B] → (float32 logits [B, V], cache dict)."""
    return last_logits(config, weights, token[:, None], position[:, None], cache, constrain)


def manifest(model, weights: dict[str, np.ndarray], cache: dict[str, jax.ShapeDtypeStruct], buckets: list[int],
             platforms, batch: int, max_len: int) -> dict:
    """What a loader needs: the files, the weights in order, the cache, sizes, config and special ids."""
    return {
        "format": "linnet_jax.stablehlo",
        "jax_version": jax.__version__,
        "platforms": list(platforms),
        "batch": batch,
        "max_len": max_len,
        "buckets": buckets,
        "prefill": {str(t): {"serialized": f"prefill_T{t}.bin", "mlir": f"prefill_T{t}.mlir"} for t in buckets},
        "decode": {"serialized": "decode.bin", "mlir": "decode.mlir"},
        "weights": {"file": WEIGHTS, "tensors": [
            {"name": name, "shape": list(array.shape), "dtype": str(array.dtype)} for name, array in weights.items()]},
        "cache": cache_manifest(model.config, cache),
        "capacity": {"slots_per_row": max_len, "rule": (
            f"each row holds positions 0 .. {max_len - 1}: a token at position p is written to slot p (a position "
            f"of -1 writes nothing), and attends to slots 0 .. p, which must hold the row's earlier tokens")},
        "config": model.config.to_hf(),
        "generation_config": generation_config(model.config, model.tokenizer),
    }


def cache_manifest(config: Config, cache: dict[str, jax.ShapeDtypeStruct]) -> dict[str, dict]:
    """Each cache array's shape, dtype and the value init_cache fills it with (a loader makes it with numpy)."""
    one_slot = cache_dict(init_cache(config, 1, 1, next(iter(cache.values())).dtype))
    return {name: {"shape": list(spec.shape), "dtype": str(spec.dtype),
                   "fill": np.asarray(one_slot[name]).flat[0].item()} for name, spec in cache.items()}
