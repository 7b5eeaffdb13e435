"""The decoder over a paged KV cache, one step's tokens packed on one axis (`models.paged`, issue 45): three
sequences prefilled in one packed step, then a step that mixes two decoding sequences with the next chunk of the
third, on pages scattered through the pool, give the full forward's logits at every token (float32, 1e-5), with
GQA, biases, q/k norms and a sliding window; padding tokens write nothing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import linnet_jax
from linnet_jax.models.decoder import forward
from linnet_jax.models.paged import StepLayout, init_pages, paged_forward

PAGE, POOL = 4, 40


def layout(kv_lens, q_lens, table) -> StepLayout:
    return StepLayout(kv_lens=jnp.asarray(kv_lens, jnp.int32), page_indices=jnp.asarray(table, jnp.int32),
                      cu_q_lens=jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32),
                      num_seqs=jnp.asarray([len(kv_lens)], jnp.int32))


def full_logits(model, ids: list[int]) -> np.ndarray:
    """The full forward's logits at every position of one sequence [T, V]."""
    tokens = jnp.asarray([ids], jnp.int32)
    logits, _ = forward(model.params, model.config, tokens, jnp.arange(len(ids))[None])
    return np.asarray(logits[0])


@pytest.mark.parametrize("name", ["llama_gqa_llama3", "qwen2_bias_tied", "qwen3_qk_norm", "mistral_sliding"])
def test_packed_steps_over_pages_equal_the_full_forward(tiny_dir, name):
    model = linnet_jax.load(tiny_dir(name)[1], progress=False)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, model.config.vocab_size, n).tolist() for n in (9, 3, 14)]
    later = [rng.integers(0, model.config.vocab_size, n).tolist() for n in (1, 1, 6)]  # two decodes, one chunk
    whole = [p + q for p, q in zip(prompts, later)]
    width = max(-(-len(ids) // PAGE) for ids in whole)
    table = rng.permutation(POOL)[:3 * width].reshape(3, width)  # each sequence's pages, scattered
    cache = init_pages(model.config, POOL, PAGE)
    step = jax.jit(paged_forward, static_argnums=1)
    for chunks, lengths, padding in ((prompts, [len(p) for p in prompts], 5),
                                     (later, [len(ids) for ids in whole], 3)):
        tokens = np.concatenate([np.concatenate(chunks), np.zeros(padding)]).astype(np.int32)
        used = sum(map(len, chunks))
        logits, cache = step(model.params, model.config, jnp.asarray(tokens), cache,
                             layout(lengths, [len(c) for c in chunks], table), jnp.arange(used))
        want = np.concatenate([full_logits(model, ids)[n - len(chunk):n]
                               for ids, chunk, n in zip(whole, chunks, lengths)])
        assert np.abs(np.asarray(logits) - want).max() <= 1e-5, name
    unused = np.setdiff1d(np.arange(POOL), table)
    assert not np.asarray(cache.k[0])[unused].any()  # padding tokens wrote nothing
