"""Exports verified by loading them back: export.hf into transformers, export.gguf into linnet_jax and
transformers' GGUF loader, linnet_jax.save (Orbax) into linnet_jax.load; each reports its distance."""

import dataclasses
import json

import jax
import llama_cpp
import numpy as np
import pytest
import torch
import transformers
from conftest import record_parity, reference_logits
from safetensors import safe_open
from safetensors.numpy import load_file

import linnet_jax
from linnet_jax import export
from linnet_jax.files import generation_config

MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Name three rivers in Europe and say which one is the longest."}]
TEXTS = ["Hello world!", "  two spaces, a tab\tand\nnewlines\n\n", "Ünïcödé: naïve café, 東京, emoji 🙂",
         "digits 1234567 and <|im_start|>user special tokens<|im_end|>"]
# Largest |logit - logit of the float32 model| of SmolLM2 reloaded from its own GGUF export, measured on
# MESSAGES (30 tokens, logits up to about 30): f16 3.1e-2, bf16 2.1e-1, q8_0 1.09 (SmolLM2's weights come
# from Q4_1, whose levels q8_0's symmetric 8-bit grid rounds with about 4x bf16's relative error); bounds about
# twice that.
GGUF_BOUNDS = {"f32": 0.0, "f16": 0.06, "bf16": 0.4, "q8_0": 2.0}
# llama.cpp (float32 KV cache) against the float32 model at the last position of MESSAGES, measured:
# f32 4.1e-5; f16 4.4e-2 (it also rounds activations to f16 in f16 products).
LLAMA_CPP_BOUNDS = {"f32": 1e-4, "f16": 0.1}


def tiny_model(tiny_dir, name: str):
    return linnet_jax.load(tiny_dir(name)[1], progress=False)


def max_diff(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max())


def leaves_identical(a, b) -> bool:
    """Same tree, and every leaf the same dtype, shape and bytes."""
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        x.dtype == y.dtype and x.shape == y.shape and np.asarray(x).tobytes() == np.asarray(y).tobytes()
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.fixture(scope="module")
def chat_ids(smollm2):
    return smollm2.tokenizer.apply_chat_template(MESSAGES, tokenize=True)


@pytest.fixture(scope="module")
def smollm2_logits(smollm2, chat_ids):
    return np.asarray(linnet_jax.logits(smollm2, chat_ids))


@pytest.fixture(scope="module")
def smollm2_hf(smollm2, tmp_path_factory):
    return export.hf(smollm2, tmp_path_factory.mktemp("smollm2_hf"), progress=False)


@pytest.fixture(scope="module")
def smollm2_gguf_export(smollm2, tmp_path_factory):
    """dtype -> SmolLM2 exported as GGUF in it (written once per dtype)."""
    directory, written = tmp_path_factory.mktemp("smollm2_gguf"), {}

    def get(dtype: str):
        if dtype not in written:
            written[dtype] = export.gguf(smollm2, directory / f"smollm2-{dtype}.gguf", dtype=dtype, progress=False)
        return written[dtype]

    return get


# ---- Hugging Face ----

def test_hf_smollm2_logits_in_transformers(smollm2_hf, chat_ids, smollm2_logits):
    files = sorted(p.name for p in smollm2_hf.iterdir())
    assert files == ["chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
                     "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    with safe_open(smollm2_hf / "model.safetensors", framework="np") as f:
        assert f.metadata() == {"format": "pt"} and "lm_head.weight" not in f.keys()  # tied stays tied
    config = json.loads((smollm2_hf / "config.json").read_text())
    assert config["rope_theta"] == 100000.0 and config["rope_parameters"]["rope_theta"] == 100000.0
    assert config["torch_dtype"] == config["dtype"] == "float32" and "rope_scaling" in config
    reference = transformers.AutoModelForCausalLM.from_pretrained(smollm2_hf, attn_implementation="eager").eval()
    assert reference.dtype == torch.float32 and reference.config.tie_word_embeddings
    diff = max_diff(reference_logits(reference, [chat_ids]), smollm2_logits)
    record_parity("export.hf SmolLM2 loaded by transformers", diff)
    assert diff < 1e-4


def test_hf_smollm2_tokenizer_in_transformers(smollm2, smollm2_hf, smollm2_reference_tokenizer):
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_hf)
    for text in TEXTS:
        assert tokenizer.encode(text) == smollm2.tokenizer.encode(text) == smollm2_reference_tokenizer.encode(text)
    rendered = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert rendered == smollm2.tokenizer.apply_chat_template(MESSAGES)
    assert rendered == smollm2_reference_tokenizer.apply_chat_template(MESSAGES, tokenize=False,
                                                                       add_generation_prompt=True)
    assert json.loads((smollm2_hf / "tokenizer_config.json").read_text())["chat_template"] == \
        (smollm2_hf / "chat_template.jinja").read_text() == smollm2.tokenizer.chat_template
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.bos_token == "<|im_start|>"


