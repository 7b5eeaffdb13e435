"""linnet_jax: a JAX-native modeling framework for Llama-family LLMs.

Every public name (`load`, `generate`, ...) and submodule (`export`, `sharding`, ...) is imported on first use
(PEP 562), so importing a lower floor (`linnet_jax.ops`, `linnet_jax.models`, `linnet_jax.decode`) does not pull
the floors above it, and `import linnet_jax` stays light.
"""

import importlib
import sys
import types

from linnet_jax._version import __version__

# Public name -> the submodule that defines it.
NAMES = {"DEFAULT_MODEL": "load", "Generation": "generate", "Model": "loaded", "enable_compilation_cache": "compilation",
         "generate": "generate", "load": "load", "logits": "loaded", "lowered": "lowering", "save": "checkpoint", "shard": "sharding"}

__all__ = ["__version__", *NAMES, "export"]


def __getattr__(name: str):
    """A public name (`load`, `generate`, ...) or a submodule (`export`, `sharding`, ...), imported on first use."""
    if name in NAMES:
        value = getattr(importlib.import_module(f"linnet_jax.{NAMES[name]}"), name)
        globals()[name] = value
        return value
    try:
        return importlib.import_module(f"linnet_jax.{name}")
    except ModuleNotFoundError as error:
        if error.name != f"linnet_jax.{name}":
            raise
    raise AttributeError(f"module 'linnet_jax' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The names imported so far and the public ones."""
    return sorted({*globals(), *__all__})


class Package(types.ModuleType):
    """linnet_jax's module type: the functions `generate` and `load` keep their names on the package.

    Importing a submodule sets it as an attribute of its package; `linnet_jax.generate` and `linnet_jax.load`
    are the functions, not the modules that define them, whichever is imported first.
    """

    def __setattr__(self, name: str, value) -> None:
        if isinstance(value, types.ModuleType) and NAMES.get(name) == name:
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = Package
