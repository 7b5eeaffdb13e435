"""int8 weight-only quantization (`load(..., quantize="int8")`): the products against dequantize-then-float, the
tiny families and SmolLM2 against transformers, GGUF Q8_0 read and written as stored, loading's peak memory, and
generate, the engine, sharding and lowering on a quantized model."""

import dataclasses
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix
from conftest import record_parity, reference_logits

import linnet_jax
from linnet_jax import export, generate, logits
from linnet_jax.gguf import open_gguf
from linnet_jax.models.params import Int8Blocks, flatten_params, params_to_hf, quantize_weight
from linnet_jax.ops import matvec, quantized
from linnet_jax.serve import Engine

# max |Δlogit| against transformers float32, measured: SmolLM2 int8 per channel 2.23 on the chat prompt below;
# the tiny random families 0.096 at most.
SMOLLM2_INT8_BOUND = 3.0
TINY_INT8_BOUND = 0.25
# max |Δlogit| of the tiny llama in each compute dtype against its float32 self, measured: bfloat16 0.067, float16
# 0.0089; int8 adds its own (float32 0.096, bfloat16 0.13, float16 0.095).
TINY_DTYPE_BOUNDS = {"float32": 1e-4, "bfloat16": 0.2, "float16": 0.03}
PRODUCTS = [  # (spec, weight shape, its contracted axes): every product the model runs, at SmolLM2's sizes
    ("btd,dhk->bthk", (576, 9, 64), (0,)),
    ("bthk,hkd->btd", (9, 64, 576), (0, 1)),
    ("btd,df->btf", (576, 1536), (0,)),
    ("btf,fd->btd", (1536, 576), (0,)),
    ("btd,vd->btv", (4096, 576), (1,)),
]


@pytest.fixture(params=sorted({False, matvec.int8_digits()}), ids=lambda digits: "digits" if digits else "widened")
def int8_kernels(request, monkeypatch):
    """Both ways the int8 kernels run where this CPU has both: the weights times int8 digits of the activations
    (AVX-512 VNNI), and the weights widened to float."""
    monkeypatch.setattr(matvec, "int8_digits", lambda: request.param)
    return request.param


@pytest.mark.parametrize("rows", [1, 3, matvec.KERNEL_ROWS + 1])
@pytest.mark.parametrize("block", [None, 32])
@pytest.mark.parametrize("spec, shape, contracted", PRODUCTS)
def test_every_int8_product_equals_dequantize_then_float(spec, shape, contracted, block, rows, int8_kernels):
    """A decode step's rows go through linnet's int8 kernels (where they run: one row, or a few sharing each
    weight's dequantization), more through qwix's product: all equal the float product with the dequantized
    weight, within float rounding."""
    weight = jax.random.normal(jax.random.key(0), shape)
    q = quantize_weight(weight, contracted, block)
    x = jax.random.normal(jax.random.key(1), (rows, 1, *(shape[axis] for axis in contracted)))
    product = jax.jit(lambda x, w: matvec.einsum(spec, x, w))
    expected = jnp.einsum(spec, x, qwix.dequantize(q), precision="highest")
    got = product(x, q)
    assert got.shape == expected.shape
    scale = float(jnp.abs(expected).max())
    assert float(jnp.abs(got - expected).max()) <= 2e-6 * scale * np.sqrt(np.prod([shape[a] for a in contracted]))
    kernel = "linnet_" in product.lower(x, q).as_text()
    assert kernel == (rows <= matvec.KERNEL_ROWS and matvec.available())


@pytest.mark.parametrize("block", [None, 32])
@pytest.mark.parametrize("spec, shape, contracted", PRODUCTS)
def test_an_int8_products_row_is_the_same_alone_or_among_others(spec, shape, contracted, block, int8_kernels):
    """One row goes straight from the int8 weights, several through each weight widened once: a row's result is the
    same bit for bit either way (a request's tokens do not depend on its batch)."""
    q = quantize_weight(jax.random.normal(jax.random.key(0), shape), contracted, block)
    x = jax.random.normal(jax.random.key(1), (5, 1, *(shape[axis] for axis in contracted)))
    product = jax.jit(lambda x, w: matvec.einsum(spec, x, w))
    together = np.asarray(product(x, q))
    for row in (0, 4):
        np.testing.assert_array_equal(np.asarray(product(x[row:row + 1], q))[0], together[row])


