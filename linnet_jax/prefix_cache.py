"""A prefix cache: the keys and values of prompts' leading blocks, kept to be copied into a slot instead of
recomputed (a chat's earlier turns, a shared system prompt, few-shot examples).

A block is `block` consecutive tokens at positions i * block ..; it is named by a digest of every token up
to its end, so a block is reused only after exactly the same prefix. The blocks live in a pool on the
model's devices: a KVCache of P rows of `block` slots (`linnet_jax.models.decoder`), one row per block,
bounded by a size in bytes and evicted least recently used first. Copies in and out of a decode state's
row are two programs of fixed shape (every block of a row at once, the unused ones dropped), so any hit
length compiles nothing.

A block's keys and values depend only on its tokens and positions (slot i holds position i), so a
prompt served from the cache gets the same first token and the same stream as one prefilled whole.
"""

import collections
import functools
import hashlib

import jax
import jax.numpy as jnp
import numpy as np

from linnet_jax.decode import Slots
from linnet_jax.models import KVCache, init_cache
from linnet_jax.models.config import Config

GIB = 2**30


def split_keys(row: jax.Array, count: int, block: int) -> jax.Array:
    """A row's keys [G, count * block, K] as blocks [count * G, block, K] (block b of head g at b * G + g)."""
    heads, _, dim = row.shape
    return row.reshape(heads, count, block, dim).transpose(1, 0, 2, 3).reshape(count * heads, block, dim)


def split_values(row: jax.Array, count: int, block: int) -> jax.Array:
    """A row's values [G, K, count * block] as blocks [count * G, K, block]."""
    heads, dim, _ = row.shape
    return row.reshape(heads, dim, count, block).transpose(2, 0, 1, 3).reshape(count * heads, dim, block)


def join_keys(blocks: jax.Array, heads: int) -> jax.Array:
    """split_keys undone: [count * G, block, K] → [G, count * block, K]."""
    count, block, dim = blocks.shape[0] // heads, blocks.shape[1], blocks.shape[2]
    return blocks.reshape(count, heads, block, dim).transpose(1, 0, 2, 3).reshape(heads, count * block, dim)


def join_values(blocks: jax.Array, heads: int) -> jax.Array:
    """split_values undone: [count * G, K, block] → [G, K, count * block]."""
    count, dim, block = blocks.shape[0] // heads, blocks.shape[1], blocks.shape[2]
    return blocks.reshape(count, heads, dim, block).transpose(1, 2, 0, 3).reshape(heads, dim, count * block)


def pool_rows(ids: jax.Array, heads: int) -> jax.Array:
    """The pool rows [count * G] of blocks `ids` [count] (an id past the pool: rows past it)."""
    return (ids[:, None] * heads + jnp.arange(heads)).reshape(-1)


@functools.partial(jax.jit, static_argnums=(3,), donate_argnums=(0,))
def save_blocks(pool: KVCache, slots: Slots, row: jax.Array, heads: int, ids: jax.Array) -> KVCache:
    """The first len(ids) blocks of state row `row` into the pool, block b at pool block ids[b] (an id ≥ P: not
    kept). ids: [count] int32 distinct, count * block ≤ the state's slots per row."""
    count, block = ids.shape[0], pool.max_len
    target = pool_rows(ids, heads)
    key_rows = lambda layer: jax.lax.dynamic_slice(layer, (row * heads, 0, 0), (heads, count * block, layer.shape[2]))  # noqa: E731
    value_rows = lambda layer: jax.lax.dynamic_slice(layer, (row * heads, 0, 0), (heads, layer.shape[1], count * block))  # noqa: E731
    return pool.replace(
        k=tuple(whole.at[target].set(split_keys(key_rows(layer), count, block), mode="drop")
                for whole, layer in zip(pool.k, slots.cache.k)),
        v=tuple(whole.at[target].set(split_values(value_rows(layer), count, block), mode="drop")
                for whole, layer in zip(pool.v, slots.cache.v)))


@functools.partial(jax.jit, static_argnums=(3,), donate_argnums=(1,))
def restore_blocks(pool: KVCache, slots: Slots, row: jax.Array, heads: int, ids: jax.Array, used: jax.Array,
                   tokens: jax.Array) -> Slots:
    """Pool blocks ids[:used] into slots [0, used * block) of state row `row` (its other slots are left), and the
    row's seen tokens (the repetition penalty's) set to `tokens` [count * block], those blocks' ids (-1 after)."""
    count, block = ids.shape[0], pool.max_len
    source = pool_rows(ids, heads)
    kept = jnp.arange(count * block) < used * block

    def put(layer, blocks, join, mask):  # blocks: the pool's [P * G, ...] of one layer
        rows = join(jnp.take(blocks, source, axis=0, mode="fill", fill_value=0), heads)
        current = jax.lax.dynamic_slice(layer, (row * heads, 0, 0), rows.shape)
        return jax.lax.dynamic_update_slice(layer, jnp.where(mask, rows, current), (row * heads, 0, 0))

    cache = slots.cache
    seen = jnp.zeros_like(slots.seen[0]).at[jnp.maximum(tokens, 0)].max(tokens >= 0)
    return slots.replace(seen=slots.seen.at[row].set(seen), cache=cache.replace(
        k=tuple(put(layer, blocks, join_keys, kept[None, :, None]) for layer, blocks in zip(cache.k, pool.k)),
        v=tuple(put(layer, blocks, join_values, kept[None, None, :]) for layer, blocks in zip(cache.v, pool.v))))


