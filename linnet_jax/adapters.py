"""LoRA adapters for serving: PEFT adapter directories read back (`read_peft`: what `export.peft` writes and vLLM
serves) and checked against the model, and the adapter tables the decode programs take (`models.lora.LoraTable`):
`generate`'s, made for one call, and the engine's `AdapterTable`, whose entries change while serving without
compiling anything (its shape never changes: every entry holds all seven projections at the table's rank,
zero-padded).

Axis names: N table entries, L layers, R rank, I and O a projection's input and output axes (models/lora.py).
"""

import functools
import hashlib
import itertools
import json
import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file

from linnet_jax.decode import TRACES
from linnet_jax.inputs import RequestError
from linnet_jax.loaded import Model
from linnet_jax.models.config import Config
from linnet_jax.models.lora import (FIELDS, TARGETS, Lora, LoraTable, check_shapes, lora_config_of, lora_shapes,
                                     split_shape)
from linnet_jax.models.params import LayerParams, declared, from_hf_layer_tensor

DEFAULT_MAX_LORAS = 4  # adapters an engine holds at once unless told otherwise
DEFAULT_MAX_LORA_RANK = 16  # the largest adapter rank an engine takes unless told otherwise
PREFIX = "base_model.model."  # PEFT's prefix of the base model's tensor names
WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"  # a PEFT adapter directory's files
MAX_CONFIG_BYTES = 1 << 20  # the largest adapter_config.json read (PEFT writes about 1 KB)
# The most any adapter may change one of the model's weights, scale × rank × max|A| × max|B| (a bound on every
# entry of scale·A·B): a trained adapter's changes are far below 1, and larger ones overflow float16's activations,
# or float32's (one weight of 3e38 makes every logit NaN), giving garbage or ids outside the vocabulary.
MAX_WEIGHT_CHANGE = 1e4
MAX_SCALE = 1e3  # the largest |lora_alpha / r| (|lora_alpha / sqrt(r)| with use_rslora) taken; PEFT's are about 1 to 4
# An adapter's name is a model id (it is a request's `model`): letters, digits, '_', '.', '-', one '/' between
# two parts, at most 128 characters, and no '..'.
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?")
MAX_NAME_LENGTH = 128
# adapter_config.json settings this reader does not implement -> the values that mean "not used".
UNSUPPORTED = {"use_dora": (False, None), "rank_pattern": ({}, None), "alpha_pattern": ({}, None),
               "modules_to_save": (None, []), "bias": ("none", None), "layers_to_transform": (None,),
               "fan_in_fan_out": (False, None)}


def peft_name(field: str, layer: int, part: str) -> str:
    """PEFT's name of one layer's lora_A or lora_B (part "A" or "B") of weight `field` (wq, ..., w_down)."""
    module = declared(LayerParams)[field]["hf_name"].removesuffix(".weight")
    return f"{PREFIX}model.layers.{layer}.{module}.lora_{part}.weight"


# --- reading a PEFT directory ---------------------------------------------------------------------------------

def peft_settings(settings: dict, where: str) -> tuple[int, float, tuple[str, ...]]:
    """adapter_config.json's rank, scale (alpha / r, or alpha / sqrt(r) with use_rslora) and targets (HF module
    names, canonical order); a ValueError naming the setting that is wrong or not implemented."""
    if settings.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type is {settings['peft_type']!r}; only LORA adapters are served")
    for key, unused in UNSUPPORTED.items():
        if settings.get(key) not in unused:
            raise ValueError(f"{where}: {key}={settings[key]!r} is not supported (a plain LoRA only)")
    rank, alpha = settings.get("r"), settings.get("lora_alpha", settings.get("r"))
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{where}: r must be a positive int, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise ValueError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    targets = settings.get("target_modules")
    targets = list(TARGETS) if targets == "all-linear" else targets
    if not isinstance(targets, list) or not targets:
        raise ValueError(f"{where}: target_modules must be a list of module names or 'all-linear', got {targets!r}")
    if unknown := [t for t in targets if t not in TARGETS]:
        raise ValueError(f"{where}: target_modules {unknown} are not projections of this model (expected a subset "
                         f"of {list(TARGETS)})")
    scale = alpha / (math.sqrt(rank) if settings.get("use_rslora") else rank)
    return rank, scale, tuple(t for t in TARGETS if t in targets)


def check_adapter_name(name) -> str:
    """The name, or a ValueError unless it is a model id (ADAPTER_NAME, at most MAX_NAME_LENGTH characters)."""
    if not isinstance(name, str) or len(name) > MAX_NAME_LENGTH or not ADAPTER_NAME.fullmatch(name) or ".." in name:
        shown = name if not isinstance(name, str) else name[:40] + "..." * (len(name) > 40)
        raise ValueError(f"an adapter's name must be a model id: letters, digits, '_', '.', '-' and one '/', at most "
                         f"{MAX_NAME_LENGTH} characters, no '..'; got {shown!r}")
    return name


