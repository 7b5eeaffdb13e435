"""Ragged paged attention (`ops.paged_attention`, issue 45's attention over a pool of pages): the CPU form equals
dense causal attention over each sequence's keys gathered from its pages, on a ragged step that mixes decoding
sequences and prefill chunks, in float32 to 1e-5; JAX's Pallas paged attention for GPU, run in interpret mode on
this CPU, equals it on decode steps, and the reference of JAX's ragged paged attention for TPU on ragged ones."""

import numpy as np
import pytest
from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention
from jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel import ref_ragged_paged_attention as tpu_reference

from linnet_jax.ops import paged_attention as cpu_form
from linnet_jax.ops.paged_attention import ragged_paged_attention


def ragged_step(kv_lens, q_lens, *, heads=4, groups=2, size=16, page=8, pages=32, tokens=None, seed=0):
    """A random pool and one step: sequences of kv_lens keys whose last q_lens are the step's tokens, each on
    pages drawn at random from the pool (its table's unused columns point at random pages too), packed on one
    token axis with `tokens` - sum(q_lens) padding tokens after them. Returns the kernel's arguments."""
    rng = np.random.default_rng(seed)
    columns = max(-(-n // page) for n in kv_lens)
    order = rng.permutation(pages)
    table = rng.integers(0, pages, (len(kv_lens), columns)).astype(np.int32)
    taken = 0
    for s, n in enumerate(kv_lens):
        held = -(-n // page)
        table[s, :held], taken = order[taken:taken + held], taken + held
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    tokens = tokens or int(cu[-1])
    return dict(q=rng.normal(size=(tokens, heads, size)).astype(np.float32),
                k_pages=rng.normal(size=(pages, page, groups, size)).astype(np.float32),
                v_pages=rng.normal(size=(pages, page, groups, size)).astype(np.float32),
                kv_lens=np.asarray(kv_lens, np.int32), page_indices=table, cu_q_lens=cu,
                num_seqs=np.asarray([len(kv_lens)], np.int32))


def dense_reference(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs):
    """Each sequence's keys gathered from its pages in NumPy, then causal softmax attention (float64)."""
    heads, groups, size = q.shape[1], k_pages.shape[2], q.shape[2]
    out = np.zeros(q.shape)
    for s in range(num_seqs[0]):
        n, first, last = kv_lens[s], cu_q_lens[s], cu_q_lens[s + 1]
        keys = k_pages[page_indices[s]].reshape(-1, groups, size)[:n].astype(np.float64)
        values = v_pages[page_indices[s]].reshape(-1, groups, size)[:n].astype(np.float64)
        keys, values = (np.repeat(x, heads // groups, axis=1) for x in (keys, values))
        for t in range(first, last):
            position = n - (last - t)
            scores = np.einsum("hd,khd->hk", q[t], keys[:position + 1]) / np.sqrt(size)
            weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
            out[t] = np.einsum("hk,khd->hd", weights / weights.sum(axis=-1, keepdims=True), values[:position + 1])
    return out


MIXED = dict(kv_lens=[5, 37, 1, 20, 64], q_lens=[1, 16, 1, 7, 1])  # decodes and prefill chunks, ragged


@pytest.mark.parametrize("blocked_from", [0, 128])  # in blocks of 16 queries of one sequence, or a token at a time
def test_the_cpu_form_equals_dense_attention_on_a_ragged_step(blocked_from, monkeypatch):
    monkeypatch.setattr(cpu_form, "BLOCKED_FROM", blocked_from)
    step = ragged_step(**MIXED, tokens=32)
    out = np.asarray(ragged_paged_attention(**step))
    want = dense_reference(**step)
    used = step["cu_q_lens"][-1]
    assert np.abs(out[:used] - want[:used]).max() <= 1e-5
    assert not out[used:].any()  # padding tokens give zeros


def test_a_table_wider_than_the_sequences_changes_nothing():
    """Columns past a sequence's pages (a larger bucket of the table) hold other sequences' pages: never read."""
    step = ragged_step(**MIXED)
    wider = dict(step, page_indices=np.concatenate([step["page_indices"], step["page_indices"][::-1]], axis=1))
    np.testing.assert_allclose(ragged_paged_attention(**wider), ragged_paged_attention(**step), atol=1e-6)


def test_the_tpu_kernels_contract_equals_the_cpu_form():
    """JAX's ragged paged attention for TPU takes keys and values interleaved on one head axis; its reference (what
    JAX tests the kernel against) gives the CPU form's outputs on the same step, to 1e-5 in float32. The kernel
    itself does not run under Pallas's TPU interpreter on jax 0.10.2 or 0.12.1: it loads through a reshaped ref,
    which the interpreter refuses ('ReshapeTransform' object has no attribute 'indices')."""
    step = ragged_step(kv_lens=[5, 37, 20, 64], q_lens=[1, 16, 3, 1], heads=4, groups=2, size=128, page=16, pages=12,
                       tokens=24)
    kv = np.stack([step["k_pages"], step["v_pages"]], axis=3).reshape(*step["k_pages"].shape[:2], -1, 128)
    used = step["cu_q_lens"][-1]
    out = tpu_reference(step["q"][:used], kv, step["kv_lens"], step["page_indices"], step["cu_q_lens"],
                        step["num_seqs"], sm_scale=128 ** -0.5)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ragged_paged_attention(**step))[:used], atol=1e-5)


@pytest.mark.parametrize("kv_lens", [[5, 37, 1, 20], [16, 16, 64, 3]])
def test_the_gpu_decode_kernel_in_interpret_mode_equals_the_cpu_form(kv_lens):
    """JAX's paged attention for GPU (one query per sequence: a decode step; pages [G, P, C, D]) in interpret
    mode: the same outputs as the CPU form, to 1e-5 in float32."""
    step = ragged_step(kv_lens=kv_lens, q_lens=[1] * len(kv_lens), heads=4, groups=2, size=16, page=16, pages=16)
    out = paged_attention(step["q"] / np.sqrt(16), step["k_pages"].transpose(2, 0, 1, 3),
                          step["v_pages"].transpose(2, 0, 1, 3), step["page_indices"], step["kv_lens"],
                          block_h=16, pages_per_compute_block=1, k_splits=1, interpret=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ragged_paged_attention(**step)), atol=1e-5)
