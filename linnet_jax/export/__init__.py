"""Exports of a loaded Model: a Hugging Face checkpoint directory, a GGUF file, StableHLO, JAX source, PyTorch
source and ONNX; and LoRA adapters in PEFT's layout.

Each exporter's module is imported when it is first used (`linnet_jax.export.gguf` needs the gguf package).
"""

import importlib

EXPORTERS = {"gguf": "_gguf", "hf": "_hf", "jax_source": "_jax_source", "onnx": "_onnx", "peft": "_peft", "stablehlo": "_stablehlo",
             "torch_source": "_torch_source"}

__all__ = sorted(EXPORTERS)


def __getattr__(name: str):
    if name in EXPORTERS:
        return getattr(importlib.import_module(f"linnet_jax.export.{EXPORTERS[name]}"), name)
    raise AttributeError(f"module 'linnet_jax.export' has no attribute {name!r}")