def test_hf_generation_config(smollm2, smollm2_hf, tiny_dir):
    written = json.loads((smollm2_hf / "generation_config.json").read_text())
    assert written == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    assert transformers.GenerationConfig.from_pretrained(smollm2_hf).eos_token_id == 2
    # every eos id of the config, then the tokenizer's, once each; bos and pad from the tokenizer when the
    # config has none
    config = dataclasses.replace(tiny_model(tiny_dir, "qwen2_bias_tied").config, eos_token_ids=(5, 2),
                                 bos_token_id=None, pad_token_id=None)
    assert generation_config(config, smollm2.tokenizer) == {"bos_token_id": 1, "eos_token_id": [5, 2],
                                                            "pad_token_id": 2}
    assert generation_config(config, None) == {"eos_token_id": [5, 2]}


def test_hf_qwen2_bias_logits_in_transformers(tiny_dir, tmp_path):
    model = tiny_model(tiny_dir, "qwen2_bias_tied")
    out = export.hf(model, tmp_path / "out", progress=False)
    reference = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert type(reference).__name__ == "Qwen2ForCausalLM"
    assert reference.model.layers[0].self_attn.q_proj.bias is not None
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (2, 40))
    diff = max_diff(reference_logits(reference, ids), linnet_jax.logits(model, ids))
    record_parity("export.hf tiny qwen2_bias_tied loaded by transformers", diff)
    assert diff < 1e-4