def unreadable(path, file: str, error: Exception) -> ValueError:
    """A ValueError saying that a PEFT directory's `file` cannot be read, why (without the absolute path that an
    OSError's text holds)."""
    reason = error.strerror if isinstance(error, OSError) and error.strerror else f"{type(error).__name__}: {error}"
    return ValueError(f"LoRA adapter {str(path)!r}: cannot read PEFT's {file} there ({reason})")


def read_settings(path) -> dict:
    """The JSON object of a PEFT adapter directory's adapter_config.json; a ValueError naming the file when it
    cannot be read, is over MAX_CONFIG_BYTES, is nested too deeply to read or is not an object."""
    file = Path(path) / CONFIG
    try:
        with open(file, "rb") as handle:
            text = handle.read(MAX_CONFIG_BYTES + 1)
        if len(text) > MAX_CONFIG_BYTES:
            raise ValueError(f"it holds more than {MAX_CONFIG_BYTES} bytes")
        settings = json.loads(text)
    except RecursionError as error:
        raise unreadable(path, CONFIG, ValueError("nested too deeply; expected a flat JSON object")) from error
    except (OSError, ValueError) as error:
        raise unreadable(path, CONFIG, error) from error
    if not isinstance(settings, dict):
        raise ValueError(f"LoRA adapter {str(path)!r}: PEFT's {CONFIG} there is not a JSON object")
    return settings


def peft_rank(path) -> int:
    """The rank of a PEFT adapter directory's adapters, from its adapter_config.json alone (checked as `read_peft`
    checks it), so that an adapter is refused before any model is loaded."""
    return peft_settings(read_settings(path), str(Path(path) / CONFIG))[0]


def read_peft(path, config: Config) -> Lora:
    """The adapters of a PEFT adapter directory (adapter_config.json, adapter_model.safetensors) for a model of
    `config`, stacked on [L] as training makes them. A ValueError names the file, the setting or the tensor that
    does not fit: an adapter of another base model has tensors of other shapes or layers."""
    directory = Path(path)
    settings = read_settings(directory)
    rank, scale, targets = peft_settings(settings, str(directory / CONFIG))
    try:
        tensors = load_file(directory / WEIGHTS)
    except (OSError, ValueError, SafetensorError) as error:
        raise unreadable(path, WEIGHTS, error) from error
    base = settings.get("base_model_name_or_path")
    a, b = {}, {}
    try:
        for field in (TARGETS[t] for t in targets):
            inputs, outputs = split_shape(config, field)
            a[field] = np.stack([from_hf_layer_tensor(name, tensor(tensors, name, directory), (*inputs, rank),
                                                      len(inputs))
                                 for name in (peft_name(field, i, "A") for i in range(config.num_layers))])
            b[field] = np.stack([from_hf_layer_tensor(name, tensor(tensors, name, directory), (rank, *outputs), 1)
                                 for name in (peft_name(field, i, "B") for i in range(config.num_layers))])
        if extra := sorted(set(tensors) - {peft_name(f, i, p) for f in a for i in range(config.num_layers)
                                           for p in "AB"}):
            raise ValueError(f"tensor {extra[0]!r} is not one of this model's adapters ({config.num_layers} "
                             f"layers, target_modules {list(targets)})")
    except ValueError as error:
        raise ValueError(f"LoRA adapter {str(path)!r} does not fit this model: {error} (an adapter of another base "
                         f"model? adapter_config.json names base {base!r})") from error
    return Lora(a=a, b=b, scale=scale)


def tensor(tensors: dict[str, np.ndarray], name: str, directory: Path) -> np.ndarray:
    if name not in tensors:
        raise ValueError(f"{directory / WEIGHTS} has no tensor {name!r}")
    return tensors[name]


def adapters_of(source, config: Config) -> Lora:
    """A PEFT directory's adapters (`read_peft`), or a Lora checked against the model's shapes; either checked
    for finite weights of a sane size (`check_weights`)."""
    if isinstance(source, Lora):
        check_shapes(config, source)
        lora = source
    elif isinstance(source, (str, Path)):
        lora = read_peft(source, config)
    else:
        raise TypeError(f"a LoRA adapter is a PEFT directory's path or a Lora, got {type(source).__name__}")
    check_weights(lora, f"LoRA adapter {str(source)!r}" if isinstance(source, (str, Path)) else "the LoRA adapter")
    return lora


