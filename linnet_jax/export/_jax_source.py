"""`export.jax_source`: the model as one readable, standalone `model.py` (jax, numpy, safetensors) + weights.

The file is assembled from linnet_jax's own definitions, never a kept copy: `OPS_SOURCES` and
`MODEL_SOURCES` name the ops, the decoder functions and the generate helpers, copied with
`inspect.getsource` under their module's docstring; the flax pytree dataclasses become
`jax.tree_util.register_dataclass` dataclasses (same source, another decorator); the config becomes
a class of constants. Only the loading and greedy generation at the end (`TAIL`) are written here.
The result is compiled, and every global name it reads must be defined in it, before it is written.
"""

import builtins
import dataclasses
import importlib
import inspect
import symtable
from pathlib import Path
from types import ModuleType

from linnet_jax._version import __version__
from linnet_jax.export._stablehlo import WEIGHTS, save_weights
from linnet_jax.files import MODEL_FILES, generation_config, prepare_target, staged, write_model_files
from linnet_jax.models import Config

MODULE = "model.py"

# What model.py is made of, in order: each module's docstring, then the named definitions from it.
# The ops come first (the config needs RopeScaling), then the inlined config, then the model.
OPS_SOURCES: dict[str, list[str]] = {
    "linnet_jax.ops.rope": ["ROPE_TYPES", "RopeScaling", "inverse_frequencies", "_llama3_frequencies", "apply_rope"],
    "linnet_jax.ops.norm": ["rms_norm"],
    "linnet_jax.ops.attention": ["attention_mask", "CAUSAL_BLOCK", "attention", "spanned_attention", "key_spans",
                                 "seen_slots", "masked_attention", "einsum_products"],
    "linnet_jax.ops.mlp": ["swiglu"],
}
MODEL_SOURCES: dict[str, list[str]] = {
    "linnet_jax.models.params": ["weight", "LayerParams", "Params", "unflatten_params", "unstack_layers",
                                 "layer_slices"],
    "linnet_jax.models.lora": ["Lora", "lora_term", "LoraTable", "table_term"],
    "linnet_jax.models.decoder": ["KVCache", "init_cache", "project_qkv", "write_slots", "update_cache",
                                  "take_rows", "attended", "residual_block", "decoder_layer", "forward",
                                  "layer_params"],
    "linnet_jax.inputs": ["MIN_BUCKET", "bucket"],
}

IMPORTS = """\
import dataclasses
import functools
import math
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file
"""

# linnet_jax.ops.quantized (which needs qwix) as the decoder calls it, for the float weights an export writes.
FLOAT_PRODUCTS = '''
class quantized:
    """The decoder's products and embedding lookup: jax.numpy's, as this file's weights are float."""

    einsum = staticmethod(jnp.einsum)

    @staticmethod
    def einsums(einsum, x: jax.Array, products) -> list[jax.Array]:
        return [einsum(spec, x, w) for spec, w in products]

    @staticmethod
    def take_rows(table: jax.Array, ids: jax.Array) -> jax.Array:
        return jnp.take(table, ids, axis=0)
'''

FLAX_DATACLASS = "@flax.struct.dataclass\n"
PYTREE_DATACLASS = "@jax.tree_util.register_dataclass\n@dataclasses.dataclass(frozen=True)\n"
REPLACE_METHOD = '''
    def replace(self, **changes):
        """A copy with some fields changed (what flax.struct dataclasses offer)."""
        return dataclasses.replace(self, **changes)
'''