@pytest.mark.parametrize("quantize", [False, True], ids=["float32", "int8"])
@pytest.mark.parametrize("rows", [1, 3])
def test_a_layers_projections_of_one_input_run_as_one_kernel_call(rows, quantize, int8_kernels):
    """q, k and v (and gate and up) of one input go through one kernel call, float32 or int8, each result the same
    bit for bit as its own call's."""
    weights = [jax.random.normal(jax.random.key(i), shape) for i, shape in enumerate([(576, 9, 64), (576, 3, 64),
                                                                                       (576, 3, 64)])]
    weights = [quantize_weight(w, (0,), None) for w in weights] if quantize else weights
    products = list(zip(["btd,dhk->bthk", "btd,dgk->btgk", "btd,dgk->btgk"], weights))
    x = jax.random.normal(jax.random.key(9), (rows, 1, 576))
    together = jax.jit(lambda x, ws: quantized.einsums(matvec.einsum, x, list(zip([p[0] for p in products], ws))))
    alone = jax.jit(lambda x, w, spec: matvec.einsum(spec, x, w), static_argnums=2)
    for (spec, w), y in zip(products, together(x, weights)):
        np.testing.assert_array_equal(np.asarray(y), np.asarray(alone(x, w, spec)))
    target = "@linnet_xw_int8(" if quantize else "@linnet_xw("
    assert together.lower(x, weights).as_text().count(target) == (1 if matvec.available() else 0)


@pytest.mark.parametrize("outlier", [1.0, 1e4])
@pytest.mark.parametrize("block", [None, 32])
@pytest.mark.parametrize("spec, shape, contracted", [PRODUCTS[2], PRODUCTS[3], PRODUCTS[4]])
def test_int8_digits_round_only_the_activations(spec, shape, contracted, block, outlier, monkeypatch):
    """The digit products round each activation to 2^-23 of the power of two above the row's largest and nothing
    else before the float result: each output is within (2^-22 max |x|) Σ|w| + its own float rounding of the exact
    product, and within 8× float32's own error (numpy's product of the same float32 operands), even where one
    input is 10^4 times the others; per output channel, and in Q8_0's blocks of 32 (the head's two blocks a 64-input
    chunk, scaled lane by lane)."""
    monkeypatch.setattr(matvec, "int8_digits", lambda: True)
    q = quantize_weight(jax.random.normal(jax.random.key(0), shape), contracted, block)
    x = np.array(jax.random.normal(jax.random.key(1), (1, 1, shape[contracted[0]])))
    x[..., 7] = 10 * outlier
    weight = np.asarray(qwix.dequantize(q), np.float64)
    exact = np.einsum(spec, x.astype(np.float64), weight)
    got = np.asarray(jax.jit(lambda x, w: matvec.einsum(spec, x, w))(jnp.asarray(x), q), np.float64)
    error = np.abs(got - exact)
    assert np.all(error <= 2.0 ** -22 * np.abs(x).max() * np.einsum(spec, np.ones_like(x), np.abs(weight))
                  + 2.0 ** -24 * np.abs(exact))
    float32_error = np.abs(np.einsum(spec, x.astype(np.float32), weight.astype(np.float32)) - exact).max()
    assert error.max() <= 8 * float32_error, (error.max(), float32_error)


@pytest.fixture(scope="module")
def smollm2_int8(smollm2_gguf):
    return linnet_jax.load(smollm2_gguf, quantize="int8", progress=False)


@pytest.fixture(scope="module")
def chat_prompt(smollm2):
    return smollm2.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                                 tokenize=True)


