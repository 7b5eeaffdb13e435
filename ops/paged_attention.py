"""Ragged paged attention: one step's tokens packed on one axis, each attending to the keys its sequence holds in a
shared pool of pages (vLLM's block tables; the layout of JAX's Pallas kernels, ragged paged attention on TPU and
paged attention on GPU).

Shapes: T tokens of the step (its queries), H query heads over G key/value heads (R = H / G query heads share
one, HF's grouping: head h reads key/value head h // R), D the head size; a pool of P pages of C positions each;
S sequences, each with a row of M pages in the page table (M · C ≥ its keys). Sequence s's queries are tokens
cu_q_lens[s]:cu_q_lens[s + 1], in order, and they are the last of its kv_lens[s] positions (their keys are in the
pool already): token t of sequence s sits at position kv_lens[s] - (cu_q_lens[s + 1] - t) and sees that sequence's
keys at positions up to its own. A decoding sequence has one token, a prefill chunk many. Tokens past
cu_q_lens[num_seqs] are padding; their outputs are zeros.

    ragged_paged_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs) -> [T, H, D]

The form for XLA:CPU: a loop over the page columns that the step's longest sequence fills (a bound computed on the
device, at most the table's M), each iteration gathering a page for each block of queries and folding it into an
online softmax (as the kernels run), so a step's cost follows its sequences' lengths, never max_len's columns or the
pool's size. A step of up to BLOCKED_FROM tokens has a block per token; a longer one (prompt chunks) cuts each
sequence's tokens into blocks of QUERY_BLOCK (the TPU kernel's query blocks), so a page is gathered once for 16
queries, not once for each, at the price of a block for each decoding sequence's one token. On SmolLM2 (2 CPU
cores, 16 decodes at 400 tokens and a chunk) attention per layer took 3.5 / 6.0 / 10 / 31 ms a token at a time and
6.7 / 7.4 / 11 / 13.5 ms in blocks, at 32 / 64 / 128 / 256 tokens; the step of 14 decodes and two chunks of 249
tokens (T = 512) took 1,870 ms a token at a time and 1,169 ms in blocks, 659 ms of it outside attention. In the
engine (32 requests of 128-512 tokens), steps of 32 tokens took 217 ms a token at a time against 317 in blocks, and
steps of 128 tokens 807 ms against 531.

Einsum legend: t tokens, g key/value heads, r query heads per key/value head, c positions of a page, d head size.
"""

import jax
import jax.numpy as jnp

QUERY_BLOCK = 16  # a step of more than BLOCKED_FROM tokens attends in blocks of this many queries of one sequence
BLOCKED_FROM = 32


