"""linnet_jax.gguf: write/read round trips on tiny random models, the real SmolLM2 file against
transformers' GGUF loader, llama.cpp's K-quants against gguf.quants, and the error messages."""

import gguf
import llama_cpp
import numpy as np
import pytest
from conftest import record_parity

import linnet_jax
from linnet_jax.gguf import read_gguf, write_gguf
from linnet_jax.models import params_to_hf

TENSOR_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"]


def tiny_model(arch: str, seed: int = 0, *, hidden: int = 64, heads: int = 4, kv_heads: int = 2, inter: int = 96,
               vocab: int = 128, layers: int = 2) -> tuple[dict, dict[str, np.ndarray]]:
    """A random transformers-named state dict and config: llama (untied head), qwen2 (q/k/v biases, tied),
    qwen3 (q/k norms, head_dim 32 != hidden/heads). Every value is standard normal."""
    rng = np.random.default_rng(seed)
    head_dim = 32 if arch == "qwen3" else hidden // heads
    config = {
        "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                           "qwen3": "Qwen3ForCausalLM"}[arch]],
        "model_type": arch, "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": inter,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-6, "rope_theta": 500000.0, "max_position_embeddings": 256,
        "tie_word_embeddings": arch != "llama", "bos_token_id": 1, "eos_token_id": 2,
    }
    if arch == "qwen3":
        config["head_dim"] = head_dim
    if arch == "llama":
        config["rope_scaling"] = {"rope_type": "linear", "factor": 4.0}

    def w(*shape):
        return rng.standard_normal(shape, dtype=np.float32)

    state = {"model.embed_tokens.weight": w(vocab, hidden), "model.norm.weight": w(hidden)}
    if arch == "llama":
        state["lm_head.weight"] = w(vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        state |= {
            p + "input_layernorm.weight": w(hidden), p + "post_attention_layernorm.weight": w(hidden),
            p + "self_attn.q_proj.weight": w(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": w(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": w(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": w(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": w(inter, hidden), p + "mlp.up_proj.weight": w(inter, hidden),
            p + "mlp.down_proj.weight": w(hidden, inter),
        }
        if arch == "qwen2":
            state |= {p + "self_attn.q_proj.bias": w(heads * head_dim),
                      p + "self_attn.k_proj.bias": w(kv_heads * head_dim),
                      p + "self_attn.v_proj.bias": w(kv_heads * head_dim)}
        if arch == "qwen3":
            state |= {p + "self_attn.q_norm.weight": w(head_dim), p + "self_attn.k_norm.weight": w(head_dim)}
    return config, state


def interleaved(n_heads: int, head_dim: int) -> list[int]:
    """The transformers row stored at each GGUF row of a llama q/k projection: llama.cpp interleaves each
    head's half-split rows (r0..r7, i0..i7) as r0 i0 r1 i1 .."""
    return [h * head_dim + half * head_dim // 2 + pair
            for h in range(n_heads) for pair in range(head_dim // 2) for half in (0, 1)]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("tensor_type", TENSOR_TYPES)
def test_round_trip(tmp_path, arch, tensor_type):
    config, state = tiny_model(arch)
    path = write_gguf(tmp_path / "m.gguf", config, state, tensor_type=tensor_type, progress=False)
    config2, state2, metadata = read_gguf(path, progress=False)

    for key, value in config.items():
        assert config2[key] == pytest.approx(value), key
    assert metadata["general.architecture"] == arch
    assert config2.get("attention_bias", arch == "qwen2") == (arch == "qwen2")
    expected_names = set(state) - ({"lm_head.weight"} if config["tie_word_embeddings"] else set())
    assert set(state2) == expected_names
    qtype = gguf.GGMLQuantizationType[tensor_type]
    for name in expected_names:
        w = state[name]
        expected = w if w.ndim == 1 else gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype)
        assert state2[name].dtype == np.float32 and state2[name].shape == w.shape, name
        np.testing.assert_array_equal(state2[name], expected, err_msg=name)
    if tensor_type == "F32":  # bit-identical
        for name in expected_names:
            assert state2[name].tobytes() == state[name].tobytes(), name


def test_llama_qk_rows_are_interleaved_in_the_file(tmp_path):
    """HF half-split rows (r0..r7, i0..i7 per head) are stored interleaved (r0 i0 r1 i1 ..) as llama.cpp expects."""
    config, state = tiny_model("llama")
    heads, kv_heads, head_dim = 4, 2, 16
    q = np.repeat(np.arange(heads * head_dim, dtype=np.float32)[:, None], 64, axis=1)  # row j holds j
    k = np.repeat(np.arange(kv_heads * head_dim, dtype=np.float32)[:, None], 64, axis=1)
    state["model.layers.0.self_attn.q_proj.weight"], state["model.layers.0.self_attn.k_proj.weight"] = q, k
    path = write_gguf(tmp_path / "m.gguf", config, state, progress=False)

    stored = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(path).tensors}
    assert stored["blk.0.attn_q.weight"][:, 0].tolist() == interleaved(heads, head_dim)
    assert stored["blk.0.attn_k.weight"][:, 0].tolist() == interleaved(kv_heads, head_dim)
    np.testing.assert_array_equal(stored["blk.0.attn_v.weight"], state["model.layers.0.self_attn.v_proj.weight"])
    _, state2, _ = read_gguf(path, progress=False)
    np.testing.assert_array_equal(state2["model.layers.0.self_attn.q_proj.weight"], q)
    np.testing.assert_array_equal(state2["model.layers.0.self_attn.k_proj.weight"], k)


def test_smollm2_config_and_shapes(smollm2_contents):
    config, state, metadata = smollm2_contents
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]) == (30, 576, 1536)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]) == (9, 3, 49152)
    assert config["tie_word_embeddings"] is True and "lm_head.weight" not in state
    assert config["rope_theta"] == 100000.0 and config["rms_norm_eps"] == 1e-5
    assert config["max_position_embeddings"] == 8192 and "rope_scaling" not in config
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert len(state) == 2 + 30 * 9
    assert state["model.embed_tokens.weight"].shape == (49152, 576)
    assert state["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert state["model.layers.29.self_attn.k_proj.weight"].shape == (192, 576)
    assert state["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)
    assert all(w.dtype == np.float32 for w in state.values())
    assert metadata["tokenizer.ggml.model"] == "gpt2" and len(metadata["tokenizer.ggml.tokens"]) == 49152
    assert metadata["general.architecture"] == "llama" and isinstance(metadata["tokenizer.chat_template"], str)


def test_smollm2_weights_match_transformers(smollm2_contents, smollm2_reference):
    """transformers' GGUF loader is the reference; equal q/k prove the un-permutation."""
    reference = smollm2_reference.state_dict()
    _, state, _ = smollm2_contents
    for name in ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.17.self_attn.q_proj.weight", "model.layers.0.self_attn.v_proj.weight",
                 "model.layers.0.mlp.down_proj.weight", "model.layers.0.input_layernorm.weight",
                 "model.embed_tokens.weight", "model.norm.weight"]:
        np.testing.assert_allclose(state[name], reference[name].numpy(), rtol=0, atol=1e-6, err_msg=name)


# ---- llama.cpp's K-quants ----

# target quant type -> the llama.cpp file type that makes it (its "_S" mixes keep the most tensors at the target).
K_QUANTS = {"Q4_K": "Q4_K_S", "Q5_K": "Q5_K_S", "Q6_K": "Q6_K"}
# Measured on K_QUANT_SIZES, 32 random tokens (float32 logits of std 1.0, largest 4.9). Relative RMS error of
# the dequantized matrices against the float32 ones (the same for every matrix of a type): Q4_K 0.072, Q5_K
# 0.036, Q6_K 0.018 (Q4_K_S keeps attn_v as Q5_K, both mixes keep output as Q6_K). Largest |logit - logit of
# the float32 GGUF|: Q4_K_S 1.43, Q5_K_S 0.91, Q6_K 0.45 (RMS 0.28, 0.16, 0.087): this random net amplifies
# weight error about 4x, as much as Gaussian noise of the same relative RMS does (1.49, 0.76, 0.35). Bounds
# about 1.4x the weight errors (they barely vary with the seed) and 2x the logit differences.
K_QUANT_WEIGHT_BOUNDS = {"Q4_K": 0.1, "Q5_K": 0.05, "Q6_K": 0.025}
K_QUANT_LOGIT_BOUNDS = {"Q4_K": 3.0, "Q5_K": 2.0, "Q6_K": 1.0}
# K-quants take rows in blocks of 256 values (QK_K): every row length here is a multiple of it.
K_QUANT_SIZES = dict(hidden=256, heads=4, kv_heads=2, inter=512, vocab=1024, layers=2)
# GGUF name (layer index as N) -> transformers name, written out here apart from linnet_jax.gguf's table.
LLAMA_GGUF_NAMES = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
    "blk.N.attn_norm": "model.layers.N.input_layernorm", "blk.N.ffn_norm": "model.layers.N.post_attention_layernorm",
    "blk.N.attn_q": "model.layers.N.self_attn.q_proj", "blk.N.attn_k": "model.layers.N.self_attn.k_proj",
    "blk.N.attn_v": "model.layers.N.self_attn.v_proj", "blk.N.attn_output": "model.layers.N.self_attn.o_proj",
    "blk.N.ffn_gate": "model.layers.N.mlp.gate_proj", "blk.N.ffn_up": "model.layers.N.mlp.up_proj",
    "blk.N.ffn_down": "model.layers.N.mlp.down_proj",
}


