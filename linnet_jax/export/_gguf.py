"""`export.gguf`: a Model as one GGUF file that llama.cpp and transformers' GGUF loader read."""

from pathlib import Path

from linnet_jax.files import prepare_target, staged
from linnet_jax.gguf import write_gguf
from linnet_jax.models import params_to_hf

# export.gguf's dtype -> linnet_jax.gguf.write_gguf's tensor_type.
TENSOR_TYPES = {"f32": "F32", "f16": "F16", "bf16": "BF16", "q8_0": "Q8_0"}
Q8_0_BLOCK = 32  # inputs a Q8_0 scale covers


def gguf(model, path, *, dtype: str = "f16", overwrite: bool = False, progress: bool = True) -> Path:
    """Write `model` as a GGUF file; returns its path.

    dtype: the matrices' storage, "f32", "f16", "bf16" or "q8_0" (norms and biases stay f32). A quantized model's
    weights (`load(..., quantize="int8")`) whose scales cover blocks of 32 inputs (a Q8_0 GGUF's, loaded as
    stored) are written under "q8_0" as they are, never requantized; others are dequantized first.
    The file carries the llama/qwen2/qwen3 metadata, llama's q/k rows in llama.cpp's order, and the
    tokenizer (tokenizer.ggml.*, including `pre`, the bos/eos/padding ids, and the chat template).
    overwrite: an existing file is a FileExistsError unless True. The file is written under a temporary
    name and renamed at the end, so a failed export leaves no partial file.
    """
    if dtype not in TENSOR_TYPES:
        raise ValueError(f"dtype {dtype!r} is not supported for GGUF; expected one of {sorted(TENSOR_TYPES)}")
    target = prepare_target(path, overwrite)
    tokenizer_metadata = model.tokenizer.gguf_metadata() if model.tokenizer is not None else None
    with staged(target) as written:
        state = params_to_hf(model.params, model.config, block=Q8_0_BLOCK if dtype == "q8_0" else None)
        write_gguf(written, model.config.to_hf(), state, tensor_type=TENSOR_TYPES[dtype],
                   tokenizer_metadata=tokenizer_metadata, progress=progress)
    return target
