"""ops.matvec: linnet's XLA:CPU matrix-vector kernels (ops/cpu_kernels.cc) give what jnp.einsum gives, run
exactly where the hardware plan asks for them (batch-1 products on one CPU device), and never reach an export."""

import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import linnet_jax
from linnet_jax.backend import decode_params, plan_for_platform
from linnet_jax.ops import matvec, quantized

from test_unrolled import prefill_then_decode

# Every product of a decode step (SmolLM2's shapes), an odd-sized one, and the head stored [vocab, embed]; one row,
# and the rows of a verify or a batched decode step (each kernel's row tails: 4 per pass over xw, 2 or 4 over wx).
KERNEL_CASES = [
    ("btd,dhk->bthk", (1, 1, 576), (576, 9, 64)),
    ("btd,dgk->btgk", (1, 1, 576), (576, 3, 64)),
    ("bthk,hkd->btd", (1, 1, 9, 64), (9, 64, 576)),
    ("btd,df->btf", (1, 1, 576), (576, 1536)),
    ("btf,fd->btd", (1, 1, 1536), (1536, 576)),
    ("btd,vd->btv", (1, 1, 576), (49152, 576)),
    ("btd,df->btf", (1, 1, 67), (67, 13)),
    ("btd,vd->btv", (1, 1, 67), (13, 67)),
    ("btd,df->btf", (1, 9, 576), (576, 1536)),
    ("btf,fd->btd", (16, 1, 1536), (1536, 576)),
    ("btd,vd->btv", (1, 7, 576), (49152, 576)),
    ("btd,df->btf", (3, 2, 67), (67, 45)),
    ("btd,vd->btv", (2, 3, 67), (13, 67)),
    ("btd,df->btf", (32, 1, 64), (64, 32)),
]
# What stays with jnp.einsum: more rows than the kernels take, bfloat16, a contraction the kernels do not take.
PLAIN_CASES = [
    ("btd,df->btf", (33, 1, 64), (64, 32), jnp.float32),
    ("btd,vd->btv", (1, 33, 64), (100, 64), jnp.float32),
    ("btd,df->btf", (1, 1, 64), (64, 32), jnp.bfloat16),
    ("ntk,nsk->nts", (1, 1, 64), (1, 16, 64), jnp.float32),
]


def jitted(spec: str):
    return jax.jit(lambda x, w: matvec.einsum(spec, x, w))


def test_the_kernels_are_built():
    assert matvec.available(), "ops/_cpu_kernels*.so is missing: `pip install -e .` builds it (needs g++)"


def test_kernels_built_against_a_newer_jaxlib_are_left_unregistered(monkeypatch):
    """An XLA older than the handlers' FFI API stops its whole CPU backend: such kernels are refused with one
    warning, and the plan then takes XLA's products (nothing ever reaches jax.ffi.register_ffi_target)."""
    monkeypatch.setattr(matvec, "built_against", lambda library: "99.0.0")
    with pytest.warns(UserWarning, match="built against jaxlib 99.0.0") as warned:
        refused = matvec.available.__wrapped__()  # the check itself, past the cache of this process's answer
    assert not refused and len(warned) == 1
    monkeypatch.setattr(matvec, "available", lambda: refused)
    plan = plan_for_platform("cpu")
    assert not plan.matvec_kernels and plan.einsum is quantized.einsum


def test_kernels_that_were_not_built_are_named_in_one_warning(monkeypatch):
    """An install without a C++ compiler has no kernels (setup.py builds them as an optional extension): the
    plan falls back to XLA's products, and says so once, with how to build them."""
    monkeypatch.setattr(matvec, "library_path", lambda: None)
    with pytest.warns(UserWarning, match=r"kernels are not built .* Install g\+\+ and run `pip install -e \.`") as warned:
        refused = matvec.available.__wrapped__()
    assert not refused and len(warned) == 1


def test_kernels_run_on_their_own_jaxlib_and_newer_ones():
    assert matvec.runs_on("0.10.2", "0.10.2") and matvec.runs_on("0.10.2", "0.12.0.1")
    assert matvec.runs_on("0.10.2", "0.11.0.dev20260101")
    assert not matvec.runs_on("0.11.0", "0.10.2") and not matvec.runs_on(None, "0.12.0.1")


@pytest.mark.parametrize("spec,x_shape,w_shape", KERNEL_CASES)
def test_a_kernel_product_equals_einsum(spec, x_shape, w_shape):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal(x_shape, dtype=np.float32))
    w = jnp.asarray(rng.standard_normal(w_shape, dtype=np.float32))
    assert "linnet_" in jitted(spec).lower(x, w).as_text()  # the product is the kernel's
    got, expected = jitted(spec)(x, w), jnp.einsum(spec, x, w, precision="highest")
    assert got.shape == expected.shape and got.dtype == jnp.float32
    scale = float(jnp.abs(expected).max())
    assert float(jnp.abs(got - expected).max()) < 1e-5 * scale * np.sqrt(x.size)