def test_smollm2_int8_against_transformers_and_float(smollm2, smollm2_int8, smollm2_reference, chat_prompt):
    """Every product's weights are int8 (a quarter of the float bytes, scales aside); the distance from transformers
    float32 is bounded; greedy decoding agrees with float32's and still answers."""
    weights = flatten_params(smollm2_int8.params)
    products = {name: w for name, w in weights.items() if isinstance(w, qwix.QArray)}
    assert set(products) == {"embed", *(f"layers.{f}" for f in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"))}
    assert all(w.qvalue.dtype == jnp.int8 and w.scale.dtype == jnp.float32 for w in products.values())
    assert repr(smollm2_int8).endswith("weights=int8)")
    ids = np.asarray([chat_prompt])
    diff = float(np.abs(np.asarray(logits(smollm2_int8, ids)) - reference_logits(smollm2_reference, ids)).max())
    record_parity("SmolLM2 int8 (per output channel) vs float32 reference", diff)
    assert diff <= SMOLLM2_INT8_BOUND
    float_ids = generate(smollm2, tokens=[chat_prompt], max_new_tokens=24, return_details=True)[0].tokens
    int8_ids = generate(smollm2_int8, tokens=[chat_prompt], max_new_tokens=24, return_details=True)[0].tokens
    agree = next((i for i, (a, b) in enumerate(zip(float_ids, int8_ids)) if a != b), len(float_ids))
    print(f"SmolLM2 int8: greedy agrees with float32 for {agree} of {len(float_ids)} tokens")
    assert "Paris" in smollm2.tokenizer.decode(int8_ids)


@pytest.mark.parametrize("kind", ["llama_gqa_llama3", "llama_linear_untied", "qwen3_qk_norm"])
def test_tiny_families_int8_equal_transformers_on_the_dequantized_weights(tiny_dir, kind, tmp_path):
    """The int8 forward equals transformers float32 run on the weights it stands for (export.hf writes them
    dequantized): the quantized path computes exactly what its weights say. Its distance from the float model is
    quantization's alone."""
    import transformers

    original, directory = tiny_dir(kind)
    model = linnet_jax.load(directory, quantize="int8", progress=False)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        export.hf(model, tmp_path / "dequantized", progress=False), dtype="float32", attn_implementation="eager")
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (2, 24))
    got = np.asarray(logits(model, ids))
    diff = float(np.abs(got - reference_logits(reference.eval(), ids)).max())
    record_parity(f"tiny {kind} int8 vs transformers on its dequantized weights", diff)
    assert diff <= 1e-4
    quantization = float(np.abs(got - reference_logits(original, ids)).max())
    print(f"tiny {kind}: int8 against the float32 model {quantization:.3e} (logits up to {np.abs(got).max():.2f})")
    assert quantization <= TINY_INT8_BOUND


@pytest.mark.parametrize("dtype", list(TINY_DTYPE_BOUNDS))
@pytest.mark.parametrize("quantize", [None, "int8"])
def test_every_quantize_and_dtype_pair_is_near_the_float32_model(tiny_dir, quantize, dtype):
    """Each `load(..., quantize, dtype)` pair's logits lie within its dtype's rounding (and int8's own error) of the
    float32 model's on the same ids. int8 with float16 gave uniform logits: qwix made every float16 scale under 2^-7
    one, rounding each weight to 0 (`models.params.quantize_weight`)."""
    original, directory = tiny_dir("llama_gqa_llama3")
    model = linnet_jax.load(directory, dtype=dtype, quantize=quantize, progress=False)
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (2, 24))
    diff = float(np.abs(np.asarray(logits(model, ids)) - reference_logits(original, ids)).max())
    record_parity(f"tiny llama_gqa_llama3 quantize={quantize} dtype={dtype} vs float32", diff)
    print(f"quantize={quantize} dtype={dtype}: max |logit diff| {diff:.3e}")
    assert diff <= TINY_DTYPE_BOUNDS[dtype] + (TINY_INT8_BOUND if quantize else 0.0)


def test_the_engine_serves_a_quantized_model_as_generate_does(tiny_dir):
    model = linnet_jax.load(tiny_dir("llama_gqa_llama3")[1], quantize="int8", progress=False)
    prompts = [[5, 9, 2, 7], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [8] * 20]
    expected = generate(model, tokens=prompts, max_new_tokens=12, ignore_eos=True)
    with Engine(model, slots=2, max_len=64) as engine:
        handles = [engine.submit(tokens=p, max_tokens=12, ignore_eos=True) for p in prompts]
        assert [h.result(timeout=300).tokens for h in handles] == expected


def file_blocks(path) -> dict[str, Int8Blocks]:
    """Every Q8_0 tensor of a GGUF file, read from its bytes (transformers names and layout)."""
    _, tensors, _ = open_gguf(path)
    return {name: tensors.q8_0(name) for name in tensors.q8_0_names()}


@pytest.fixture(scope="module")
def smollm2_q8_0(smollm2, tmp_path_factory):
    """SmolLM2 written as a Q8_0 GGUF (llama.cpp's 8-bit type)."""
    return export.gguf(smollm2, tmp_path_factory.mktemp("q8_0") / "smollm2.gguf", dtype="q8_0", progress=False)


