"""Batch-1 products on XLA:CPU through linnet's matrix-vector kernels (ops/cpu_kernels.cc, built by setup.py).

XLA:CPU runs a product under ~2 MB (a small model's q, k, v and o projections) on one core, and the
larger ones below the bandwidth two cores reach; the kernels split every product's rows across the
calling thread and XLA's intra-op pool (benchmarks/RESULTS.md). `einsum` takes what `jnp.einsum` takes
and sends a product of a few rows of float32 activations (a decode or verify step's) to a kernel, with float32
weights or int8 ones and float32 scales in blocks of contiguous inputs (read as int8, a quarter of the bytes),
each weight read (and dequantized) once for all the rows; anything else goes to `ops.quantized.einsum`. int8
weights multiply int8 digits of the activations where the CPU has VNNI (`int8_digits`), and several x · w products of
one input go through one call (`einsums_of_one_input`, which `ops.quantized.einsums` finds as `einsum.of_one_input`).
`batched` runs attention's products over the cache for a few query rows.
The hardware plan chooses it (`linnet_jax.backend.Plan.einsum`, on one XLA:CPU device where
`available()`); exports and other platforms never see a kernel.
"""

import ctypes
import functools
import importlib.machinery
import math
import platform
import re
import warnings
from importlib.metadata import version
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp

from linnet_jax.ops.quantized import einsum as quantized_einsum, input_block, is_quantized

# FFI target: the library's handler symbol
TARGETS = {"linnet_xw": "LinnetXw", "linnet_wx": "LinnetWx", "linnet_xw_int8": "LinnetXwInt8",
           "linnet_wx_int8": "LinnetWxInt8", "linnet_abt": "LinnetAbt"}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as /proc/cpuinfo lists them ("avx2", "avx512f", ...); empty where it says none."""
    try:
        line = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return frozenset()
    return frozenset(line.partition(":")[2].split())


def cpu_has_vector_units() -> bool:
    """Whether this CPU runs what setup.py compiled: AVX2 and FMA on x86-64 (anything elsewhere)."""
    return platform.machine().lower() not in ("x86_64", "amd64") or {"avx2", "fma"} <= cpu_flags()


def library_path() -> Path | None:
    """The kernels' shared library, where setup.py built it for this Python (None: not built)."""
    paths = (Path(__file__).with_name(f"_cpu_kernels{suffix}") for suffix in importlib.machinery.EXTENSION_SUFFIXES)
    return next((path for path in paths if path.exists()), None)


def release(text: str) -> tuple[int, ...]:
    """A version's release numbers: "0.12.0.1" -> (0, 12, 0, 1); "0.11.0.dev20260101" -> (0, 11, 0)."""
    return tuple(int(part) for part in re.match(r"\d+(?:\.\d+)*", text).group().split("."))


def built_against(library: ctypes.CDLL) -> str | None:
    """The jaxlib whose XLA FFI headers setup.py compiled the kernels against (None: a build from before it said)."""
    if not hasattr(library, "LinnetJaxlibVersion"):
        return None
    library.LinnetJaxlibVersion.restype = ctypes.c_char_p
    return library.LinnetJaxlibVersion().decode()


def runs_on(built: str | None, running: str) -> bool:
    """Whether kernels built against jaxlib `built` run on jaxlib `running`: XLA takes handlers of its FFI API
    or an older one, and one newer than its own stops its whole CPU backend at start-up."""
    return built is not None and release(built) <= release(running)


NO_VECTOR_UNITS = "this CPU lacks AVX2 and FMA, which linnet_jax's CPU kernels need"