def token_places(cu_q_lens: jax.Array, kv_lens: jax.Array, num_seqs: jax.Array, tokens: int
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Each packed token's sequence [T] int32, its position in that sequence [T] int32, and whether it is a real
    token (not padding past the last sequence's) [T] bool. cu_q_lens: [S + 1]; kv_lens: [S]; num_seqs: [1]."""
    index = jnp.arange(tokens, dtype=jnp.int32)
    used = cu_q_lens[num_seqs[0]]
    sequence = jnp.clip(jnp.searchsorted(cu_q_lens, index, side="right") - 1, 0, kv_lens.shape[0] - 1)
    position = kv_lens[sequence] - (cu_q_lens[sequence + 1] - index)
    return sequence.astype(jnp.int32), position.astype(jnp.int32), index < used


def query_blocks(cu_q_lens: jax.Array, num_seqs: jax.Array, tokens: int, block: int) -> tuple[jax.Array, jax.Array]:
    """The step's queries cut into blocks of `block` tokens of one sequence each (a sequence's tokens in order, its
    last block partial): each block's token indices [N, block] (`tokens` where a block has no token there) and its
    sequence [N], for N = ⌈tokens / block⌉ + S blocks, enough for any step (blocks past the last sequence's are
    empty)."""
    sequences = cu_q_lens.shape[0] - 1
    lens = jnp.where(jnp.arange(sequences) < num_seqs[0], cu_q_lens[1:] - cu_q_lens[:-1], 0)
    counts = -(-lens // block)
    ends = jnp.cumsum(counts)  # each sequence's blocks end here
    index = jnp.arange(-(-tokens // block) + sequences)
    sequence = jnp.minimum(jnp.searchsorted(ends, index, side="right"), sequences - 1).astype(jnp.int32)
    first = cu_q_lens[sequence] + (index - ends[sequence] + counts[sequence]) * block
    token = first[:, None] + jnp.arange(block)
    kept = (index < ends[-1])[:, None] & (token < cu_q_lens[sequence + 1][:, None])
    return jnp.where(kept, token, tokens).astype(jnp.int32), sequence


def ragged_paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, kv_lens: jax.Array,
                           page_indices: jax.Array, cu_q_lens: jax.Array, num_seqs: jax.Array, *,
                           sm_scale: float | None = None, window: int | jax.Array = 0) -> jax.Array:
    """Causal attention of packed tokens over their sequences' pages (see the module docstring).

    q: [T, H, D]; k_pages, v_pages: [P, C, G, D]; kv_lens: [S] int32; page_indices: [S, M] int32 (pages of the
    pool; entries past a sequence's last page are never read into its result); cu_q_lens: [S + 1] int32;
    num_seqs: [1] int32; sm_scale: the scores' scale (default 1/√D); window: a sliding window, keys fewer than
    `window` positions before the query's (0: every earlier key, HF's and the kernels' convention). Returns
    [T, H, D] in q's dtype, softmax in float32."""
    q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs = map(
        jnp.asarray, (q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs))
    tokens, heads, size = q.shape
    _, page, groups, _ = k_pages.shape
    sequences = kv_lens.shape[0]
    sequence, position, real = token_places(cu_q_lens, kv_lens, num_seqs, tokens)
    # up to BLOCKED_FROM tokens: a block per token; more: blocks of QUERY_BLOCK tokens of one sequence, so a page is
    # gathered once for a block's queries, not once for each (module docstring)
    block = 1 if tokens <= BLOCKED_FROM else QUERY_BLOCK
    if block == 1:
        index, owner = jnp.arange(tokens, dtype=jnp.int32)[:, None], sequence
    else:
        index, owner = query_blocks(cu_q_lens, num_seqs, tokens, block)
    taken = jnp.minimum(index, tokens - 1)  # [N, Q]
    held = (index < tokens) & real[taken]
    where = position[taken]  # [N, Q] each query's position
    pages = page_indices[owner]  # [N, M]
    scale = size ** -0.5 if sm_scale is None else sm_scale
    queries = (q[taken].astype(jnp.float32) * scale).reshape(*index.shape, groups, heads // groups, size)

    def fold(column, carry):
        out, top, mass = carry  # [N, Q, G, R, D], [N, Q, G, R], [N, Q, G, R]
        keys = k_pages[pages[:, column]].astype(jnp.float32)  # [N, C, G, D]
        values = v_pages[pages[:, column]].astype(jnp.float32)
        scores = jnp.einsum("nqgrd,ncgd->nqgrc", queries, keys)
        behind = where[..., None] - (column * page + jnp.arange(page))  # [N, Q, C]
        seen = held[..., None] & (behind >= 0) & ((window == 0) | (behind < window))
        scores = jnp.where(seen[:, :, None, None, :], scores, -jnp.inf)
        new_top = jnp.maximum(top, scores.max(axis=-1))
        shift = jnp.where(jnp.isfinite(new_top), new_top, 0.0)  # a row that has seen nothing yet stays at zero
        weights = jnp.exp(scores - shift[..., None])
        kept = jnp.exp(top - shift)
        out = out * kept[..., None] + jnp.einsum("nqgrc,ncgd->nqgrd", weights, values)
        return out, new_top, mass * kept + weights.sum(axis=-1)

    start = (jnp.zeros(queries.shape, jnp.float32), jnp.full(queries.shape[:-1], -jnp.inf, jnp.float32),
             jnp.zeros(queries.shape[:-1], jnp.float32))
    used = jnp.where(jnp.arange(sequences) < num_seqs[0], kv_lens, 0)
    columns = jnp.minimum((used.max() + page - 1) // page, page_indices.shape[1])  # the longest sequence's pages
    out, _, mass = jax.lax.fori_loop(0, columns, fold, start)
    out = (out / jnp.where(mass > 0, mass, 1.0)[..., None]).reshape(-1, heads, size)
    return jnp.zeros((tokens, heads, size), q.dtype).at[index.reshape(-1)].set(out.astype(q.dtype), mode="drop")
