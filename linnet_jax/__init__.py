"""linnet_jax: a JAX-native modeling framework for Llama-family LLMs."""

__version__ = "0.1.0"

from linnet_jax.load import DEFAULT_MODEL, load
from linnet_jax.checkpoint import save
from linnet_jax.cli import enable_compilation_cache
from linnet_jax.generate import Generation, generate
from linnet_jax.model import Model, logits
from linnet_jax.sharding import shard

__all__ = [
    "DEFAULT_MODEL", "Generation", "Model", "__version__", "enable_compilation_cache", "generate", "load", "logits",
    "save", "shard",
]
