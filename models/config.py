"""The model configuration: a frozen, hashable dataclass, static under jit.

`Config.from_hf` reads a transformers `config.json` dict in either spelling transformers has
used (legacy `rope_theta` / `rope_scaling` / `torch_dtype`, and transformers 5's
`rope_parameters` / `dtype`), ignores keys it does not use, names any required key that
is missing, and refuses a field of the wrong JSON type or one whose value it cannot honour
(an activation other than SiLU, a rope scaling factor ≤ 0). `to_hf` writes both spellings.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

from linnet_jax.ops.rope import RopeScaling

DTYPES = ("float32", "bfloat16", "float16")
QUANTIZE = ("int8",)  # how the products' weights may be stored besides the dtype (`linnet_jax.load(..., quantize=)`)


@dataclasses.dataclass(frozen=True)
class Family:
    """How one architecture differs from plain Llama. A bias of None reads `attention_bias`."""

    model_type: str
    qkv_bias: bool | None
    o_bias: bool | None
    qk_norm: bool


FAMILIES = {
    "LlamaForCausalLM": Family("llama", qkv_bias=None, o_bias=None, qk_norm=False),
    "MistralForCausalLM": Family("mistral", qkv_bias=False, o_bias=False, qk_norm=False),
    "Qwen2ForCausalLM": Family("qwen2", qkv_bias=True, o_bias=False, qk_norm=False),
    "Qwen3ForCausalLM": Family("qwen3", qkv_bias=None, o_bias=None, qk_norm=True),
}
MODEL_TYPES = {family.model_type: name for name, family in FAMILIES.items()}
REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
ACTIVATIONS = ("silu", "swish")  # the same function in transformers' ACT2FN: the SwiGLU MLP's


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# The JSON type each field read here must have when present and not null: (test, what is expected).
FIELD_TYPES: dict[str, tuple[Callable[[Any], bool], str]] = {
    **{key: (lambda v: _is_int(v) and v > 0, "a positive integer") for key in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window")},
    "max_window_layers": (lambda v: _is_int(v) and v >= 0, "a non-negative integer"),
    **{key: (_is_int, "an integer") for key in ("bos_token_id", "pad_token_id")},
    "eos_token_id": (lambda v: _is_int(v) or (isinstance(v, list) and all(map(_is_int, v))),
                     "an integer or a list of integers"),
    **{key: (lambda v: _is_number(v) and v > 0, "a positive number") for key in ("rms_norm_eps", "rope_theta")},
    **{key: (lambda v: isinstance(v, bool), "true or false") for key in (
        "tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window")},
    **{key: (lambda v: isinstance(v, str), "a string") for key in ("model_type", "hidden_act", "dtype", "torch_dtype")},
    **{key: (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of strings")
       for key in ("architectures", "layer_types")},
    **{key: (lambda v: isinstance(v, dict), "an object") for key in ("rope_scaling", "rope_parameters")},
}
# Rope scaling fields that must be positive numbers (0 or below would divide by zero or flip frequencies).
POSITIVE_ROPE_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
                        "rope_theta")


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything static about a Llama-family decoder."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    layer_windows: tuple[int, ...] = ()  # per layer: the sliding window, 0 for full attention
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    dtype: str = "float32"

    def __post_init__(self):
        if self.architecture not in FAMILIES:
            raise ValueError(f"unknown architecture {self.architecture!r}; supported: {sorted(FAMILIES)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not supported; expected one of {DTYPES}")
        if not self.layer_windows:
            object.__setattr__(self, "layer_windows", (0,) * self.num_layers)
        if len(self.layer_windows) != self.num_layers:
            raise ValueError(f"layer_windows has {len(self.layer_windows)} entries for {self.num_layers} layers")

    @property
    def family(self) -> Family:
        return FAMILIES[self.architecture]

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "Config":
        """Build from a transformers config dict; unknown keys are ignored."""
        _check_types(hf)
        architecture = _architecture(hf)
        family = FAMILIES[architecture]
        missing = [key for key in REQUIRED_KEYS if hf.get(key) is None]
        if missing:
            raise ValueError(f"config is missing required field(s) {missing} (a {architecture} config needs {REQUIRED_KEYS})")
        if hf.get("mlp_bias"):
            raise ValueError("config has mlp_bias=true, which linnet_jax does not support")
        if hf.get("hidden_act", "silu") not in ACTIVATIONS:
            raise ValueError(f"config field 'hidden_act' is {hf['hidden_act']!r}; linnet_jax's MLP computes SiLU "
                             f"(expected one of {ACTIVATIONS})")
        num_layers = hf["num_hidden_layers"]
        num_heads = hf["num_attention_heads"]
        attention_bias = bool(hf.get("attention_bias", False))
        rope_theta, rope_scaling = _rope(hf)
        sliding_window, layer_windows = _windows(hf, num_layers)
        eos = hf.get("eos_token_id")
        return cls(
            architecture=architecture,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias if family.qkv_bias is None else family.qkv_bias,
            o_bias=attention_bias if family.o_bias is None else family.o_bias,
            qk_norm=family.qk_norm,
            sliding_window=sliding_window,
            layer_windows=layer_windows,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
            pad_token_id=hf.get("pad_token_id"),
            dtype=_dtype_name(hf.get("dtype") or hf.get("torch_dtype") or "float32"),
        )

    def to_hf(self) -> dict[str, Any]:
        """A transformers config dict, with both the legacy and the transformers 5 keys."""
        scaling = self.rope_scaling
        scaling_fields = {} if scaling.rope_type == "default" else _scaling_fields(scaling)
        eos = list(self.eos_token_ids)
        hf = {
            "architectures": [self.architecture],
            "model_type": self.family.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": {"rope_type": scaling.rope_type, **scaling_fields} if scaling_fields else None,
            "rope_parameters": {"rope_type": scaling.rope_type, "rope_theta": self.rope_theta, **scaling_fields},
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.qkv_bias,
            "sliding_window": self.sliding_window,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
            "pad_token_id": self.pad_token_id,
            "torch_dtype": self.dtype,
            "dtype": self.dtype,
        }
        if self.family.model_type in ("qwen2", "qwen3"):
            sliding = ["sliding_attention" if w else "full_attention" for w in self.layer_windows]
            hf |= {"use_sliding_window": any(self.layer_windows), "layer_types": sliding}
            hf["max_window_layers"] = sliding.index("sliding_attention") if any(self.layer_windows) else self.num_layers
        return hf

    def num_params(self) -> int:
        """The number of weights (tied embeddings counted once)."""
        d, f, k = self.hidden_size, self.intermediate_size, self.head_dim
        h, g = self.num_heads, self.num_kv_heads
        attention = d * k * (2 * h + 2 * g) + (k * (h + 2 * g) if self.qkv_bias else 0) + (d if self.o_bias else 0)
        layer = attention + 3 * d * f + 2 * d + (2 * k if self.qk_norm else 0)
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.num_layers * layer + d + head


def _check_types(hf: dict[str, Any]) -> None:
    """A ValueError naming the first field whose JSON type (or sign) is not the one expected."""
    for key, (ok, expected) in FIELD_TYPES.items():
        value = hf.get(key)
        if value is not None and not ok(value):
            raise ValueError(f"config field {key!r} must be {expected}, got {type(value).__name__} {value!r}")
    for key in ("rope_scaling", "rope_parameters"):
        for field, value in (hf.get(key) or {}).items():
            if field in POSITIVE_ROPE_FIELDS and not (_is_number(value) and value > 0):
                raise ValueError(f"config field '{key}.{field}' must be a positive number, got {value!r}")


def _architecture(hf: dict[str, Any]) -> str:
    names = hf.get("architectures") or [MODEL_TYPES.get(hf.get("model_type"), hf.get("model_type"))]
    known = [name for name in names if name in FAMILIES]
    if not known:
        raise ValueError(f"unknown architecture {names}; supported: {sorted(FAMILIES)}")
    return known[0]


def _rope(hf: dict[str, Any]) -> tuple[float, RopeScaling]:
    """(theta, scaling) from `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (legacy)."""
    params = dict(hf.get("rope_scaling") or {})
    params |= hf.get("rope_parameters") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    fields = {f.name for f in dataclasses.fields(RopeScaling)} - {"rope_type"}
    return float(theta), RopeScaling(rope_type=rope_type, **{k: v for k, v in params.items() if k in fields})


def _scaling_fields(scaling: RopeScaling) -> dict[str, Any]:
    fields = dataclasses.asdict(scaling)
    del fields["rope_type"]
    return fields if scaling.rope_type == "llama3" else {"factor": scaling.factor}


def _windows(hf: dict[str, Any], num_layers: int) -> tuple[int | None, tuple[int, ...]]:
    """The sliding window and, per layer, the window it uses (0 = full attention)."""
    window = hf.get("sliding_window")
    if not window or hf.get("use_sliding_window") is False:
        return None, (0,) * num_layers
    layer_types = hf.get("layer_types")
    if layer_types is None:
        first = hf.get("max_window_layers", 0) if "use_sliding_window" in hf else 0
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    return window, tuple(window if kind == "sliding_attention" else 0 for kind in layer_types)


def _dtype_name(dtype: str) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"checkpoint dtype {dtype!r} is not supported; expected one of {DTYPES}")
    return name
