"""Run a linnet_jax StableHLO export without linnet_jax: jax (with flatbuffers), numpy and safetensors only.

`linnet_jax.export.stablehlo` copies this file into every export as `load.py`, next to the programs:

    import sys; sys.path.insert(0, "path/to/export")
    import load

    exported = load.Export("path/to/export")          # programs deserialized, weights placed, once
    ids, logits = exported.greedy(prompt_ids, 32)     # every step's logits [N, V], a call per token
    ids = exported.greedy_ids(prompt_ids, 32)         # the fast path: the decode steps in one loop on the device

Shapes (B = the manifest's batch, T = a prompt bucket, V = vocab): the prefill program of bucket T takes
(weights, tokens [B, T], positions [B, T], cache) and the decode program (weights, token [B], position [B],
cache); both return (float32 last-position logits [B, V], cache), the cache donated. The cache holds max_len
slots per row: a token at position p is written to slot p and attends to slots 0 .. p (position -1 is padding,
written nowhere), so `prefill` and `decode` refuse a position of max_len or more (a ValueError). A sharded
export (the manifest has "mesh") is run on a mesh of its shape, every argument placed by its PartitionSpec.
"""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec
from safetensors.numpy import load_file


class Export:
    """A loaded export: its manifest, its mesh (None unsharded), its weights on the device(s), its programs."""

    def __init__(self, directory):
        self.directory = Path(directory)
        self.manifest = json.loads((self.directory / "manifest.json").read_text())
        self.mesh = export_mesh(self.manifest)
        specs = {t["name"]: t.get("spec") for t in self.manifest["weights"]["tensors"]}
        arrays = load_file(self.directory / self.manifest["weights"]["file"])
        self.weights = jax.block_until_ready(
            {name: jax.device_put(array, self.place(specs[name])) for name, array in arrays.items()})
        self.prefill = {int(t): self.program(files) for t, files in self.manifest["prefill"].items()}
        self.decode = self.program(self.manifest["decode"])
        self.decode_loop = greedy_loop(self.deserialized(self.manifest["decode"]))

    def place(self, spec):
        """The sharding of a PartitionSpec (a JSON list) on the export's mesh; None (the default device) unsharded."""
        return self.mesh and NamedSharding(self.mesh, PartitionSpec(*spec))

    def deserialized(self, files: dict) -> jax.export.Exported:
        return jax.export.deserialize((self.directory / files["serialized"]).read_bytes())

    def program(self, files: dict):
        """(weights, tokens, positions, cache) -> (logits, cache): a deserialized program, jitted, its cache
        argument donated, its tokens and positions placed as the program takes them. A ValueError, before the
        call, for a position past the cache's slots (the program would drop its token: a silent wrong answer)."""
        call = jax.jit(self.deserialized(files).call, donate_argnums=3)
        inputs = self.place(files.get("specs", {}).get("tokens"))

        def run(weights, tokens, positions, cache):
            self.check_positions(positions)
            return call(weights, jax.device_put(tokens, inputs), jax.device_put(positions, inputs), cache)

        return run

    def check_positions(self, positions) -> None:
        """The manifest's capacity rule: every position below max_len (slot p holds position p)."""
        positions, max_len = np.asarray(positions), self.manifest["max_len"]
        if positions.size and positions.max() >= max_len:
            raise ValueError(f"the cache is full: its {max_len} slots per row hold positions 0 .. {max_len - 1}, "
                             f"got position {positions.max()} ({self.manifest['capacity']['rule']})")

    def empty_cache(self) -> dict:
        """The cache as init_cache makes it (zeros: a slot is read only once its position is written)."""
        return {name: jnp.full(c["shape"], c["fill"], c["dtype"], device=self.place(c.get("spec")))
                for name, c in self.manifest["cache"].items()}

    def start(self, ids: list[int], max_new_tokens: int = 1) -> tuple[jax.Array, dict]:
        """Prefill one prompt (a list of ids) in every row: (its last position's logits [B, V], the cache).
        A ValueError if the prompt has no bucket, or the prompt and max_new_tokens pass the exported cache's
        max_len positions."""
        t = min((t for t in self.prefill if t >= len(ids)), default=None)  # the prompt's bucket
        max_len, largest = self.manifest["max_len"], max(self.prefill)
        if not ids or t is None or len(ids) + max_new_tokens > max_len:
            raise ValueError(f"{len(ids)} prompt ids and {max_new_tokens} new tokens do not fit the exported cache: "
                             f"a prompt of 1 .. {largest} ids (the largest bucket), prompt plus new tokens at most "
                             f"{max_len} positions")
        tokens, positions = left_padded(ids, t, self.manifest["batch"])  # positions 0 .. len(ids) - 1, padding -1
        return self.prefill[t](self.weights, tokens, positions, self.empty_cache())

    def greedy(self, ids: list[int], max_new_tokens: int) -> tuple[list[int], np.ndarray]:
        """Greedy continuation of one prompt, the decode program called once per token from Python:
        (max_new_tokens new ids, their logits [max_new_tokens, V])."""
        logits, cache = self.start(ids, max_new_tokens)
        rows, steps = self.manifest["batch"], [np.asarray(logits[0])]
        for position in range(len(ids), len(ids) + max_new_tokens - 1):
            token = np.full((rows,), steps[-1].argmax(), np.int32)
            logits, cache = self.decode(self.weights, token, np.full((rows,), position, np.int32), cache)
            steps.append(np.asarray(logits[0]))
        return [int(step.argmax()) for step in steps], np.stack(steps)

    def greedy_ids(self, ids: list[int], max_new_tokens: int) -> list[int]:
        """The same ids as `greedy`, the decode steps in one jitted loop on the device (one dispatch, no
        logits back): the fast path."""
        logits, cache = self.start(ids, max_new_tokens)
        first = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B]
        if max_new_tokens == 1:
            return [int(first[0])]
        more = self.decode_loop(self.weights, first, np.int32(len(ids)), cache, max_new_tokens - 1)
        return [int(first[0]), *np.asarray(more[:, 0]).tolist()]


def export_mesh(manifest: dict) -> jax.sharding.Mesh | None:
    """A mesh of the sharded export's shape (every axis Auto) on this process's devices; None unsharded."""
    mesh = manifest.get("mesh")
    if not mesh:
        return None
    return jax.make_mesh(mesh["axis_sizes"], mesh["axis_names"], (AxisType.Auto,) * len(mesh["axis_names"]))


def left_padded(ids: list[int], t: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, positions) int32 [rows, t]: the prompt in every row, left padding at position -1."""
    tokens, positions = np.zeros((rows, t), np.int32), np.full((rows, t), -1, np.int32)
    tokens[:, t - len(ids):], positions[:, t - len(ids):] = ids, np.arange(len(ids))
    return tokens, positions


def greedy_loop(decode: jax.export.Exported):
    """(weights, first tokens [B], their position, cache, steps) -> the next `steps` greedy ids [steps, B]: a
    deserialized one-token decode program inside one jitted `lax.fori_loop`."""
    def loop(weights, token, position, cache, steps):
        def step(i, carry):
            token, cache, new = carry
            logits, cache = decode.call(weights, token, jnp.full(token.shape, position + i, jnp.int32), cache)
            token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            return token, cache, new.at[i].set(token)

        return jax.lax.fori_loop(0, steps, step, (token, cache, jnp.zeros((steps, *token.shape), jnp.int32)))[2]

    return jax.jit(loop, static_argnums=4)  # the cache is not returned, so nothing to donate it to
