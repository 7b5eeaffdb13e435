"""The one compiled part of linnet_jax: ops/cpu_kernels.cc, XLA:CPU matrix-vector kernels (ops/matvec.py).

Everything else is in pyproject.toml. The kernels are optional: where they do not build, linnet_jax runs
XLA's own products (`linnet_jax.ops.matvec.available()` says which).
"""

import platform
from importlib.metadata import version

import jax
from setuptools import Extension, setup

# x86-64: AVX2 and FMA (ops/matvec.py uses the kernels only on a CPU that has them); elsewhere the default.
VECTOR_FLAGS = ["-mavx2", "-mfma"] if platform.machine().lower() in ("x86_64", "amd64") else []

setup(ext_modules=[Extension(
    "linnet_jax.ops._cpu_kernels",
    sources=["ops/cpu_kernels.cc"],
    include_dirs=[jax.ffi.include_dir()],
    # the headers' jaxlib (pyproject.toml's build requirements: the oldest supported), which ops/matvec.py checks
    define_macros=[("LINNET_JAXLIB_VERSION", f'"{version("jaxlib")}"')],
    # -ffp-contract=fast: a * b + c as one fused multiply-add (ISO C++ mode's default keeps them apart); the kernels
    # sum each row in one order whatever else runs, so they stay independent of rows and threads
    extra_compile_args=["-std=c++17", "-O3", "-ffp-contract=fast", *VECTOR_FLAGS],
    language="c++",
    optional=True,
)])
