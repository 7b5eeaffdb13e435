"""Sharding: logical axis names on every array, a rules table from them to mesh axes, placement.

Every weight (`models.params.param_axes`), cache array (`Layout.cache_shardings`) and block-boundary
activation (`models.decoder.forward`'s constraints) names its axes with logical names: vocab, embed, heads,
kv_heads, head_dim, mlp, layers, batch, seq, cache_seq. `Rules` maps them to the mesh axes
`data`, `fsdp` and `tensor` (a mesh may have any subset of them):

    single   nothing sharded
    dp       batch over data; weights replicated
    fsdp     batch over data and fsdp; each weight split over fsdp along embed (or its largest
             axis that fsdp divides)
    tp       batch over data; heads, kv_heads, mlp and vocab over tensor
    fsdp_tp  both

A rules table (`{"heads": "tensor", ...}`) may replace a preset; it shards weights through their
logical axes only (`Rules(table, fsdp=("fsdp",))` adds the FSDP split). A rule that puts two axes
of one array on the same mesh axis is an error; an axis that its mesh axes do not divide (9 query
heads over 2 devices) is replicated for that array, with one warning naming the array and sizes.

The KV cache keeps one row per (batch row, key/value head), N = B * G rows, batch-major: its
rows are split over the batch's mesh axes, then the kv heads' (exact when the heads are not
split or each batch shard holds one row; otherwise XLA moves rows between devices, still exact).

Explicit mesh axes (`jax.make_mesh`'s default in JAX 0.10) type every array by its sharding and
want an `out_sharding` on contractions; the model places itself on an Auto-axes mesh over the
same devices and names instead, so either kind of mesh works.
"""

import dataclasses
import functools
import math
import warnings
from collections.abc import Mapping, Sequence

import jax
import numpy as np
import qwix
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from linnet_jax.models import Config, KVCache
from linnet_jax.models.params import (Int8Blocks, contracted_axes, flatten_params, param_axes, param_shapes,
                                      quantize_weight, unflatten_params)
from linnet_jax.ops.quantized import is_quantized

LOGICAL_AXES = ("vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "layers", "batch", "seq", "cache_seq")
MESH_AXES = ("data", "fsdp", "tensor")
TENSOR_AXES = ("heads", "kv_heads", "mlp", "vocab")


@dataclasses.dataclass(frozen=True)
class Rules:
    """Which mesh axes each logical axis is split over.

    table: ((logical axis, (mesh axes, major first)), ...), for every array. fsdp: mesh axes that
    each weight is also split over, along embed or else its largest axis they divide (weights
    only: activations carry their batch on those axes).
    """

    table: tuple[tuple[str, tuple[str, ...]], ...] = ()
    fsdp: tuple[str, ...] = ()

    def __getitem__(self, logical: str) -> tuple[str, ...]:
        return dict(self.table).get(logical, ())

    @classmethod
    def from_table(cls, table: Mapping[str, str | Sequence[str] | None], fsdp: Sequence[str] = ()) -> "Rules":
        """Rules from {logical axis: mesh axis, tuple of mesh axes, or None}."""
        as_tuple = lambda axes: () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)  # noqa: E731
        return cls(tuple((logical, as_tuple(axes)) for logical, axes in table.items()), tuple(fsdp))

    def within(self, mesh: Mesh) -> "Rules":
        """These rules without the mesh axes that `mesh` lacks (presets name all three)."""
        keep = lambda axes: tuple(a for a in axes if a in mesh.axis_names)  # noqa: E731
        return Rules(tuple((logical, keep(axes)) for logical, axes in self.table), keep(self.fsdp))

    def check(self, mesh: Mesh) -> "Rules":
        """These rules, or a ValueError naming an unknown logical axis, an unknown or repeated mesh axis."""
        for logical, axes in self.table:
            if logical not in LOGICAL_AXES:
                raise ValueError(f"sharding rule for unknown logical axis {logical!r}; expected one of {LOGICAL_AXES}")
            if len(set(axes)) != len(axes):
                raise ValueError(f"sharding rule {logical!r} -> {axes} names a mesh axis twice")
        for logical, axes in (*self.table, ("fsdp", self.fsdp)):
            missing = [a for a in axes if a not in mesh.axis_names]
            if missing:
                raise ValueError(f"sharding rule {logical!r} -> {axes}: the mesh has no axis {missing[0]!r} "
                                 f"(its axes: {mesh.axis_names})")
        return self