TAIL = '''
def load_weights(path=None) -> Params:
    """Params from a safetensors file of flat names ("embed", "layers.wq", ...); default: WEIGHTS beside this file."""
    arrays = load_file(Path(__file__).with_name(WEIGHTS) if path is None else path)
    return unflatten_params({name: jnp.asarray(array) for name, array in arrays.items()})


@functools.partial(jax.jit, donate_argnums=3)
def _step(params: Params, tokens: jax.Array, positions: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
    logits_at = jnp.full((tokens.shape[0],), tokens.shape[1] - 1)
    logits, cache = forward(params, CONFIG, tokens, positions, cache, logits_at)
    return logits[:, 0], cache


def step(params: Params, tokens, positions, cache: KVCache) -> tuple[jax.Array, KVCache]:
    """Feed tokens [B, T] at positions [B, T] through the cache: (float32 logits [B, V] of the last, cache).

    A token at position p goes to the cache's slot p and attends to slots 0 .. p (a position of -1 is padding).
    A ValueError when an id is outside the vocabulary, or a position past the cache's slots (it is full)."""
    tokens, positions = np.asarray(tokens), np.asarray(positions)
    if tokens.size and not (0 <= tokens.min() and tokens.max() < CONFIG.vocab_size):
        raise ValueError(f"token ids must be in [0, {CONFIG.vocab_size}), got {tokens.min()}..{tokens.max()}")
    if positions.size and positions.max() >= cache.max_len:
        raise ValueError(f"the cache is full: its {cache.max_len} slots per row hold positions 0 .. "
                         f"{cache.max_len - 1}, got position {positions.max()} (make a larger cache with init_cache)")
    return _step(params, jnp.asarray(tokens, jnp.int32), jnp.asarray(positions, jnp.int32), cache)


def generate(params: Params, token_ids: list[int], max_new_tokens: int, stop_ids=EOS_TOKEN_IDS,
             max_len: int | None = None) -> list[int]:
    """Greedy continuation of one prompt: up to max_new_tokens new ids, ending before the first stop id.
    max_len: the cache's slots (at least the prompt plus max_new_tokens: slot p holds position p); default a bucket
    that fits.

    The layers run unrolled over per-layer weights (`unstack_layers`), as linnet_jax decodes on XLA:CPU, and
    the tokens after the first come from one loop on the device (`_greedy`), as linnet_jax's `generate`.
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if not token_ids or len(token_ids) + max_new_tokens > CONFIG.max_position_embeddings:
        raise ValueError(f"a prompt of {len(token_ids)} ids plus {max_new_tokens} new tokens does not fit the "
                         f"context of {CONFIG.max_position_embeddings} positions (nor may the prompt be empty)")
    prompt_len = bucket(len(token_ids))
    tokens, positions = np.zeros((1, prompt_len), np.int32), np.full((1, prompt_len), -1, np.int32)
    tokens[0, prompt_len - len(token_ids):] = token_ids  # left-padded: the logits of the last column are the prompt's
    positions[0, prompt_len - len(token_ids):] = np.arange(len(token_ids))  # padding at -1 is written nowhere
    params = unstack_layers(params, views=True)
    need = len(token_ids) + max_new_tokens
    if max_len is not None and (isinstance(max_len, bool) or not isinstance(max_len, (int, np.integer))
                                or max_len < need):
        raise ValueError(f"max_len must be an int of at least {need} (the prompt's {len(token_ids)} ids plus "
                         f"{max_new_tokens} new tokens), got {max_len!r}")
    cache = init_cache(CONFIG, 1, bucket(prompt_len + max_new_tokens) if max_len is None else int(max_len),
                       params.embed.dtype)
    logits, cache = step(params, tokens, positions, cache)
    new = [int(jnp.argmax(logits[0]))]
    if max_new_tokens > 1 and new[-1] not in stop_ids:
        stops = jnp.asarray(list(stop_ids) or [-1], jnp.int32)  # -1: no id is ever chosen
        more, count = _greedy(params, jnp.int32(new[-1]), jnp.int32(len(token_ids)), cache, stops,
                              jnp.int32(max_new_tokens - 1), bucket(max_new_tokens - 1))
        new += np.asarray(more)[:int(count)].tolist()
    return new[:-1] if new[-1] in stop_ids else new


@functools.partial(jax.jit, static_argnums=6)
def _greedy(params: Params, token: jax.Array, position: jax.Array, cache: KVCache, stop_ids: jax.Array,
            steps: jax.Array, out_len: int) -> tuple[jax.Array, jax.Array]:
    """Up to `steps` greedy tokens after `token` (fed at `position`), in one loop on the device, ending after
    the first of stop_ids [S]: (new ids [out_len], how many were made). The cache must have room for them."""

    def going(carry):
        i, _, _, _, stopped = carry
        return (i < steps) & ~stopped

    def one(carry):
        i, token, cache, new, _ = carry
        logits, cache = forward(params, CONFIG, token.reshape(1, 1), (position + i).reshape(1, 1), cache)
        token = jnp.argmax(logits[0, 0]).astype(jnp.int32)
        return i + 1, token, cache, new.at[i].set(token), jnp.any(token == stop_ids)

    start = (jnp.int32(0), token, cache, jnp.zeros(out_len, jnp.int32), jnp.bool_(False))
    count, _, _, new, _ = jax.lax.while_loop(going, one, start)
    return new, count
'''


def jax_source(model, out_dir, *, overwrite: bool = False) -> Path:
    """Write `model` as a standalone model.py plus weights.safetensors in out_dir; returns its path.

    model.py needs jax, numpy and safetensors: `load_weights()`, `forward(params, CONFIG, tokens,
    positions, cache=None)`, `init_cache` and a greedy `generate(params, token_ids, max_new_tokens)`.
    The config and tokenizer files are written beside it. overwrite: an existing non-empty out_dir
    is a FileExistsError unless True (then only these files are replaced; all are written under a
    temporary name first).
    """
    model = model.dequantized()  # a quantized model's weights are written as the floats they stand for
    source = module_source(model)
    target = prepare_target(out_dir, overwrite)
    with staged(target, (MODULE, WEIGHTS, *MODEL_FILES)) as written:
        save_weights(model.params, written / WEIGHTS)
        (written / MODULE).write_text(source, encoding="utf-8")
        write_model_files(written, model.config, model.tokenizer)
    return target