def test_q8_0_gguf_loads_as_stored_and_exports_unchanged(smollm2_q8_0, tmp_path):
    """A Q8_0 GGUF loads with quantize="int8" to its own blocks, bit for bit, and export.gguf(dtype="q8_0") writes
    them back unchanged: the same bytes for every tensor, nothing requantized."""
    first = smollm2_q8_0
    model = linnet_jax.load(first, quantize="int8", progress=False)
    stored = file_blocks(first)
    assert len(stored) == 1 + 7 * model.config.num_layers
    ours = {name: value for name, value in params_to_hf(model.params, model.config, block=32).items()
            if isinstance(value, Int8Blocks)}
    assert ours.keys() == stored.keys()
    for name, blocks in stored.items():
        assert np.array_equal(ours[name].values, blocks.values), name
        assert np.array_equal(ours[name].scales, blocks.scales), name
    second = export.gguf(model, tmp_path / "second.gguf", dtype="q8_0", progress=False)
    again = file_blocks(second)
    assert all(np.array_equal(again[name].values, blocks.values) and np.array_equal(again[name].scales, blocks.scales)
               for name, blocks in stored.items())
    floats = linnet_jax.load(first, progress=False)  # without quantize: the same file, dequantized
    ids = np.asarray([[1, 504, 3458, 314, 4403, 282]])
    assert float(np.abs(np.asarray(logits(floats, ids)) - np.asarray(logits(model, ids))).max()) < 1e-3


PEAK_RSS = """
import json, re, sys
import jax
import linnet_jax

def peak():  # this process's peak RSS in bytes (VmHWM: unlike ru_maxrss, not inherited from the parent at exec)
    return int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024

jax.numpy.zeros(1).block_until_ready()
before = peak()
model = linnet_jax.load(sys.argv[1], quantize=sys.argv[2] or None, progress=False)
print(json.dumps({"growth": peak() - before, "float32": model.config.num_params() * 4}))
"""


def test_loading_int8_never_holds_the_float32_model(smollm2_q8_0):
    """Peak RSS while loading the Q8_0 file with quantize="int8" grows by less than the float32 model's size (measured:
    432 MiB, of which ~160 MiB the file's metadata as Python objects and ~140 MiB its mapped pages), and by far less
    than loading it as float32 (796 MiB): nothing ever holds a float copy of the model."""
    runs = {}
    for quantize in ("int8", ""):
        out = subprocess.run([sys.executable, "-c", PEAK_RSS, str(smollm2_q8_0), quantize], capture_output=True,
                             text=True, check=True, timeout=600)
        runs[quantize] = json.loads(out.stdout.strip().splitlines()[-1])
    print({name or "float32": f"{run['growth'] / 2**20:.0f} MiB" for name, run in runs.items()})
    assert runs[""]["growth"] > runs[""]["float32"]  # the measurement sees a float32 load
    assert runs["int8"]["growth"] < min(runs["int8"]["float32"], 0.7 * runs[""]["growth"])


def test_qlora_teaches_an_int8_smollm2_a_fact(smollm2_int8, tmp_path):
    """LoRA over the int8 weights (QLoRA): the loss falls and the tuned model answers with the made-up facts; the base
    stays the very int8 arrays it was (no gradient, no float copy, nothing in the optimizer state but the adapters)."""
    from test_train_run import FACTS, fact_records, write_jsonl

    from linnet_jax import train

    data = write_jsonl(tmp_path / "facts.jsonl", fact_records())
    result = train.finetune(smollm2_int8, data, tmp_path / "run", lora=train.LoraConfig(rank=8, alpha=16), steps=10,
                            batch_size=4, seq_len=64, lr=3e-3, packing=False, progress=False)
    first, last = result.metrics[0]["loss"], result.metrics[-1]["loss"]
    assert last < first / 10, (first, last)
    base, kept = jax.tree.leaves(smollm2_int8.params), jax.tree.leaves(result.state.params)
    assert all(a is b for a, b in zip(base, kept)) and len(base) == len(kept)
    trained = {x.shape for x in jax.tree.leaves(result.state.lora)}
    assert {x.shape for x in jax.tree.leaves(result.state.opt_state) if x.ndim} <= trained
    after = generate(result.model, [q for q, _ in FACTS], max_new_tokens=16)
    print(f"SmolLM2 int8 QLoRA: loss {first:.4f} -> {last:.4f}; after {after}")
    assert sum(answer in reply for (_, answer), reply in zip(FACTS, after)) >= 3, after
    with pytest.raises(ValueError, match="they train only under LoRA adapters"):
        train.finetune(smollm2_int8, data, tmp_path / "full", lora=None, steps=1, progress=False)