PRESETS = {
    "single": Rules(),
    "dp": Rules((("batch", ("data",)),)),
    "fsdp": Rules((("batch", ("data", "fsdp")),), fsdp=("fsdp",)),
    "tp": Rules((("batch", ("data",)), *((logical, ("tensor",)) for logical in TENSOR_AXES))),
    "fsdp_tp": Rules((("batch", ("data", "fsdp")), *((logical, ("tensor",)) for logical in TENSOR_AXES)),
                     fsdp=("fsdp",)),
}


def mesh(data: int = 1, fsdp: int = 1, tensor: int = 1, *, devices=None) -> Mesh:
    """A mesh with axes ("data", "fsdp", "tensor") of these sizes, over the first data * fsdp * tensor devices."""
    sizes = {"data": data, "fsdp": fsdp, "tensor": tensor}
    for name, size in sizes.items():
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"mesh axis {name} must be a positive int, got {size!r}")
    devices = list(jax.devices() if devices is None else devices)
    needed = math.prod(sizes.values())
    if needed > len(devices):
        raise ValueError(f"mesh(data={data}, fsdp={fsdp}, tensor={tensor}) needs {needed} devices; "
                         f"{len(devices)} are available")
    return jax.make_mesh(tuple(sizes.values()), MESH_AXES, (AxisType.Auto,) * 3, devices=devices[:needed])


def auto_axes(mesh: Mesh) -> Mesh:
    """The same devices and axis names with every axis Auto (what the model's programs are written for)."""
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def resolve_rules(rules, mesh: Mesh) -> Rules:
    """A preset name, a table, Rules, or None (all presets' rules that the mesh's axes allow) as checked Rules."""
    if rules is None:
        return PRESETS["fsdp_tp"].within(mesh)
    if isinstance(rules, str):
        if rules not in PRESETS:
            raise ValueError(f"unknown sharding preset {rules!r}; expected one of {tuple(PRESETS)} or a rules table")
        return PRESETS[rules].within(mesh)
    if isinstance(rules, Mapping):
        rules = Rules.from_table(rules)
    if not isinstance(rules, Rules):
        raise TypeError(f"rules must be a preset name, a {{logical axis: mesh axes}} table or Rules, got {rules!r}")
    return rules.check(mesh)


