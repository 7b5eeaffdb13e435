"""JAX's persistent compilation cache, opt-in (importing linnet_jax changes no global JAX setting)."""

import os
from pathlib import Path

import jax


def enable_compilation_cache(path: str | os.PathLike | None = None) -> Path:
    """Turn on JAX's persistent compilation cache, so a second run skips compiling. Returns its directory.

    Default: $XDG_CACHE_HOME/linnet_jax/jax (~/.cache/linnet_jax/jax). Changes a global JAX setting,
    which is why importing linnet_jax never calls it; the CLI does unless --no-compilation-cache.
    """
    if path is None:
        path = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "linnet_jax" / "jax"
    path = Path(path).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    return path
