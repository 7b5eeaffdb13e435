"""`Lockstep`: one engine over the devices of several `jax.distributed` processes, on the leader's schedule.

The leader (process 0) runs the engine's scheduler and the HTTP front; every other process (a follower) holds its
part of the same decode state and runs the same device programs, in the same order. Every program the scheduler
runs passes through one seam (`Engine._run`): there the leader sends the call — the program's name and its host
inputs (ints, floats, bools, strings, bytes, lists, dicts with string keys, numpy arrays and `decode.Request`s) — before running it, and a
follower (`Engine.follow`) receives each call and runs it on its own part of the state. The programs read their
outputs back as replicated arrays, so every process takes part in the same collectives.

Calls travel through the key-value store of jax.distributed's coordination service (as jax-llm-examples'
`SyncServer` does; it lives in the leader's process): call n is the key PREFIX/c/n, c = n // CHUNK. A follower that
has run every call of chunk c adds one to PREFIX/done/c, and the leader deletes chunk c once every follower has,
so the store holds a few chunks at most. The leader's `stop()` sends the call that ends the followers' loops. When
the leader's process dies, the coordination service goes with it and jax.distributed terminates the followers.

A message is a JSON header, then the raw bytes of its arrays: {"program", "inputs", "arrays": [[dtype, shape], ...]},
each array in `inputs` written {"array": index}, bytes {"bytes": hex}, a dict {"dict": {...}}, a Request
{"request": [its leaves]}.
"""

import dataclasses
import json
from collections.abc import Iterator

import jax
import numpy as np

from linnet_jax.decode import Request
from linnet_jax.ops import SamplingParams

PREFIX = "linnet_jax/lockstep"
CHUNK = 256  # calls per chunk of keys (deleted together)
POLL_MS = 1000  # a follower's wait for the next call, before it asks again
STOP = "stop"  # the program name that ends the followers' loops
# A Request's tree structure (made of placeholders: importing this module starts no JAX backend, which
# jax.distributed.initialize must precede).
REQUEST_TREE = jax.tree.structure(Request(
    sampling=SamplingParams(**{field.name: 0 for field in dataclasses.fields(SamplingParams)}),
    **{field.name: 0 for field in dataclasses.fields(Request) if field.name != "sampling"}))


def distributed_client():
    """jax.distributed's client (its key-value store), or a RuntimeError when jax.distributed is not initialized."""
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("a multi-process engine needs jax.distributed.initialize(...) first")
    return client


def encode(program: str, inputs: tuple) -> bytes:
    """One call as bytes: its program's name and its host inputs (see the module docstring)."""
    arrays: list[np.ndarray] = []

    def walk(value):
        if isinstance(value, Request):
            return {"request": [walk(np.asarray(leaf)) for leaf in jax.tree.leaves(value)]}
        if isinstance(value, (np.ndarray, np.generic)):
            arrays.append(np.ascontiguousarray(value).reshape(np.shape(value)))  # a 0-d array stays 0-d
            return {"array": len(arrays) - 1}
        if isinstance(value, bytes):
            return {"bytes": value.hex()}
        if isinstance(value, dict):
            return {"dict": {str(key): walk(item) for key, item in value.items()}}
        if isinstance(value, (list, tuple)):
            return [walk(item) for item in value]
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        raise TypeError(f"a lockstep call's input must be host data (ints, lists, dicts, numpy arrays, Requests), "
                        f"got {type(value).__name__} in {program}")

    header = json.dumps({"program": program, "inputs": walk(list(inputs)),
                         "arrays": [[array.dtype.str, array.shape] for array in arrays]}).encode()
    return b"".join([len(header).to_bytes(8, "little"), header, *(array.tobytes() for array in arrays)])


def decode_call(message: bytes) -> tuple[str, list]:
    """(program, inputs) from `encode`'s bytes."""
    size = int.from_bytes(message[:8], "little")
    header = json.loads(message[8:8 + size])
    arrays, offset = [], 8 + size
    for dtype, shape in header["arrays"]:
        dtype = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        arrays.append(np.frombuffer(message, dtype, count, offset).reshape(shape))
        offset += count * dtype.itemsize

    def walk(value):
        if isinstance(value, list):
            return [walk(item) for item in value]
        if isinstance(value, dict):
            if "array" in value:
                return arrays[value["array"]]
            if "bytes" in value:
                return bytes.fromhex(value["bytes"])
            if "dict" in value:
                return {key: walk(item) for key, item in value["dict"].items()}
            return jax.tree.unflatten(REQUEST_TREE, [walk(leaf) for leaf in value["request"]])
        return value

    return header["program"], walk(header["inputs"])


class Lockstep:
    """This process's end of the calls: the leader (process 0) `send`s each call, a follower iterates `calls()`.

    lockstep = Lockstep()            # after jax.distributed.initialize(...)
    engine = Engine(model, ..., lockstep=lockstep)
    (leader) serve engine, then lockstep.stop()     (follower) engine.follow()
    """

    def __init__(self, client=None, processes: int | None = None, process: int | None = None):
        self.client = distributed_client() if client is None else client
        self.processes = jax.process_count() if processes is None else processes
        self.process = jax.process_index() if process is None else process
        self.sent = 0
        self.kept: list[int] = []  # the leader's chunks not yet deleted

    @property
    def leader(self) -> bool:
        return self.process == 0

    def send(self, program: str, inputs: tuple) -> None:
        """(The leader) call number `sent` to every follower."""
        chunk = self.sent // CHUNK
        if self.sent % CHUNK == 0:
            self._collect()
            self.kept.append(chunk)
        self.client.key_value_set_bytes(f"{PREFIX}/{chunk}/{self.sent}", encode(program, inputs))
        self.sent += 1

    def stop(self) -> None:
        """(The leader) end the followers' loops: they return from `Engine.follow` once they have run every call."""
        self.send(STOP, ())

    def _collect(self) -> None:
        """Delete the chunks every follower has run."""
        for chunk in list(self.kept):
            try:
                done = int(self.client.key_value_try_get(f"{PREFIX}/done/{chunk}"))
            except jax.errors.JaxRuntimeError:  # NOT_FOUND: no follower has finished it
                done = 0
            if done == self.processes - 1:
                self.client.key_value_delete(f"{PREFIX}/{chunk}/")
                self.client.key_value_delete(f"{PREFIX}/done/{chunk}")
                self.kept.remove(chunk)

    def calls(self) -> Iterator[tuple[str, list]]:
        """(A follower) the leader's calls, in its order, until it stops."""
        received = 0
        while True:
            chunk = received // CHUNK
            try:
                message = self.client.blocking_key_value_get_bytes(f"{PREFIX}/{chunk}/{received}", POLL_MS)
            except jax.errors.JaxRuntimeError as error:
                if "DEADLINE_EXCEEDED" in str(error):  # no call yet: the leader is idle
                    continue
                raise
            received += 1
            if received % CHUNK == 0:
                self.client.key_value_increment(f"{PREFIX}/done/{chunk}", 1)
            program, inputs = decode_call(message)
            if program == STOP:
                return
            yield program, inputs
