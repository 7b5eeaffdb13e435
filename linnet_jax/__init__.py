"""linnet_jax: a JAX-native modeling framework for Llama-family LLMs.

The exporters (`linnet_jax.export`) and the GGUF reader are imported when first used.
"""

import importlib

from linnet_jax._version import __version__
from linnet_jax.checkpoint import save
from linnet_jax.compilation import enable_compilation_cache
from linnet_jax.generate import Generation, generate
from linnet_jax.load import DEFAULT_MODEL, load
from linnet_jax.model import Model, logits
from linnet_jax.sharding import shard

LAZY_SUBMODULES = ("export", "decode", "gguf", "tokenizer", "cli", "serve", "train")

__all__ = [
    "DEFAULT_MODEL", "Generation", "Model", "__version__", "enable_compilation_cache", "export", "generate", "load",
    "logits", "lowered", "save", "shard",
]


def __getattr__(name: str):
    """`linnet_jax.export` (and the other submodules) on first use, so that importing linnet_jax stays light."""
    if name in LAZY_SUBMODULES:
        return importlib.import_module(f"linnet_jax.{name}")
    if name == "lowered":
        from linnet_jax.lowering import lowered
        return lowered
    raise AttributeError(f"module 'linnet_jax' has no attribute {name!r}")