def test_finetune_command_refuses_quantize_without_lora(tmp_path, capsys):
    from linnet_jax import cli

    with pytest.raises(SystemExit) as exit_:
        cli.main(["finetune", "--data", str(tmp_path / "none.jsonl"), "--quantize", "int8", "--lora-rank", "0",
                  str(tmp_path / "out")])
    assert exit_.value.code == 2 and "--quantize int8 trains LoRA adapters" in capsys.readouterr().err


SHARDED = """
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import json, sys
import numpy as np, qwix
import linnet_jax
from linnet_jax import sharding
from linnet_jax.models.params import flatten_params

rows = [[5, 9, 2, 7], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]]
one = linnet_jax.load(sys.argv[1], quantize="int8", progress=False)
expected, reference = linnet_jax.generate(one, tokens=rows, max_new_tokens=8, ignore_eos=True), linnet_jax.logits(one, rows[1])
placed = {"load fsdp=2 x tp=4": linnet_jax.load(sys.argv[1], quantize="int8", progress=False,
                                                mesh=sharding.mesh(fsdp=2, tensor=4)),
          "shard dp=2 x tp=4": linnet_jax.shard(one, sharding.mesh(data=2, tensor=4))}
out = {}
for name, model in placed.items():
    weights = [w for w in flatten_params(model.params).values() if isinstance(w, qwix.QArray)]
    out[name] = {"equal": linnet_jax.generate(model, tokens=rows, max_new_tokens=8, ignore_eos=True) == expected,
                 "diff": float(np.abs(sharding.host(linnet_jax.logits(model, rows[1])) - np.asarray(reference)).max()),
                 "split": sum(w.qvalue.addressable_shards[0].data.nbytes < w.qvalue.nbytes for w in weights),
                 "quantized": len(weights)}
print(json.dumps(out))
"""


def test_a_quantized_model_runs_sharded_as_on_one_device(shardable_dir):
    """On 8 fake devices, loaded onto a mesh or re-placed (`shard`): the int8 values split as the float weights
    would, greedy ids and logits equal one device's."""
    done = subprocess.run([sys.executable, "-c", SHARDED, str(shardable_dir)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    for name, case in json.loads(done.stdout.strip().splitlines()[-1]).items():
        assert case["equal"] and case["diff"] < 1e-4, (name, case)
        assert case["quantized"] == 9 and case["split"] >= 8, (name, case)  # 7 projections, embedding, head


def test_lowered_for_accelerators_reads_the_int8_weights(tiny_dir):
    """Every program lowered for CUDA and TPU takes the int8 values as arguments and no CPU kernel: the scaling
    happens in the program (XLA fuses it into the products there); the train step is QLoRA's."""
    model = linnet_jax.load(tiny_dir("llama_gqa_llama3")[1], progress=False).quantized()
    for platform in ("cuda", "tpu"):
        programs = linnet_jax.lowered(model, platform, max_len=64)
        assert "train_step" in programs and "decode" in programs
        for name, text in programs.items():
            if name in ("choose_first", "free", "scrub_pages", "put_lora"):  # no weights
                continue
            signature = text[text.index("func.func public @main("):text.index("->", text.index("@main("))]
            assert "xi8>" in signature and "linnet_" not in text, (platform, name)


def test_bad_quantize_values_and_saving_a_quantized_model_are_refused(tiny_dir, tmp_path):
    directory = tiny_dir("llama_gqa_llama3")[1]
    with pytest.raises(ValueError, match=r"quantize must be None or one of \('int8',\), got 'int4'"):
        linnet_jax.load(directory, quantize="int4", progress=False)
    model = linnet_jax.load(directory, quantize="int8", progress=False)
    with pytest.raises(ValueError, match="save keeps float weights; this model's are int8"):
        linnet_jax.save(model, tmp_path / "saved")
    assert not (tmp_path / "saved").exists()
    from linnet_jax import train

    with pytest.raises(ValueError, match=r"quantize must be None or one of \('int8',\), got 'nf4'"):
        train.finetune(dataclasses.replace(model, tokenizer=object()), tmp_path / "none.jsonl", tmp_path / "out",
                       quantize="nf4", progress=False)