@dataclasses.dataclass(frozen=True)
class Layout:
    """A mesh (Auto axes) and the rules that place a model's arrays on it. Hashable: a static jit argument."""

    mesh: Mesh
    rules: Rules

    @classmethod
    def of(cls, mesh: Mesh, rules=None) -> "Layout":
        if not isinstance(mesh, Mesh):
            raise TypeError(f"mesh must be a jax.sharding.Mesh (linnet_jax.sharding.mesh or jax.make_mesh), got {mesh!r}")
        return cls(auto_axes(mesh), resolve_rules(rules, mesh))

    def spec(self, name: str, axes: Sequence[str], shape: Sequence[int], weight: bool = False) -> PartitionSpec:
        """The PartitionSpec of array `name` with these logical axes and shape (weights also get the FSDP split)."""
        dims = [self.rules[logical] for logical in axes]
        used = {}
        for logical, mesh_axes in zip(axes, dims):
            for mesh_axis in mesh_axes:
                if mesh_axis in used:
                    raise ValueError(f"sharding rules put logical axes {used[mesh_axis]!r} and {logical!r} of {name} "
                                     f"(axes {tuple(axes)}) on the same mesh axis {mesh_axis!r}")
                used[mesh_axis] = logical
        dims, dropped = zip(*(self._dividing(mesh_axes, size) for mesh_axes, size in zip(dims, shape)))
        problems = [f"{logical} of size {size} is not divisible by mesh axes {'+'.join(mesh_axes)} "
                    f"({self._size(mesh_axes)} devices)" for logical, size, mesh_axes in zip(axes, shape, dropped)
                    if mesh_axes]
        dims = list(dims)
        if weight:
            for mesh_axis in self.rules.fsdp:
                if mesh_axis not in used and self.mesh.shape[mesh_axis] > 1:
                    chosen = self._fsdp_dim(axes, shape, dims, mesh_axis)
                    if chosen is None:
                        problems.append(f"no axis of shape {tuple(shape)} is divisible by mesh axis {mesh_axis} "
                                        f"({self.mesh.shape[mesh_axis]} devices)")
                    else:
                        dims[chosen] = (*dims[chosen], mesh_axis)
        if problems:
            warnings.warn(f"{name}: {'; '.join(problems)}: replicated along it", stacklevel=3)
        return PartitionSpec(*(d if len(d) > 1 else d[0] if d else None for d in dims))

    def _size(self, mesh_axes: Sequence[str]) -> int:
        return math.prod(self.mesh.shape[a] for a in mesh_axes)

    def _dividing(self, mesh_axes: tuple[str, ...], size: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(the longest prefix of mesh_axes whose device count divides size, the rest)."""
        keep = len(mesh_axes)
        while keep and size % self._size(mesh_axes[:keep]):
            keep -= 1
        return mesh_axes[:keep], mesh_axes[keep:]

    def _fsdp_dim(self, axes, shape, dims, mesh_axis: str) -> int | None:
        """The dim a weight is split along over an FSDP mesh axis: embed if it divides, else the largest that does."""
        fits = [i for i, (logical, size) in enumerate(zip(axes, shape))
                if logical != "layers" and size % (self._size(dims[i]) * self.mesh.shape[mesh_axis]) == 0]
        embed = [i for i in fits if axes[i] == "embed"]
        return embed[0] if embed else max(fits, key=lambda i: shape[i] // self._size(dims[i]), default=None)

    def sharding(self, name: str, axes: Sequence[str], shape: Sequence[int], weight: bool = False) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(name, axes, shape, weight))

    def constrain(self, x: jax.Array, axes: Sequence[str]) -> jax.Array:
        """x with a sharding constraint from its logical axes (inside jit, at block boundaries)."""
        return jax.lax.with_sharding_constraint(x, self.sharding(f"activation {tuple(axes)}", axes, x.shape))

    def param_shardings(self, config: Config) -> dict[str, NamedSharding]:
        """Every weight's sharding, by flat name."""
        shapes = flatten_params(param_shapes(config))
        return {name: self.sharding(name, axes, shapes[name], weight=True) for name, axes in param_axes(config).items()}

    def cache_shardings(self, config: Config, batch: int, max_len: int) -> KVCache:
        """The KV cache's shardings, as a KVCache: each layer's k [N, S, K] and v [N, K, S].

        The N = B * G rows take the batch's mesh axes, then the kv heads'.
        """
        g, k = config.num_kv_heads, config.head_dim
        spec = self.spec("kv cache", ("batch", "kv_heads", "cache_seq", "head_dim"), (batch, g, max_len, k))
        rows = tuple(a for part in spec[0:2] for a in ((part,) if isinstance(part, str) else part or ()))
        _, _, slots, dim = spec
        layers = range(config.num_layers)
        return KVCache(k=tuple(NamedSharding(self.mesh, PartitionSpec(rows or None, slots, dim)) for _ in layers),
                       v=tuple(NamedSharding(self.mesh, PartitionSpec(rows or None, dim, slots)) for _ in layers))

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())


def put(array, sharding: NamedSharding) -> jax.Array:
    """A host array onto a mesh, each device receiving only its shard (works across processes)."""
    array = np.asarray(array)
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def placement(config: Config, dtype: str | None, layout: "Layout | None", quantize: bool = False):
    """convert(flat name, numpy array or Int8Blocks) -> device array, or quantized weight (qwix.QArray): cast to
    dtype (None: as stored; int8 values stay int8), on one device or, with a layout, straight onto its mesh, each
    device receiving its own shard. quantize: the products' weights quantized per output channel
    (`models.params.quantize_weight`); Int8Blocks (a file's Q8_0 blocks) are taken as they are."""
    shardings = None if layout is None else layout.param_shardings(config)

    def on_device(array: np.ndarray, sharding: NamedSharding | None) -> jax.Array:
        if sharding is None:  # may_alias: XLA:CPU adopts an aligned host array (models.params.aligned_empty) uncopied
            return jax.device_put(array, may_alias=True)
        return put(array, sharding)

    def convert(name: str, array):
        sharding = shardings and shardings[name]
        if isinstance(array, Int8Blocks):
            scales = on_device(array.scales.astype(dtype or np.float32),
                               sharding and scale_sharding(sharding, array.shape, array.scales.shape))
            return qwix.QArray(qvalue=on_device(array.values, sharding), scale=scales, qtype=np.int8)
        placed = on_device(np.asarray(array, dtype=dtype or array.dtype), sharding)
        axes = contracted_axes(name) if quantize else None
        return placed if axes is None else placed_like(quantize_weight(placed, axes), sharding)

    return convert