@pytest.fixture(scope="module")
def k_quant_source(tmp_path_factory):
    """A random llama (GQA, untied head, linear rope scaling) as a float32 GGUF: (path, state, ids, logits)."""
    config, state = tiny_model("llama", **K_QUANT_SIZES)
    # weights of std 1/sqrt(fan in) and norms around 1, so that activations and logits stay of order 1
    state = {name: w / np.sqrt(w.shape[1]) if w.ndim == 2 else 1 + 0.2 * w for name, w in state.items()}
    path = write_gguf(tmp_path_factory.mktemp("k_quants") / "f32.gguf", config, state, progress=False)
    ids = np.random.default_rng(1).integers(0, config["vocab_size"], 32)
    return path, state, ids, np.asarray(linnet_jax.logits(linnet_jax.load(path, progress=False), ids))


def llama_cpp_quantize(source, target, file_type: str):
    """`source` quantized by llama.cpp's own quantizer to `file_type` (a LLAMA_FTYPE_MOSTLY_* suffix)."""
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{file_type}"), 1
    assert llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), params) == 0
    return target


def reference_llama_state(path, heads: int, kv_heads: int) -> dict[str, np.ndarray]:
    """Every tensor of a llama GGUF dequantized by gguf.quants, in transformers' names, shapes and q/k row order."""
    state = {}
    for tensor in gguf.GGUFReader(path).tensors:
        base, _, kind = tensor.name.rpartition(".")
        parts = base.split(".")  # ["token_embd"] or ["blk", layer, "attn_q"]
        name = LLAMA_GGUF_NAMES[base] if len(parts) == 1 else \
            LLAMA_GGUF_NAMES[f"blk.N.{parts[2]}"].replace(".N.", f".{parts[1]}.")
        name += "." + kind
        w = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape([int(d) for d in reversed(tensor.shape)])
        n = heads if name.endswith("q_proj.weight") else kv_heads if name.endswith("k_proj.weight") else None
        if n is not None:  # GGUF row j holds transformers row interleaved(..)[j]
            unpermuted = np.empty_like(w)
            unpermuted[interleaved(n, w.shape[0] // n)] = w
            w = unpermuted
        state[name] = w
    return state


@pytest.mark.parametrize("qtype", list(K_QUANTS))
def test_llama_cpp_k_quants_load_as_gguf_dequantizes_them(k_quant_source, tmp_path, qtype):
    """A float32 GGUF quantized by llama.cpp to Q4_K / Q5_K / Q6_K: linnet_jax.load's weights equal gguf.quants'
    dequantization of the file exactly (both are float32 products of the same block scales, computed the same
    way), and its logits stay within a measured bound of the float32 model's."""
    source, state, ids, f32_logits = k_quant_source
    path = llama_cpp_quantize(source, tmp_path / f"{K_QUANTS[qtype]}.gguf", K_QUANTS[qtype])

    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    matrix_types = [types[name] for name in types if not name.endswith("norm.weight")]
    counts = {name: matrix_types.count(name) for name in sorted(set(matrix_types))}
    print(f"{K_QUANTS[qtype]}: matrices {counts}")
    assert set(matrix_types) <= {"Q4_K", "Q5_K", "Q6_K"}, counts
    assert counts.get(qtype, 0) >= len(matrix_types) - 3, counts  # at most attn_v x2 and output differ

    reference = reference_llama_state(path, K_QUANT_SIZES["heads"], K_QUANT_SIZES["kv_heads"])
    assert set(reference) == set(state)
    for name, w in reference.items():  # the quantization really happened, and is as lossy as expected
        relative = np.sqrt(np.mean((w - state[name]) ** 2) / np.mean(state[name] ** 2))
        assert (relative == 0) == (w.ndim == 1) and relative < K_QUANT_WEIGHT_BOUNDS[qtype], (name, relative)

    model = linnet_jax.load(path, progress=False)
    assert model.config.dtype == "float32"
    loaded = params_to_hf(model.params, model.config)
    assert set(loaded) == set(reference)
    for name, w in reference.items():
        np.testing.assert_array_equal(loaded[name], w, err_msg=name)

    diff = float(np.abs(np.asarray(linnet_jax.logits(model, ids)) - f32_logits).max())
    record_parity(f"llama.cpp {K_QUANTS[qtype]} of a tiny llama loaded by linnet_jax (vs its f32 GGUF)", diff)
    assert diff <= K_QUANT_LOGIT_BOUNDS[qtype]


# ---- errors ----

def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="GGUF file not found: .*nope.gguf"):
        read_gguf(tmp_path / "nope.gguf")


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(ValueError, match="model.safetensors is not a GGUF file"):
        read_gguf(path)


@pytest.mark.parametrize("keep", [2, 40, 0.5, -1])
def test_truncated_file(tmp_path, keep):
    config, state = tiny_model("llama")
    data = write_gguf(tmp_path / "m.gguf", config, state, progress=False).read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep) if isinstance(keep, float) else keep])
    with pytest.raises(ValueError, match=r"cut\.gguf is not a readable GGUF file: it is truncated"):
        read_gguf(cut)