def unavailable_reason() -> str | None:
    """Why the kernels cannot run here, as a sentence (with how to build them where a build would help), or None."""
    path = library_path()
    if path is None:
        return ("linnet_jax's CPU kernels are not built (no ops/_cpu_kernels library: the install found no C++ "
                "compiler). Install g++ and run `pip install -e .` (or reinstall linnet_jax) to build them")
    if not cpu_has_vector_units():
        return NO_VECTOR_UNITS
    built, running = built_against(ctypes.cdll.LoadLibrary(str(path))), version("jaxlib")
    if not runs_on(built, running):
        return (f"linnet_jax's CPU kernels were built against jaxlib {built or '(unrecorded)'}, which the running "
                f"jaxlib {running} cannot take. `pip install -e .` rebuilds them")
    return None


@functools.cache
def available() -> bool:
    """Whether the kernels are built (against this jaxlib or an older one) and this CPU can run them; registers
    nothing (`register`). Kernels that were not built, or built against a newer jaxlib, are refused with one
    warning saying how to build them: without them batch-1 decode runs XLA's products, ~25% slower here."""
    reason = unavailable_reason()
    if reason not in (None, NO_VECTOR_UNITS):  # a CPU without the units: nothing to build, nothing to say
        warnings.warn(f"{reason}; batch-1 decode runs XLA's products, about 25% slower.", stacklevel=2)
    return reason is None


@functools.cache
def register() -> None:
    """Register the kernels with XLA:CPU (once; `einsum` does it when it first emits a call)."""
    library = ctypes.cdll.LoadLibrary(str(library_path()))
    for target, symbol in TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")


@functools.cache
def int8_digits() -> bool:
    """Whether the int8 kernels take the activations as int8 digits (ops/cpu_kernels.cc: exact integer sums with
    AVX-512 VNNI, a quarter of the work of widening each weight to float), which this CPU has; else they widen."""
    return {"avx512bw", "avx512_vnni"} <= cpu_flags()


KERNEL_ROWS = 32  # the most activation rows a product takes through the kernels (a decode or verify step's)


class KernelProduct(NamedTuple):
    """How a kernel takes einsum(spec, x, w): its target, x as [T, K], w as a matrix (input first: [K, N], else
    [N, K]), its scales (None: float32 weights) and the output's shape."""
    target: str
    rows: jax.Array
    matrix: jax.Array
    scales: jax.Array | None
    shape: tuple[int, ...]


def kernel_product(spec: str, x: jax.Array, w) -> KernelProduct | None:
    """How a kernel takes einsum(spec, x, w), or None where none does: up to KERNEL_ROWS rows of float32 activations
    contracting their trailing axes with w's leading (x · w) or trailing (w · x) axes, the output x's free axes then
    w's, and w float32 or int8 with float32 scales (`kernel_scales`)."""
    inputs, out = spec.split("->")
    x_axes, w_axes = inputs.split(",")
    contracted = "".join(axis for axis in x_axes if axis in w_axes and axis not in out)
    rows, k = x_axes[:len(x_axes) - len(contracted)], len(contracted)
    input_first = bool(contracted) and w_axes.startswith(contracted)  # w[K, ...]; else w[..., K] or neither
    w_free = w_axes[k:] if input_first else w_axes[:-k] if contracted and w_axes.endswith(contracted) else None
    scales = kernel_scales(w, k, input_first) if is_quantized(w) and w_free is not None else None
    takes_w = scales is not None or (w.dtype == jnp.float32 and not is_quantized(w))
    count = math.prod(x.shape[:len(rows)])
    if (w_free is None or not x_axes.endswith(contracted) or out != rows + w_free or x.dtype != jnp.float32
            or not takes_w or not 1 <= count <= KERNEL_ROWS):
        return None
    width = math.prod(x.shape[len(rows):])
    values = w if scales is None else w.qvalue
    matrix = values.reshape(width, -1) if input_first else values.reshape(-1, width)
    target = ("linnet_xw" if input_first else "linnet_wx") + ("" if scales is None else "_int8")
    free_shape = w.shape[k:] if input_first else w.shape[:-k]
    return KernelProduct(target, x.reshape(count, width), matrix, scales, (*x.shape[:len(rows)], *free_shape))