@pytest.mark.parametrize("name", ["qwen2_bias_tied", "llama_linear_untied"])
def test_hf_round_trip_is_bit_identical(tiny_dir, tmp_path, name):
    """HF → linnet_jax → HF: the same tensors, bit for bit, under the same names."""
    _, directory = tiny_dir(name)
    out = export.hf(linnet_jax.load(directory, progress=False), tmp_path / "out", progress=False)
    original, exported = load_file(directory / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(original) == sorted(exported)
    assert ("lm_head.weight" in exported) == (name == "llama_linear_untied")
    for tensor_name, tensor in original.items():
        assert tensor.dtype == exported[tensor_name].dtype == np.float32, tensor_name
        assert tensor.tobytes() == exported[tensor_name].tobytes(), tensor_name


def test_hf_sharded_export_loads_in_transformers(tiny_dir, tmp_path):
    model = tiny_model(tiny_dir, "llama_linear_untied")
    out = export.hf(model, tmp_path / "out", max_shard_size="100KB", progress=False)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and not (out / "model.safetensors").exists()
    assert shards == sorted(p.name for p in out.glob("model-*-of-*.safetensors"))
    sizes = {shard: sum(t.nbytes for t in load_file(out / shard).values()) for shard in shards}
    assert index["metadata"]["total_size"] == sum(sizes.values()) == 4 * model.config.num_params()
    assert all(size <= 100_000 for size in sizes.values())
    reference = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    ids = np.arange(48)[None] % model.config.vocab_size
    diff = max_diff(reference_logits(reference, ids), linnet_jax.logits(model, ids))
    record_parity("export.hf tiny llama_linear_untied, sharded, loaded by transformers", diff)
    assert diff < 1e-4
    assert leaves_identical(linnet_jax.load(out, progress=False).params, model.params)


def test_hf_dtype_conversion(tiny_dir, tmp_path):
    model = tiny_model(tiny_dir, "llama_linear_untied")
    out = export.hf(model, tmp_path / "out", dtype="bfloat16", progress=False)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    reference = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert reference.dtype == torch.bfloat16
    reloaded = linnet_jax.load(out, progress=False)
    assert reloaded.config.dtype == "bfloat16"
    assert leaves_identical(reloaded.params, jax.tree.map(lambda x: x.astype("bfloat16"), model.params))


def test_hf_refuses_to_overwrite_unless_asked(tiny_dir, tmp_path):
    model = tiny_model(tiny_dir, "qwen2_bias_tied")
    out = export.hf(model, tmp_path / "out", max_shard_size="100KB", progress=False)
    with pytest.raises(FileExistsError, match=f"{out} already exists and is not empty; pass overwrite=True"):
        export.hf(model, out, progress=False)
    export.hf(model, out, overwrite=True, progress=False)  # one file now: the old shards and index are gone
    assert sorted(p.name for p in out.glob("model*")) == ["model.safetensors"]
    assert leaves_identical(linnet_jax.load(out, progress=False).params, model.params)


@pytest.mark.parametrize("call, error, message", [
    (lambda m, p: export.hf(m, p, dtype="float64"), ValueError, "dtype 'float64' is not supported"),
    (lambda m, p: export.hf(m, p, max_shard_size="5 parsecs"), ValueError, "max_shard_size '5 parsecs' is not a size"),
    (lambda m, p: export.hf(m, p, max_shard_size=0), ValueError, "max_shard_size 0 is not a size"),
    (lambda m, p: export.gguf(m, p / "m.gguf", dtype="q4_k"), ValueError, "dtype 'q4_k' is not supported for GGUF"),
    (lambda m, p: export.gguf(m, p, dtype="f32"), IsADirectoryError, "is a directory; this export writes one file"),
])
def test_bad_arguments_are_named(tiny_dir, tmp_path, call, error, message):
    with pytest.raises(error, match=message):
        call(tiny_model(tiny_dir, "qwen2_bias_tied"), tmp_path)


# ---- GGUF ----

@pytest.mark.parametrize("dtype", list(GGUF_BOUNDS))
def test_gguf_reloads_in_linnet_jax(smollm2, smollm2_gguf_export, chat_ids, smollm2_logits, dtype):
    path = smollm2_gguf_export(dtype)
    reloaded = linnet_jax.load(path, progress=False)
    assert reloaded.config == smollm2.config
    assert reloaded.tokenizer.apply_chat_template(MESSAGES, tokenize=True) == chat_ids
    diff = max_diff(linnet_jax.logits(reloaded, chat_ids), smollm2_logits)
    record_parity(f"export.gguf SmolLM2 {dtype} reloaded by linnet_jax (vs float32 SmolLM2)", diff)
    assert diff <= GGUF_BOUNDS[dtype]
    with pytest.raises(FileExistsError, match=f"{path} already exists"):
        export.gguf(smollm2, path, dtype=dtype)


def test_gguf_f32_in_transformers(smollm2, smollm2_gguf_export, chat_ids, smollm2_logits):
    path = smollm2_gguf_export("f32")
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager").eval()
    diff = max_diff(reference_logits(reference, [chat_ids]), smollm2_logits)
    record_parity("export.gguf SmolLM2 f32 loaded by transformers' GGUF loader", diff)
    assert diff < 1e-4
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in TEXTS:
        assert tokenizer.encode(text) == smollm2.tokenizer.encode(text), text
    assert tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                         return_dict=False) == chat_ids


def test_gguf_of_a_tiny_qwen2_and_an_untied_llama(tiny_dir, tmp_path):
    """Models with no tokenizer, q/k/v biases, an untied head and linear rope scaling: f32 reloads exactly."""
    for name in ("qwen2_bias_tied", "llama_linear_untied"):
        model = tiny_model(tiny_dir, name)
        reloaded = linnet_jax.load(export.gguf(model, tmp_path / f"{name}.gguf", dtype="f32", progress=False),
                                   progress=False)
        assert reloaded.tokenizer is None and reloaded.config == model.config
        assert leaves_identical(reloaded.params, model.params)


# ---- Orbax ----