@pytest.mark.parametrize("spec,x_shape,w_shape", KERNEL_CASES[:8])
def test_a_kernel_products_row_is_the_same_alone_or_among_others(spec, x_shape, w_shape):
    """A row's result, bit for bit, alone or among 5 (a request's tokens do not depend on its batch)."""
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.standard_normal((5, 1, *x_shape[2:]), dtype=np.float32))
    w = jnp.asarray(rng.standard_normal(w_shape, dtype=np.float32))
    together = np.asarray(jitted(spec)(x, w))
    for row in (0, 4):
        np.testing.assert_array_equal(np.asarray(jitted(spec)(x[row:row + 1], w))[0], together[row])


@pytest.mark.parametrize("spec,x_shape,w_shape,dtype", PLAIN_CASES)
def test_other_products_stay_with_einsum(spec, x_shape, w_shape, dtype):
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal(x_shape, dtype=np.float32)).astype(dtype)
    w = jnp.asarray(rng.standard_normal(w_shape, dtype=np.float32)).astype(dtype)
    assert "custom_call" not in jitted(spec).lower(x, w).as_text()
    np.testing.assert_array_equal(np.asarray(jitted(spec)(x, w)), np.asarray(jax.jit(
        lambda x, w: jnp.einsum(spec, x, w))(x, w)))


@pytest.mark.parametrize("rows,depth,width", [(3, 64, 640), (27, 64, 37), (5, 45, 13)])
def test_attention_products_over_the_filled_slots_equal_einsum(rows, depth, width):
    """`batched`'s kernel: the scores of the first slots[n] keys are einsum's and the rest 0; the mixing over the
    first slots[n] values (probabilities 0 past them) is einsum's over all of them. Rows with no slot, all slots,
    and slot counts off the kernel's groups of four and eight."""
    rng = np.random.default_rng(2)
    n = 6
    slots = jnp.asarray([0, width, 1, width - 1, 5, width // 2], jnp.int32)
    filled = np.arange(width)[None, None] < np.asarray(slots)[:, None, None]  # [N, 1, width]
    queries = jnp.asarray(rng.standard_normal((n, rows, depth), dtype=np.float32))
    keys = jnp.asarray(rng.standard_normal((n, width, depth), dtype=np.float32))
    scores = jax.jit(matvec.batched, static_argnums=3)
    assert "linnet_abt" in scores.lower(queries, keys, slots, False).as_text()
    expected = np.where(filled, np.einsum("nic,njc->nij", queries, keys), 0)
    np.testing.assert_allclose(np.asarray(scores(queries, keys, slots, False)), expected, atol=1e-5 * np.sqrt(depth))
    probs = jnp.asarray(np.where(filled, rng.random((n, rows, width), dtype=np.float32), 0))
    values = jnp.asarray(rng.standard_normal((n, depth, width), dtype=np.float32))
    np.testing.assert_allclose(np.asarray(scores(probs, values, slots, True)), np.einsum("nis,nks->nik", probs, values),
                               atol=1e-5 * np.sqrt(width))


def test_attention_products_of_a_row_depend_on_nothing_past_its_slots():
    """A row's mixing, bit for bit, whatever slot count past its last nonzero probability it is given (an engine's
    step may reach further than a row's own position) and whatever rows share the call: a request's tokens then do
    not depend on its batch."""
    rng = np.random.default_rng(5)
    rows, depth, width, filled = 3, 16, 96, 37
    probs = np.where(np.arange(width) < filled, rng.random((1, rows, width), dtype=np.float32), 0)
    values = rng.standard_normal((1, depth, width), dtype=np.float32)
    mixing = jax.jit(matvec.batched, static_argnums=3)
    alone = np.asarray(mixing(jnp.asarray(probs), jnp.asarray(values), jnp.asarray([filled], jnp.int32), True))
    for count in (38, 47, 48, 49, 64, width):
        got = mixing(jnp.asarray(probs), jnp.asarray(values), jnp.asarray([count], jnp.int32), True)
        np.testing.assert_array_equal(np.asarray(got), alone, err_msg=f"slots={count}")
    more = np.concatenate([probs, rng.random((1, rows, width), dtype=np.float32)])
    got = mixing(jnp.asarray(more), jnp.asarray(np.concatenate([values, values])), jnp.asarray([48, width], jnp.int32),
                 True)
    np.testing.assert_array_equal(np.asarray(got)[:1], alone)


@pytest.mark.parametrize("dtype,tolerance", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_attention_through_the_products_equals_the_per_head_form(dtype, tolerance):
    """`ops.attention` with `products` (the plan's on one CPU: the kernel for float32, einsum for bfloat16) gives the
    per-head form's output, in q's dtype; rows see different numbers of slots (one under a window). A cache of more
    rows than the queries' (kv_heads given: a decode over an engine's leading rows) reads only its first ones."""
    from linnet_jax.ops.attention import attention

    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dtype)
               for shape in ((2, 3, 6, 8), (4, 40, 8), (4, 8, 40)))
    positions, slots = jnp.asarray([[5, 6, 7], [30, 31, 32]]), jnp.broadcast_to(jnp.arange(40), (2, 40))
    for window in (0, 4):
        got = attention(q, k, v, positions, slots, window, products=matvec.batched)
        expected = attention(q, k, v, positions, slots, window)
        assert got.dtype == dtype
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(expected, np.float32), atol=tolerance)
        more_k, more_v = (jnp.concatenate([a, jnp.asarray(rng.standard_normal((6, *a.shape[1:]), np.float32)
                                                           ).astype(dtype)]) for a in (k, v))
        for products in (matvec.batched, None):
            wider = attention(q, more_k, more_v, positions, slots, window, products=products, kv_heads=2)
            np.testing.assert_array_equal(np.asarray(wider, np.float32),
                                          np.asarray(attention(q, k, v, positions, slots, window, products=products),
                                                     np.float32))


