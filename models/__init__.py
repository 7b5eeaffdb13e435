"""The Llama-family decoder: config, params pytree and forward."""

from linnet_jax.models.config import FAMILIES, Config
from linnet_jax.models.decoder import KVCache, forward, init_cache
from linnet_jax.models.params import LayerParams, Params, param_shapes, params_from_hf, params_to_hf

__all__ = ["FAMILIES", "Config", "KVCache", "LayerParams", "Params", "forward", "init_cache", "param_shapes",
           "params_from_hf", "params_to_hf"]