def test_orbax_round_trip(smollm2, tmp_path):
    directory = linnet_jax.save(smollm2, tmp_path / "ckpt")
    marker = json.loads((directory / "linnet_jax.json").read_text())
    assert (marker["format"], marker["version"]) == ("linnet_jax.orbax", 2) and len(marker["params"]) == 11
    restored = linnet_jax.load(directory)
    assert restored.config == smollm2.config
    assert leaves_identical(restored.params, smollm2.params)
    # placed as load() places any checkpoint's params, so both models share their compiled programs
    assert not any(leaf.committed for leaf in jax.tree.leaves(restored.params))
    for text in TEXTS:
        assert restored.tokenizer.encode(text) == smollm2.tokenizer.encode(text)
    assert restored.tokenizer.eos_token_ids == smollm2.tokenizer.eos_token_ids
    assert linnet_jax.generate(restored, MESSAGES, max_new_tokens=12) == \
        linnet_jax.generate(smollm2, MESSAGES, max_new_tokens=12)
    with pytest.raises(FileExistsError, match=f"{directory} already exists"):
        linnet_jax.save(smollm2, directory)


def test_orbax_tiny_overwrite_and_dtype(smollm2, tiny_dir, tmp_path):
    model = tiny_model(tiny_dir, "llama_linear_untied")
    directory = tmp_path / "ckpt"
    smollm2.tokenizer.save(directory)  # an earlier export's tokenizer must not outlive the overwrite
    linnet_jax.save(model, directory, overwrite=True)
    restored = linnet_jax.load(directory, dtype="bfloat16")
    assert restored.tokenizer is None and restored.config == dataclasses.replace(model.config, dtype="bfloat16")
    assert leaves_identical(restored.params, jax.tree.map(lambda x: x.astype("bfloat16"), model.params))
    (directory / "linnet_jax.json").write_text('{"format": "linnet_jax.orbax", "version": 99}')
    with pytest.raises(ValueError, match="linnet_jax.json: expected format 'linnet_jax.orbax' version 2"):
        linnet_jax.load(directory)


# ---- llama.cpp ----

def llama_cpp_last_logits(path, prompt: list[int]) -> np.ndarray:
    """llama.cpp's logits at the prompt's last position, with a float32 KV cache (its default is f16)."""
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, logits_all=False, verbose=False,
                          type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
    llm.eval(prompt)
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits(llm.ctx), shape=(llm.n_vocab(),)).copy()


def llama_cpp_greedy(path, prompt: list[int], steps: int) -> list[int]:
    """llama.cpp's first `steps` greedy ids after `prompt`, with its default settings (eos ignored)."""
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, logits_all=False, verbose=False)
    return [token for token, _ in zip(llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0), range(steps))]


def test_llama_cpp_runs_the_gguf_export(smollm2, smollm2_gguf_export, chat_ids, smollm2_logits):
    """llama.cpp's greedy ids equal linnet_jax's on the f32 export up to the first near-tie (top-2 logit gap
    under 1e-3 on our greedy path), and for the first 16 steps on the f16 export; its tokenizer agrees."""
    steps = 32
    ours = linnet_jax.generate(smollm2, tokens=[chat_ids], max_new_tokens=steps, ignore_eos=True)[0]
    path_logits = np.asarray(linnet_jax.logits(smollm2, chat_ids + ours[:-1]))[0, len(chat_ids) - 1:]
    top2 = np.sort(path_logits, axis=-1)[:, -2:]
    gaps = top2[:, 1] - top2[:, 0]
    untied = next((i for i, gap in enumerate(gaps) if gap < 1e-3), steps)
    for dtype, compared in (("f32", untied), ("f16", 16)):
        theirs = llama_cpp_greedy(smollm2_gguf_export(dtype), chat_ids, steps)
        diff = max_diff(llama_cpp_last_logits(smollm2_gguf_export(dtype), chat_ids), smollm2_logits[0, -1])
        record_parity(f"export.gguf SmolLM2 {dtype} run by llama.cpp, f32 KV cache (last prompt position)", diff)
        print(f"llama.cpp {dtype}: {sum(a == b for a, b in zip(theirs, ours))}/{steps} greedy ids equal, "
              f"first near-tie at step {untied}, |logit diff| {diff:.2e}")
        assert theirs[:compared] == ours[:compared], dtype
        assert diff < LLAMA_CPP_BOUNDS[dtype]
    assert untied >= 16
    llm = llama_cpp.Llama(model_path=str(smollm2_gguf_export("f32")), n_ctx=512, verbose=False, vocab_only=True)
    for text in TEXTS:
        assert llm.tokenize(text.encode(), add_bos=False, special=True) == smollm2.tokenizer.encode(text), text
    assert llm.metadata["tokenizer.chat_template"] == smollm2.tokenizer.chat_template