def check_weights(lora: Lora, where: str) -> None:
    """A ValueError naming what is wrong unless the scale is at most MAX_SCALE in size and every adapter weight is
    finite and changes the model's weights by at most MAX_WEIGHT_CHANGE (scale × rank × max|A| × max|B|, a bound
    on every entry of scale·A·B), as the base model's weights are checked for finite values."""
    if not abs(lora.scale) <= MAX_SCALE:
        raise ValueError(f"{where}: its scale (lora_alpha / r) is {lora.scale:.3g}; expected at most {MAX_SCALE:g} "
                         f"in size")
    for field in lora.a:
        a, b = np.asarray(lora.a[field], np.float32), np.asarray(lora.b[field], np.float32)
        if not (np.isfinite(a).all() and np.isfinite(b).all()):
            raise ValueError(f"{where}: its {field} weights hold NaN or infinite values; expected finite weights")
        change = abs(lora.scale) * a.shape[-1] * float(np.abs(a).max(initial=0)) * float(np.abs(b).max(initial=0))
        if not change <= MAX_WEIGHT_CHANGE:
            raise ValueError(f"{where}: its {field} weights can change the model's by up to {change:.3g} (scale × "
                             f"rank × max|A| × max|B|), above {MAX_WEIGHT_CHANGE:g}; expected a trained adapter's "
                             f"small changes")


# --- tables ---------------------------------------------------------------------------------------------------

def padded(config: Config, lora: Lora | None, rank: int, fields: tuple[str, ...], dtype
           ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], float]:
    """One table entry on the host: a [L, *I, rank] and b [L, rank, *O] for each of `fields` (the adapter's
    zero-padded to `rank`, zeros where it has no such weight or there is no adapter), and its scale."""
    a, b, dtype = {}, {}, jnp.dtype(dtype)
    for field in fields:
        shapes = lora_shapes(config, field, rank)
        a[field], b[field] = np.zeros(shapes["a"], dtype), np.zeros(shapes["b"], dtype)
        if lora is not None and field in lora.a:
            r = lora.a[field].shape[-1]
            a[field][..., :r], b[field][:, :r] = np.asarray(lora.a[field]), np.asarray(lora.b[field])
    return a, b, 0.0 if lora is None else lora.scale


def host_table(config: Config, adapters: list[Lora | None], rank: int, fields: tuple[str, ...], dtype) -> LoraTable:
    """A table of the entries `adapters` (None: all zeros, as entry 0 is for the base), on the host."""
    entries = [padded(config, lora, rank, fields, dtype) for lora in adapters]
    return LoraTable(a={f: np.stack([a[f] for a, _, _ in entries]) for f in fields},
                     b={f: np.stack([b[f] for _, b, _ in entries]) for f in fields},
                     scale=np.asarray([scale for _, _, scale in entries], np.float32))


def placed(model: Model, table: LoraTable) -> LoraTable:
    """A host table on the model's device, or replicated on its mesh."""
    return jax.device_put(table, model.params.sharding if model.layout is None else model.layout.replicated())


@functools.partial(jax.jit, donate_argnums=(0,))
def put_entry(table: LoraTable, entry: jax.Array, a: dict, b: dict, scale: jax.Array) -> LoraTable:
    """Entry `entry` of the table replaced by a [L, *I, R], b [L, R, *O] (each of its weights) and scale."""
    TRACES["put_lora"] += 1
    return table.replace(a={f: table.a[f].at[entry].set(a[f]) for f in table.a},
                         b={f: table.b[f].at[entry].set(b[f]) for f in table.b},
                         scale=table.scale.at[entry].set(scale))


def call_table(model: Model, lora, batch: int) -> tuple[LoraTable | None, list[int]]:
    """`generate`'s table and each row's entry: lora is one adapter (a PEFT directory's path or a Lora) for every
    prompt, or one per prompt (None: the base). The table holds each distinct adapter once, on the targets any of
    them adapts, at their largest rank; its entries are padded to a power of two, so calls with one to three
    adapters of one rank share their programs."""
    if lora is None:
        return None, [0] * batch
    per_row = list(lora) if isinstance(lora, (list, tuple)) else [lora] * batch
    if len(per_row) != batch:
        raise RequestError("lora", f"lora must be one adapter or one per prompt ({batch}), got {len(per_row)}")
    keys = [None if source is None else id(source) if isinstance(source, Lora) else str(Path(source).resolve())
            for source in per_row]
    distinct = dict.fromkeys(k for k in keys if k is not None)
    sources = {key: source for key, source in zip(keys, per_row)}
    try:
        adapters = [adapters_of(sources[key], model.config) for key in distinct]
    except (ValueError, TypeError) as error:
        raise RequestError("lora", str(error)) from error
    if not adapters:
        return None, [0] * batch
    rank = max(lora_config_of(adapter).rank for adapter in adapters)
    fields = tuple(field for field in FIELDS if any(field in adapter.a for adapter in adapters))
    size = 1 << len(adapters).bit_length()  # a power of two > the adapters: entry 0 and theirs
    entries = [None, *adapters] + [None] * (size - 1 - len(adapters))
    index = {key: i + 1 for i, key in enumerate(distinct)}
    table = host_table(model.config, entries, rank, fields, model.config.dtype)
    return placed(model, table), [index.get(key, 0) for key in keys]