def _write_raw(path, arch="llama", skip=(), tensors=None):
    """A GGUF made with gguf.GGUFWriter directly: llama-style metadata (less `skip`) and `tensors`."""
    writer = gguf.GGUFWriter(path, arch)
    keys = {"context_length": 64, "embedding_length": 32, "block_count": 1, "feed_forward_length": 64,
            "attention.head_count": 2, "attention.layer_norm_rms_epsilon": 1e-5}
    for key, value in keys.items():
        if key not in skip:
            (writer.add_float32 if isinstance(value, float) else writer.add_uint32)(f"{arch}.{key}", value)
    for name, (data, raw_dtype) in (tensors or {"token_embd.weight": (np.zeros((8, 32), np.float32), None)}).items():
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unsupported_quant_type(tmp_path):
    iq4_nl = np.zeros((8, 32 // 32 * 18), np.uint8)  # one IQ4_NL block (32 values, 18 bytes) per row
    path = _write_raw(tmp_path / "m.gguf", tensors={"token_embd.weight": (iq4_nl, gguf.GGMLQuantizationType.IQ4_NL)})
    with pytest.raises(ValueError, match=r"m\.gguf: tensor 'token_embd\.weight' has quant type IQ4_NL.*"
                                         r"supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, .*Q6_K"):
        read_gguf(path)


def test_unknown_architecture(tmp_path):
    path = _write_raw(tmp_path / "m.gguf", arch="gpt2")
    with pytest.raises(ValueError,
                       match=r"m\.gguf: architecture 'gpt2' is not supported; supported: llama, qwen2, qwen3"):
        read_gguf(path)


def test_missing_metadata_key(tmp_path):
    path = _write_raw(tmp_path / "m.gguf", skip=("block_count",))
    with pytest.raises(ValueError, match=r"m\.gguf: required GGUF metadata key 'llama\.block_count' is missing"):
        read_gguf(path)


def test_write_errors(tmp_path):
    config, state = tiny_model("llama")
    with pytest.raises(ValueError, match="tensor_type 'Q5_K' is not supported; supported: F32, F16, BF16, Q8_0"):
        write_gguf(tmp_path / "m.gguf", config, state, tensor_type="Q5_K")
    with pytest.raises(ValueError, match="architecture 'gemma' cannot be written to GGUF; supported: llama, qwen2"):
        write_gguf(tmp_path / "m.gguf", {**config, "model_type": "gemma"}, state)
    with pytest.raises(ValueError, match="hf_config is missing required key 'num_hidden_layers'"):
        write_gguf(tmp_path / "m.gguf", {k: v for k, v in config.items() if k != "num_hidden_layers"}, state)
    with pytest.raises(ValueError, match="tensor 'model.layers.0.mlp.experts.weight' has no GGUF equivalent"):
        write_gguf(tmp_path / "m.gguf", config, {**state, "model.layers.0.mlp.experts.weight": np.zeros((2, 2))},
                   progress=False)
    with pytest.raises(ValueError, match="rope scaling 'llama3' cannot be written to GGUF"):
        write_gguf(tmp_path / "m.gguf", {**config, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, state)