def block_bytes(config: Config, block: int, dtype) -> int:
    """The bytes of one block's keys and values over every layer."""
    return 2 * config.num_layers * config.num_kv_heads * block * config.head_dim * jnp.dtype(dtype).itemsize


class PrefixCache:
    """Prompts' leading blocks of keys and values, looked up by the exact token prefix (see the module docstring).

    cache = PrefixCache(model, max_len=640, block=64, gib=1.0, most=...)
    hit = cache.lookup(prompt)                   # block ids of the prompt's longest cached prefix
    state = cache.restore(state, row, prompt, hit)   # into the row's first len(hit) * block slots
    cache.store(state, row, prompt)              # the prompt's full blocks, once its prefill is done
    """

    def __init__(self, model, max_len: int, block: int = 64, gib: float = 1.0, most: int | None = None):
        config, dtype = model.config, model.params.dtype
        self.block, self.heads = int(block), config.num_kv_heads
        self.row_blocks = max_len // self.block  # blocks a state row holds
        capacity = int(gib * GIB // block_bytes(config, self.block, dtype))
        self.capacity = max(1, min(capacity, most) if most else capacity)
        self.pool = self._empty_pool(model)
        self.ids: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # digest → pool block, LRU first
        self.unused = list(range(self.capacity))
        self.hit_tokens = self.lookup_tokens = 0

    def _empty_pool(self, model) -> KVCache:
        args = (model.config, self.capacity, self.block, model.params.dtype)
        if model.layout is None:
            return jax.device_put(init_cache(*args), model.params.sharding)
        shardings = model.layout.cache_shardings(model.config, self.capacity, self.block)
        return jax.jit(init_cache, static_argnums=range(4), out_shardings=shardings)(*args)

    def digests(self, tokens: list[int], blocks: int, key: bytes) -> list[bytes]:
        """The names of the first `blocks` blocks of tokens: each a digest of `key` (what else the keys and values
        depend on: the adapter; b"" for the base model) and every token up to its end."""
        names, digest = [], hashlib.blake2b(digest_size=16, key=key)
        for b in range(blocks):
            digest.update(np.asarray(tokens[b * self.block:(b + 1) * self.block], np.int64).tobytes())
            names.append(digest.copy().digest())
        return names

    def lookup(self, prompt: list[int], key: bytes = b"") -> list[int]:
        """The pool blocks of the prompt's longest cached prefix of whole blocks, leaving at least its last token to
        prefill (its logits choose the first new one); counted in hit_tokens and lookup_tokens. key: the adapter's
        (`digests`)."""
        hit = []
        for name in self.digests(prompt, min((len(prompt) - 1) // self.block, self.row_blocks), key):
            if name not in self.ids:
                break
            self.ids.move_to_end(name)
            hit.append(self.ids[name])
        self.lookup_tokens += len(prompt)
        self.hit_tokens += len(hit) * self.block
        return hit

    def restore(self, slots: Slots, row: int, prompt: list[int], hit: list[int]) -> Slots:
        """The blocks `hit` (the prompt's first ones) into the first len(hit) * block slots of state row `row`."""
        ids = np.full((self.row_blocks,), self.capacity, np.int32)
        ids[:len(hit)] = hit
        tokens = np.full((self.row_blocks * self.block,), -1, np.int32)
        tokens[:len(hit) * self.block] = prompt[:len(hit) * self.block]
        return restore_blocks(self.pool, slots, np.int32(row), self.heads, ids, np.int32(len(hit)), tokens)

    def compile(self, slots: Slots) -> Slots:
        """Run both copies once, keeping and restoring nothing (so that they are compiled)."""
        nothing = np.full((self.row_blocks,), self.capacity, np.int32)
        self.pool = save_blocks(self.pool, slots, np.int32(0), self.heads, nothing)
        return restore_blocks(self.pool, slots, np.int32(0), self.heads, nothing, np.int32(0),
                              np.full((self.row_blocks * self.block,), -1, np.int32))

    def store(self, slots: Slots, row: int, prompt: list[int], key: bytes = b"") -> None:
        """Keep the prompt's whole blocks (prefilled into state row `row`) that the cache lacks, evicting the least
        recently used blocks when it is full. key: the adapter's (`digests`)."""
        ids = np.full((self.row_blocks,), self.capacity, np.int32)
        for b, name in enumerate(self.digests(prompt, min(len(prompt) // self.block, self.row_blocks), key)):
            if name in self.ids:
                self.ids.move_to_end(name)
                continue
            if not self.unused:  # evict the least recently used block (perhaps one this call had taken)
                evicted = self.ids.popitem(last=False)[1]
                ids[ids == evicted] = self.capacity
                self.unused.append(evicted)
            self.ids[name] = ids[b] = self.unused.pop()
        if (ids < self.capacity).any():
            self.pool = save_blocks(self.pool, slots, np.int32(row), self.heads, ids)