def module_source(model) -> str:
    """The text of model.py for this model, compiled and checked for undefined names."""
    eos = generation_config(model.config, model.tokenizer).get("eos_token_id", [])
    constants = (f"WEIGHTS = {WEIGHTS!r}\n"
                 f"EOS_TOKEN_IDS = {tuple(eos) if isinstance(eos, list) else (eos,)!r}\n"
                 "CONFIG = Config()\n")
    parts = [header(model), IMPORTS]
    for module, names in OPS_SOURCES.items():
        parts += section(importlib.import_module(module), names)
    parts += [banner("linnet_jax.ops.quantized, for float weights"), FLOAT_PRODUCTS]
    parts += [banner("the configuration, inlined"), config_source(model.config)]
    for module, names in MODEL_SOURCES.items():
        parts += section(importlib.import_module(module), names)
    parts += [banner("loading and greedy generation"), constants, TAIL]
    source = "\n\n\n".join(part.strip("\n") for part in parts) + "\n"
    check(source)
    return source


def header(model) -> str:
    """The module docstring: what the file is and how to use it."""
    return f'''"""{model!r}, as standalone JAX.

Generated by linnet_jax {__version__} (`linnet_jax.export.jax_source`) from its own model
definition: the ops, the decoder and the generate helpers below are linnet_jax's source, and the
config is inlined as constants. Needs jax, numpy and safetensors; the weights are {WEIGHTS}.

    import model
    params = model.load_weights()                               # {WEIGHTS} beside this file
    new_ids = model.generate(params, [1, 2, 3], max_new_tokens=16)  # greedy; stops at EOS_TOKEN_IDS
    tokens, positions = jnp.array([[1, 2, 3]]), jnp.array([[0, 1, 2]])   # int32 [B, T]; position -1 = padding
    logits, _ = model.forward(params, model.CONFIG, tokens, positions)  # float32 [B, T, V], no cache
"""'''


def banner(title: str) -> str:
    return f"# {'-' * 98}\n# {title}\n# {'-' * 98}"


def section(module: ModuleType, names: list[str]) -> list[str]:
    """A banner naming what is taken from the module (with the docstring of a model-definition module), then
    each named definition's source."""
    title = banner(f"from {module.__name__}: {', '.join(names)}")
    if module.__name__.startswith(("linnet_jax.ops.", "linnet_jax.models.")):
        title += "\n#\n" + "\n".join(f"# {line}".rstrip() for line in inspect.getdoc(module).splitlines())
    return [title, *(definition(module, name) for name in names)]


def definition(module: ModuleType, name: str) -> str:
    """The source of one module-level name: a function or class as written, a constant as `NAME = value`.

    A flax.struct dataclass becomes a registered frozen dataclass with flax's `replace` method.
    """
    value = getattr(module, name)
    if not (inspect.isfunction(value) or inspect.isclass(value)):
        return f"{name} = {value!r}"
    source = inspect.getsource(value)
    if source.startswith(FLAX_DATACLASS):
        return PYTREE_DATACLASS + source.removeprefix(FLAX_DATACLASS).rstrip("\n") + "\n" + REPLACE_METHOD
    return source


def config_source(config: Config) -> str:
    """A Config stand-in: every field of this config as a class constant."""
    fields = "\n".join(f"    {field.name} = {getattr(config, field.name)!r}" for field in dataclasses.fields(config))
    doc = '"""This model\'s linnet_jax.models.Config, inlined: every field is a constant (static under jit)."""'
    return f"class Config:\n    {doc}\n\n{fields}"


def check(source: str) -> None:
    """compile() the source, and refuse it when it reads a global name it never defines."""
    compile(source, MODULE, "exec")
    missing = undefined_names(source)
    if missing:
        raise RuntimeError(f"the generated {MODULE} uses {sorted(missing)} without defining them: add them to "
                           f"OPS_SOURCES or MODEL_SOURCES in {__file__}")


def undefined_names(source: str) -> set[str]:
    """Global names the module reads (in any scope) that it neither defines nor gets from builtins."""
    top = symtable.symtable(source, MODULE, "exec")
    defined = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}

    def read(table: symtable.SymbolTable) -> set[str]:
        names = {s.get_name() for s in table.get_symbols() if s.is_referenced() and (table is top or s.is_global())}
        return names.union(*(read(child) for child in table.get_children()))

    return read(top) - defined - set(dir(builtins)) - {"__file__"}