class AdapterTable:
    """The engine's adapters: a table of max_loras + 1 entries (entry 0 the base model) of rank max_lora_rank on
    all seven projections, on the model's devices, and the names it serves. Not thread-safe: the engine calls it
    under its lock, and `put` on its scheduler thread, between dispatches.

    An entry is held from `reserve` to `release`, and after that for as long as a request that uses it is queued
    or running (the engine's `in_use`): unloading an adapter fails nothing in flight. Each load has its own
    prefix-cache key, so prompts' cached keys and values are never shared across adapters or loads."""

    def __init__(self, model: Model, max_loras: int, max_lora_rank: int):
        for name, value in (("max_loras", max_loras), ("max_lora_rank", max_lora_rank)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.config, self.rank, self.dtype = model.config, int(max_lora_rank), model.config.dtype
        self.table = placed(model, host_table(model.config, [None] * (max_loras + 1), self.rank, tuple(FIELDS),
                                              self.dtype))
        self.names: dict[str, int] = {}  # served name -> entry
        self.sources: dict[str, str | None] = {}  # served name -> its PEFT directory (None: given as a Lora)
        self.held: list[str | None] = [None] * (max_loras + 1)  # entry -> the name loading or loaded there
        self.keys: list[bytes] = [b""] * (max_loras + 1)  # entry -> its load's prefix-cache key
        self.loads = itertools.count(1)

    @property
    def max_loras(self) -> int:
        return len(self.held) - 1

    def read(self, source) -> Lora:
        """The adapters of `source` (a PEFT directory's path or a Lora), checked against the model and the table's
        rank: a RequestError naming `lora_path` when they do not fit."""
        try:
            lora = adapters_of(source, self.config)
        except (ValueError, TypeError) as error:
            raise RequestError("lora_path", str(error)) from error
        if (rank := lora_config_of(lora).rank) > self.rank:
            named = f" {str(source)!r}" if isinstance(source, (str, Path)) else ""
            raise RequestError("lora_path", f"LoRA adapter{named} has rank {rank}, above max_lora_rank={self.rank}")
        return lora

    def reserve(self, name: str, in_use: set[int]) -> int:
        """A free entry held for `name` (a RequestError naming `lora_name` when the name is taken or the table is
        full); in_use: the entries that queued and running requests use."""
        try:
            check_adapter_name(name)
        except ValueError as error:
            raise RequestError("lora_name", str(error)) from error
        if name in self.held:
            raise RequestError("lora_name", f"an adapter named {name!r} is already loaded")
        entry = next((e for e in range(1, len(self.held)) if self.held[e] is None and e not in in_use), None)
        if entry is None:
            raise RequestError("lora_name", f"the adapter table is full: max_loras={self.max_loras} adapters are "
                                            f"loaded or still serving requests; unload one first")
        self.held[entry] = name
        self.keys[entry] = hashlib.blake2b(f"{name}\0{next(self.loads)}".encode()).digest()  # 64 bytes: a blake2b key
        return entry

    def put(self, entry: int, lora: Lora | None) -> None:
        """The table's entry `entry` replaced by `lora`'s adapters (None: zeros). Runs `put_entry`, one program."""
        a, b, scale = padded(self.config, lora, self.rank, tuple(self.table.a), self.dtype)
        self.table = put_entry(self.table, np.int32(entry), a, b, np.float32(scale))

    def publish(self, name: str, entry: int, source) -> None:
        """Serve the adapters put in `entry` as `name`."""
        self.names[name] = entry
        self.sources[name] = str(source) if isinstance(source, (str, Path)) else None

    def release(self, name: str) -> None:
        """Stop serving `name` (its entry is free once no request uses it); a RequestError naming `lora_name` when no
        adapter of that name is loaded."""
        if name not in self.names:
            raise RequestError("lora_name", f"no adapter named {name!r} is loaded (loaded: {sorted(self.names)})")
        entry = self.names.pop(name)
        del self.sources[name]
        self.held[entry] = None

    def entry(self, name: str | None) -> tuple[int, bytes]:
        """The entry and prefix-cache key of adapter `name` (None: the base); a RequestError naming `lora` when no
        adapter of that name is loaded."""
        if name is None:
            return 0, b""
        if name not in self.names:
            raise RequestError("lora", f"no adapter named {name!r} is loaded (loaded: {sorted(self.names)})")
        return self.names[name], self.keys[self.names[name]]