@pytest.mark.parametrize("name", ["llama_gqa_llama3", "mistral_sliding", "qwen2_bias_tied", "qwen3_qk_norm"])
def test_decoding_through_the_kernels_equals_decoding_without(name, tiny_dir):
    """One row, and rows of different lengths: a prefill then one token at a time, the kernels' logits (products,
    and attention over each row's filled slots) are einsum's, to float32 rounding, at every position a row holds."""
    model = dataclasses.replace(linnet_jax.load(tiny_dir(name)[1], progress=False))
    assert model.plan.matvec_kernels and model.plan.einsum is matvec.einsum
    assert model.plan.attention_products(3, 1) is matvec.batched and model.plan.attention_products(33, 11) is None
    assert model.plan.attention_products(16, 16) is None and model.plan.step_einsum(16) is quantized.einsum
    params = decode_params(model.params, model.plan)
    ids = np.random.default_rng(4).integers(0, model.config.vocab_size, (3, 30))
    positions = np.stack([np.arange(30), np.r_[np.arange(24), [-1] * 6], np.r_[np.arange(12), [-1] * 18]])
    for rows in (1, 3):  # one row: the matrix-vector kernels too
        got = prefill_then_decode(model, params, ids[:rows], positions[:rows], prefill=20, plan=model.plan)
        expected = prefill_then_decode(model, params, ids[:rows], positions[:rows], prefill=20)
        assert np.abs(got - expected)[positions[:rows] >= 0].max() < 1e-5


def test_generate_on_smollm2_runs_the_kernels(smollm2):
    """The default path: `generate`'s decode program calls the kernels, and its greedy tokens are the ones
    XLA's own products give."""
    from linnet_jax.decode import decode_program
    from linnet_jax.inputs import new_slots

    assert smollm2.plan.einsum is matvec.einsum
    program = decode_program().lower(smollm2.decode_params, smollm2.config, new_slots(smollm2, 1, 64),
                                     np.int32(4), 4, plan=smollm2.plan).as_text()
    assert "linnet_xw" in program and "linnet_wx" in program
    plain = dataclasses.replace(smollm2)
    plain.__dict__["plan"] = dataclasses.replace(smollm2.plan, matvec_kernels=False)  # the cached property, preset
    prompt = "The three primary colors are"
    kernels = linnet_jax.generate(smollm2, prompt, max_new_tokens=24, return_details=True)
    einsum = linnet_jax.generate(plain, prompt, max_new_tokens=24, return_details=True)
    assert kernels.tokens == einsum.tokens
    assert np.abs(np.asarray(kernels.logprobs) - np.asarray(einsum.logprobs)).max() < 1e-3


def test_params_on_a_mesh_keep_einsum(shardable_dir):
    """The kernels take whole arrays on one device: weights sharded over eight CPU devices keep XLA's products."""
    script = f"""
import numpy as np, linnet_jax
from linnet_jax import sharding
model = linnet_jax.load({str(shardable_dir)!r}, mesh=sharding.mesh(data=2, tensor=4), progress=False)
from linnet_jax.ops import matvec, quantized
assert not model.plan.matvec_kernels and model.plan.einsum is not matvec.einsum
one = linnet_jax.load({str(shardable_dir)!r}, progress=False)
assert one.plan.matvec_kernels and one.plan.einsum is matvec.einsum
ids = [[3, 14, 15, 9, 2, 6]]
assert linnet_jax.generate(model, tokens=ids, max_new_tokens=6) == linnet_jax.generate(one, tokens=ids, max_new_tokens=6)
"""
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env=os.environ | env)
    assert done.returncode == 0, done.stderr[-3000:]
