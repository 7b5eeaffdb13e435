"""The decoder over a paged KV cache, one step's tokens packed on one axis (DESIGN.md decision 19): decoding
sequences' next tokens and prefill chunks together, with no per-row padding, reading the weights once.

The cache is a pool of P pages of C positions per layer, shared by every sequence; a sequence's page-table row
says which pages hold its positions (position p: column p // C, offset p % C). A step's layout is plain fixed-size
arrays (`ops.paged_attention`'s): kv_lens [S] (each sequence's length after the step), page_indices [S, M],
cu_q_lens [S + 1] (its tokens' spans on the token axis: the last of its kv_lens positions) and num_seqs [1]. Each
new token's key and value are written at its position's page before the layer attends, so one program serves a
prefill chunk, a decode token and speculative drafts alike, and cost follows the tokens and the table's M columns
(a bucket), never the pool.

    paged_forward(params, config, tokens [T], cache, layout, logits_at [O], lora) -> (logits [O, V], cache)

Einsum legend as in `models.decoder`.
"""

import flax.struct
import jax
import jax.numpy as jnp

from linnet_jax.models.config import Config
from linnet_jax.models.decoder import layer_params, residual_block
from linnet_jax.models.lora import LoraTable
from linnet_jax.models.params import Params
from linnet_jax.ops import quantized, rms_norm
from linnet_jax.ops.paged_attention import ragged_paged_attention, token_places


@flax.struct.dataclass
class PagedCache:
    """Keys k and values v: L per-layer pools [P, C, G, K] (P pages of C positions)."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[1]


@flax.struct.dataclass
class StepLayout:
    """Where one step's packed tokens belong (`ops.paged_attention`): kv_lens [S], page_indices [S, M],
    cu_q_lens [S + 1], num_seqs [1], all int32."""

    kv_lens: jax.Array
    page_indices: jax.Array
    cu_q_lens: jax.Array
    num_seqs: jax.Array


def init_pages(config: Config, pages: int, page_size: int, dtype=None) -> PagedCache:
    """An empty pool of `pages` pages of `page_size` positions per layer, in the params dtype unless told otherwise."""
    shape, dtype = (pages, page_size, config.num_kv_heads, config.head_dim), dtype or config.dtype
    return PagedCache(k=tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers)),
                      v=tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers)))


def write_places(layout: StepLayout, positions: jax.Array, real: jax.Array, sequence: jax.Array, pages: int,
                 page_size: int) -> tuple[jax.Array, jax.Array]:
    """Each token's (page, offset) [T] each: its position's page in its sequence's row and the offset in it; a
    page past the pool (dropped by the scatter) for padding tokens."""
    page = layout.page_indices[sequence, jnp.maximum(positions, 0) // page_size]
    return jnp.where(real, page, pages), positions % page_size


def paged_forward(params: Params, config: Config, tokens: jax.Array, cache: PagedCache, layout: StepLayout,
                  logits_at: jax.Array, lora: LoraTable | None = None,
                  einsum=quantized.einsum) -> tuple[jax.Array, PagedCache]:
    """Logits [O, V] (float32) at the packed tokens `logits_at` [O], and the cache with every real token's key and
    value written. tokens: [T] int32, sequence s's at cu_q_lens[s]:cu_q_lens[s + 1] (padding after the last).
    lora: the adapter table with each token's entry (`LoraTable.rows`, index [T]), or None. The blocks run over
    the tokens as T rows of one position each ([T, 1, D]), so that each token takes its own adapter entry. params:
    stacked or per-layer (`layer_params`); einsum: how the products run (a plan's, `linnet_jax.backend.Plan.einsum`:
    on XLA:CPU linnet's kernels take a step of up to their rows)."""
    sequence, positions, real = token_places(layout.cu_q_lens, layout.kv_lens, layout.num_seqs, tokens.shape[0])
    pages, page_size = cache.k[0].shape[0], cache.page_size
    page, offset = write_places(layout, positions, real, sequence, pages, page_size)
    x = quantized.take_rows(params.embed, tokens[:, None])  # [T, 1, D]
    keys, values = list(cache.k), list(cache.v)
    for layer in range(config.num_layers):
        def attend(q, k, v, layer=layer):  # [T, 1, H or G, K]
            keys[layer] = keys[layer].at[page, offset].set(k[:, 0].astype(keys[layer].dtype), mode="drop")
            values[layer] = values[layer].at[page, offset].set(v[:, 0].astype(values[layer].dtype), mode="drop")
            return ragged_paged_attention(q[:, 0], keys[layer], values[layer], layout.kv_lens, layout.page_indices,
                                          layout.cu_q_lens, layout.num_seqs,
                                          window=config.layer_windows[layer])[:, None]

        x = residual_block(x, layer_params(params, layer), config, jnp.where(real, positions, -1)[:, None], attend,
                           None if lora is None else lora.layer(layer), einsum)
    x = rms_norm(x[logits_at, 0], params.final_norm, config.rms_norm_eps)
    head = params.embed if params.lm_head is None else params.lm_head
    logits = einsum("od,vd->ov", x, head, preferred_element_type=jnp.float32)
    return logits, PagedCache(k=tuple(keys), v=tuple(values))
