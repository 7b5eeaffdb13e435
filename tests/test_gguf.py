"""linnet_jax.gguf: write/read round trips on tiny random models, the real SmolLM2 file against
transformers' GGUF loader, and the error messages."""

import gguf
import numpy as np
import pytest

from linnet_jax.gguf import read_gguf, write_gguf

TENSOR_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"]


def tiny_model(arch: str, seed: int = 0) -> tuple[dict, dict[str, np.ndarray]]:
    """A random transformers-named state dict and config: llama (untied head), qwen2 (q/k/v biases, tied),
    qwen3 (q/k norms, head_dim 32 != hidden/heads)."""
    rng = np.random.default_rng(seed)
    hidden, heads, kv_heads, inter, vocab, layers = 64, 4, 2, 96, 128, 2
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

    def interleaved(n_heads):  # the HF row stored at each GGUF row
        return [h * head_dim + half * head_dim // 2 + pair
                for h in range(n_heads) for pair in range(head_dim // 2) for half in (0, 1)]

    stored = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(path).tensors}
    assert stored["blk.0.attn_q.weight"][:, 0].tolist() == interleaved(heads)
    assert stored["blk.0.attn_k.weight"][:, 0].tolist() == interleaved(kv_heads)
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
