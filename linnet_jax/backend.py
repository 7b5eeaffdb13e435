"""The one plan for hardware-specific choices, made from the devices.

A `Plan` is hashable: `Model.plan` holds it and the cached programs (`forward`, `decode.extend`,
`decode.decode`, `decode.verify`) take it as a static argument. Nothing else in linnet_jax reads the platform.

- `unstacked_layers`: the decode programs take per-layer weights (`Params.layers` a tuple), else the
  stacked `[L, ...]` ones. XLA:CPU copies a layer's slice of a stacked weight before each product,
  which costs more than the products themselves in decode (benchmarks/RESULTS.md), while per-layer
  views of the stacked arrays' host memory cost it nothing. GPUs and TPUs read the stacked weights
  inside the program; unstacking there would copy them.
- `matvec_kernels`: the products of a decode or verify step (up to `ops.matvec.KERNEL_ROWS` rows of float32
  activations) run through linnet's XLA:CPU kernels (`ops.matvec`): on one CPU device, where they are built and
  this CPU and jaxlib can run them. XLA:CPU runs a one-row product on one core and YNNPACK's few-row products on
  one core too; the kernels split them across its threads and read each weight once for all the rows (with
  AVX-512's registers where the CPU has them), in an order that depends on neither the rows nor the threads.
  Prompt chunks (16 positions or more, `step_einsum`) keep XLA's products. Attention's products over the cache for a
  few query rows (`attention_products`) go through a kernel too: XLA's batched dot re-reads a cache of several rows
  once per query head, at a third of the bandwidth; the kernel reads each row's filled slots once, and its sums do
  not depend on how many slots past a row's last it is given (a request's tokens do not depend on its batch). SmolLM2's
  sampled 16-row step: 116 ms with XLA's products, 68 ms with both kernels (benchmarks/RESULTS.md).
- `key_block`: a prompt's later chunk (one that continues a row's cache) attends over the cache's first 128, 256,
  512, .. slots, the fewest that hold its keys (`ops.attention.key_spans`, one branch of a `jax.lax.switch` each),
  not all max_len: XLA:CPU runs the branch the predicate picks. A 256-position chunk at position 256 of 4,096-slot
  rows 2.7x faster, 3-11% at 640 (`benchmarks/later_chunks.py`). Not on a GPU, where a conditional's predicate
  goes through the host.
- `decode_options(rows)`: XLA compiler options for a decode program of that many rows, on one CPU device without
  the kernels: XLA's own dot emitter in place of YNNPACK's from 8 to 24 rows on an AVX2 CPU, where YNNPACK's dots
  keep one of the cores idle (SmolLM2's sampled 16-row step 83 ms instead of 97 on an AMD EPYC).
"""

import dataclasses
from collections.abc import Callable


from linnet_jax.models.params import Params, unstack_layers
from linnet_jax.ops import matvec, quantized

PLATFORMS = ("cpu", "gpu", "cuda", "rocm", "tpu")  # "gpu": how JAX names a CUDA or ROCm device
XLA_DOTS = (("xla_cpu_experimental_ynn_fusion_type", ""),)  # XLA:CPU fuses no op into YNNPACK: dots are XLA's
KEY_BLOCK = 128  # XLA:CPU: a prompt chunk's attention reads 128, 256, 512, .. or all of the cache's slots
STEP_POSITIONS = 16  # a forward of fewer new positions per row is a decode or verify step (prompt chunks: 16 or more)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Hardware-specific choices for one platform and device count (hashable: a static argument)."""

    platform: str  # one of PLATFORMS
    unstacked_layers: bool
    matvec_kernels: bool
    xla_dot_rows: tuple[int, int] | None = None  # (fewest, most) decode rows whose programs use XLA's own dots
    key_block: int | None = None  # the fewest slots a prompt chunk's attention may read (`key_spans`; None: all)

    @property
    def einsum(self) -> Callable:
        """The function the model's products run through: `ops.matvec.einsum` or `ops.quantized.einsum` (jnp.einsum, or
        qwix's for quantized weights)."""
        return matvec.einsum if self.matvec_kernels else quantized.einsum

    def step_einsum(self, positions: int) -> Callable:
        """The products of a forward of `positions` new positions per row: `einsum`'s for a decode or verify step
        (fewer than STEP_POSITIONS), XLA's (`ops.quantized.einsum`) for a prompt's chunks, so a prompt's cache is
        the same whatever it is batched with (a chunk is at least inputs.MIN_BUCKET positions)."""
        return self.einsum if positions < STEP_POSITIONS else quantized.einsum

    def attention_products(self, rows: int, positions: int) -> Callable | None:
        """How attention's products run for `rows` query rows per key/value head (heads per group × new positions)
        in a forward of `positions` new positions per row: `ops.matvec.batched` (all of a group's rows through one
        kernel, each cached key and value read once) for a decode or verify step where the kernels run and take that
        many rows, else None (XLA's products through jnp.einsum, `ops.attention.einsum_products`)."""
        kernel = self.matvec_kernels and positions < STEP_POSITIONS
        return matvec.batched if kernel and rows <= matvec.KERNEL_ROWS else None

    def attention_key_block(self, positions: int) -> int | None:
        """How much of the cache attention reads in a forward of `positions` new positions per row (`ops.attention`'s
        key_block): a prompt chunk's (STEP_POSITIONS or more) the fewest of key_block, 2 · key_block, 4 · key_block,
        .. slots that hold its keys (`ops.attention.key_spans`), where the plan has one; None: all of it."""
        return self.key_block if positions >= STEP_POSITIONS else None

    def decode_options(self, rows: int) -> tuple[tuple[str, str], ...]:
        """XLA compiler options (name, value) for a decode program of `rows` rows (hashable: a cache key)."""
        fewest, most = self.xla_dot_rows or (1, 0)
        return XLA_DOTS if fewest <= rows <= most else ()


def plan_for_platform(platform: str, devices: int = 1) -> Plan:
    """The plan for `devices` devices of `platform` (one of PLATFORMS), made on any machine."""
    if platform not in PLATFORMS:
        raise ValueError(f"platform must be one of {PLATFORMS}, got {platform!r}")
    cpu = platform == "cpu"
    kernels = cpu and devices == 1 and matvec.available()
    return Plan(platform=platform, unstacked_layers=cpu, matvec_kernels=kernels,
                key_block=KEY_BLOCK if cpu else None,
                xla_dot_rows=mid_width_xla_dots(matvec.cpu_flags()) if cpu and devices == 1 and not kernels else None)


def mid_width_xla_dots(flags: frozenset[str]) -> tuple[int, int] | None:
    """The decode rows (fewest, most) whose programs run XLA's own dots on one CPU with these feature flags: 8 to 24
    on an AVX2 CPU (AMD EPYC: the 16-row step 14% faster than with YNNPACK's), none on an AVX-512 one (Sapphire
    Rapids: YNNPACK's, which choose AVX-512 code at run time, 18% faster at 8 and 16 rows; benchmarks/RESULTS.md)."""
    return None if "avx512f" in flags else (8, 24)


def plan_for(params: Params) -> Plan:
    """The plan for the devices the params lie on."""
    devices = params.final_norm.devices()
    return plan_for_platform(next(iter(devices)).platform, len(devices))


def decode_params(params: Params, plan: Plan) -> Params:
    """The params the cached programs take under the plan: per-layer views of the stacked weights where it
    unstacks layers (nothing copied), else the stacked params themselves."""
    return unstack_layers(params, views=True) if plan.unstacked_layers else params

