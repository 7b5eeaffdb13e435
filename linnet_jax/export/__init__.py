"""Exports of a loaded Model: a Hugging Face checkpoint directory, a GGUF file, StableHLO and JAX source; and
LoRA adapters in PEFT's layout."""

from linnet_jax.export._gguf import gguf
from linnet_jax.export._hf import hf
from linnet_jax.export._jax_source import jax_source
from linnet_jax.export._peft import peft
from linnet_jax.export._stablehlo import stablehlo

__all__ = ["gguf", "hf", "jax_source", "peft", "stablehlo"]
