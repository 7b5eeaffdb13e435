"""`export.peft`: LoRA adapters in PEFT's layout (adapter_config.json, adapter_model.safetensors), which
`peft.PeftModel.from_pretrained` loads on the base model's Hugging Face export and vLLM serves as a LoRA.

Tensor names (`linnet_jax.adapters.peft_name`, which also reads them back):
base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight [R, in] and ...lora_B.weight [out, R],
transformers' [out, in] convention (ours are input-first)."""

import warnings
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from linnet_jax.adapters import CONFIG, WEIGHTS, peft_name
from linnet_jax.files import prepare_target, staged, write_json
from linnet_jax.models.lora import Lora, check_shapes, lora_config_of
from linnet_jax.models.params import to_hf_layer_tensor

VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's max_lora_rank choices


def peft_state(lora: Lora) -> dict[str, np.ndarray]:
    """The adapters as PEFT's state dict: lora_A [R, in] and lora_B [out, R] per layer and target."""
    state = {}
    for field in lora.a:
        a, b = np.asarray(lora.a[field]), np.asarray(lora.b[field])  # [L, *I, R], [L, R, *O]
        for i in range(a.shape[0]):
            state[peft_name(field, i, "A")] = to_hf_layer_tensor(a[i], a.ndim - 2)
            state[peft_name(field, i, "B")] = to_hf_layer_tensor(b[i], 1)
    return state


def adapter_config(lora: Lora, base: str | None) -> dict:
    """adapter_config.json: a plain LoRA on the named modules, no dropout, bias or modules_to_save."""
    config = lora_config_of(lora)
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "inference_mode": True,
        "r": config.rank, "lora_alpha": config.alpha, "target_modules": list(config.targets), "lora_dropout": 0.0,
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "modules_to_save": None,
        "init_lora_weights": True, "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {},
        "alpha_pattern": {}, "revision": None,
    }


def peft(model, lora: Lora, out_dir, *, base: str | None = None, dtype=None, overwrite: bool = False) -> Path:
    """Write `lora` (adapters of `model`) as a PEFT adapter directory; returns its path.

    base: the base model's name or path recorded in adapter_config.json (PEFT and vLLM take the base model
    separately, so it is informational). dtype: None keeps the adapters' dtype; a numpy dtype name casts.
    A rank outside vLLM's choices (1, 8, 16, 32, ...) warns: PEFT loads it, vLLM does not.
    overwrite: an existing non-empty out_dir is a FileExistsError unless True (then only the two files are
    replaced; both are written under a temporary name first).
    """
    rank = lora_config_of(lora).rank
    check_shapes(model.config, lora)
    target = prepare_target(out_dir, overwrite)
    if rank not in VLLM_RANKS:
        warnings.warn(f"LoRA rank {rank} is not one vLLM serves (max_lora_rank choices {VLLM_RANKS})", stacklevel=2)
    state = {name: tensor.astype(dtype or tensor.dtype) for name, tensor in peft_state(lora).items()}
    with staged(target, (WEIGHTS, CONFIG)) as written:
        save_file(state, written / WEIGHTS, metadata={"format": "pt"})
        write_json(written / CONFIG, adapter_config(lora, base))
    return target