def scale_sharding(sharding: NamedSharding, weight_shape: tuple[int, ...], scale_shape: tuple[int, ...]
                   ) -> NamedSharding:
    """A quantized weight's scales' sharding: its values' on the axes the scales share with them, replicated on the
    others (axes of one scale, or of blocks)."""
    spec = (*sharding.spec, *(None,) * (len(weight_shape) - len(sharding.spec)))
    return NamedSharding(sharding.mesh, PartitionSpec(*(axis if size == scales else None
                                                        for axis, size, scales in zip(spec, weight_shape, scale_shape))))


def placed_like(array, sharding: NamedSharding | None):
    """A device array, or a quantized weight (values by `sharding`, scales by `scale_sharding`), on `sharding` (None:
    where it is)."""
    if sharding is None:
        return array
    if is_quantized(array):
        return array.replace(qvalue=jax.device_put(array.qvalue, sharding),
                             scale=jax.device_put(array.scale, scale_sharding(sharding, array.shape, array.scale.shape)))
    return jax.device_put(array, sharding)


def host(array: jax.Array) -> np.ndarray:
    """An array's value on the host, gathered from every process when it spans several."""
    if array.is_fully_addressable:
        return np.asarray(array)
    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def hosts(*arrays: jax.Array) -> tuple[np.ndarray, ...]:
    """Several arrays' values on the host, as `host` gives each. Arrays that span several processes are replicated
    by one program (one collective, which every process must run alike), and each process reads its own copy."""
    if all(array.is_fully_addressable for array in arrays):
        return tuple(np.asarray(array) for array in arrays)
    sharding = arrays[0].sharding
    devices = (sharding.mesh if isinstance(sharding, NamedSharding)
               else Mesh(np.array(sorted(sharding.device_set, key=lambda device: device.id)), ("all",)))
    return tuple(np.asarray(array.addressable_data(0)) for array in _replicator(devices)(*arrays))


@functools.cache
def _replicator(mesh: Mesh):
    """A program that returns its arrays replicated over `mesh` (made once per mesh; compiled once per shapes)."""
    return jax.jit(lambda *arrays: arrays, out_shardings=NamedSharding(mesh, PartitionSpec()))


def shard(model, mesh: Mesh, rules=None):
    """`model` with its weights re-placed on `mesh` by `rules` (a preset name, a table, Rules or None:
    every rule the mesh's axis names allow); generate and logits then run sharded."""
    layout = Layout.of(mesh, rules)
    return dataclasses.replace(model, params=placed_params(model.params, model.config, layout), layout=layout)


def placed_params(params, config: Config, layout: "Layout"):
    """Every weight of params (a quantized one too: `placed_like`) re-placed by the layout's sharding for it."""
    shardings = layout.param_shardings(config)
    return unflatten_params({name: placed_like(weight, shardings[name])
                             for name, weight in flatten_params(params).items()})


def describe(model) -> str:
    """A table of each weight's logical axes, mesh axes, per-device shape and bytes, and the totals per device."""
    axes = param_axes(model.config)
    rows = [("weight", "logical axes", "mesh axes", "per-device shape", "bytes/device")]
    per_device = total = 0
    for name, weight in flatten_params(model.params).items():
        array = weight.qvalue if is_quantized(weight) else weight  # a quantized one: its int8 values
        spec = getattr(array.sharding, "spec", PartitionSpec())
        shard_shape = array.sharding.shard_shape(array.shape)
        shard_bytes = math.prod(shard_shape) * array.dtype.itemsize
        per_device += shard_bytes
        total += array.nbytes
        mesh_axes = [spec[i] if i < len(spec) else None for i in range(array.ndim)]
        rows.append((name, ", ".join(axes[name]), ", ".join(_mesh_axes_text(m) for m in mesh_axes),
                     "×".join(map(str, shard_shape)), _bytes(shard_bytes)))
    devices = len(model.params.sharding.device_set)
    mesh_text = (", ".join(f"{n}={s}" for n, s in model.layout.mesh.shape.items()) if model.layout else "one device")
    rules_text = f"rules {_rules_text(model.layout.rules)}" if model.layout else "unsharded"
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = [f"mesh {mesh_text} ({devices} device{'s' * (devices != 1)}), {rules_text}"]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.append(f"total {_bytes(total)}; per device {_bytes(per_device)} ({per_device / total:.1%} of the total)")
    return "\n".join(lines)


def _mesh_axes_text(axes) -> str:
    if axes is None:
        return "-"
    return axes if isinstance(axes, str) else "+".join(axes)


def _rules_text(rules: Rules) -> str:
    text = ", ".join(f"{logical}->{'+'.join(axes)}" for logical, axes in rules.table if axes)
    return (text or "none") + (f", weights fsdp over {'+'.join(rules.fsdp)}" if rules.fsdp else "")


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"