def run_kernel(products: list[KernelProduct]) -> list[jax.Array]:
    """The products' results, through one kernel call: one product, or several x · w ones of the same x and kind of
    weight (the projections of one input), which the kernel hands to the threads together (int8: x's digits made
    once)."""
    register()
    first = products[0]
    count = first.rows.shape[0]
    results = [jax.ShapeDtypeStruct((count, math.prod(product.shape) // count), jnp.float32) for product in products]
    weights = [array for product in products for array in (product.matrix, product.scales) if array is not None]
    options = {} if first.scales is None else {"digits": int8_digits()}
    outputs = jax.ffi.ffi_call(first.target, results)(first.rows, *weights, **options)
    return [y.reshape(product.shape) for y, product in zip(outputs, products)]


def einsum(spec: str, x: jax.Array, w, **options) -> jax.Array:
    """`ops.quantized.einsum(spec, x, w, **options)`, through a kernel where one takes it (`kernel_product`)."""
    product = kernel_product(spec, x, w)
    return quantized_einsum(spec, x, w, **options) if product is None else run_kernel([product])[0]


def einsums_of_one_input(x: jax.Array, products: list[tuple[str, object]]) -> list[jax.Array]:
    """[einsum(spec, x, w) for spec, w in products], through one kernel call when a kernel takes them all as x · w
    with weights of one kind, float32 or int8 (`ops.quantized.einsums`: a layer's q, k and v, its gate and up):
    three calls fewer a layer."""
    kernels = [kernel_product(spec, x, w) for spec, w in products]
    if all(kernel is not None and kernel.target.startswith("linnet_xw") and kernel.target == kernels[0].target
           for kernel in kernels):
        return run_kernel(kernels)
    return [quantized_einsum(spec, x, w) if kernel is None else run_kernel([kernel])[0]
            for (spec, w), kernel in zip(products, kernels)]


einsum.of_one_input = einsums_of_one_input


def batched(a: jax.Array, b: jax.Array, slots: jax.Array, slots_contracted: bool) -> jax.Array:
    """out[n, i, j] = Σ_c a[n, i, c] · b[n, j, c]: a [N, I, C], b [N', J, C] (N' ≥ N: its first N rows are read) →
    float32 [N, I, J], attention's products over each n's first slots[n] key slots ([N] int32): b's rows j (slots_contracted False: the scores, a the queries,
    b the keys; past them the kernel gives 0) or the contracted c (True: the mixing, a the probabilities, which must
    be 0 past them, b the values). Through a kernel for float32 operands and I ≤ KERNEL_ROWS, each row of b read
    once for all of a's rows (XLA:CPU's batched dot reads a cache too large for the caches at several times the
    bandwidth cost, benchmarks/RESULTS.md); else jnp.einsum over every slot."""
    (n, rows, _), j = a.shape, b.shape[1]
    if not (a.dtype == b.dtype == jnp.float32 and rows <= KERNEL_ROWS):
        return jnp.einsum("nic,njc->nij", a, b[:n], preferred_element_type=jnp.float32)
    register()
    return jax.ffi.ffi_call("linnet_abt", jax.ShapeDtypeStruct((n, rows, j), jnp.float32))(
        a, b, slots.astype(jnp.int32), slots_contracted=slots_contracted)


def kernel_scales(w, contracted: int, input_first: bool) -> jax.Array | None:
    """A quantized weight's scales as the int8 kernels take them, [blocks, N] (input first) or [N, blocks], or None
    when the kernels cannot take it: int8 values with float32 scales, one scale per output and block of contiguous
    inputs (`ops.quantized.input_block`)."""
    input_axes = tuple(range(contracted)) if input_first else tuple(range(w.ndim - contracted, w.ndim))
    if (w.qvalue.dtype != jnp.int8 or w.scale.dtype != jnp.float32 or w.zero_point is not None
            or input_block(w, input_axes) is None):
        return None
    blocks = math.prod(w.scale.shape[axis] for axis in input_axes)
    return w.scale.reshape(blocks, -1) if input_first else w.scale.reshape(-1, blocks)
