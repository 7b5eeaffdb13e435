"""`export.torch_source`: the model as one plain PyTorch `model.py` (torch, numpy, safetensors) + weights.

model.py is made from this model's config, never by hand per model: the rope frequencies are linnet_jax's own
source (`inverse_frequencies`, numpy), the config is inlined as constants (`_jax_source.config_source`), the
weights' names and shapes are linnet_jax's declarations (`LAYER_SHAPES`, `SHAPES`: every weight this config
has, in linnet_jax's input-first layout, with each of a layer's `FUSED` groups stored as one tensor), and the
PyTorch decoder below (`MODEL`) branches on those constants only. A config field the decoder does not read is
refused at export (`READ_FIELDS`), never dropped silently.

The decoder keeps a static KV cache, per layer keys [B, G, K, S + 1] (slots last: the scores' product reads them
as they lie) and values [B, G, S + 1, K]: slot p holds position p, the last slot takes the writes of padding
(position -1) and is never seen. A step (`Decoder.forward`) writes the cache in place by indexed assignment (which
inductor keeps in place: a scatter_ made it copy every layer's cache each step) and makes no host sync, so
`torch.compile` (inductor, CUDA graphs) takes it whole; `generate` syncs once per token, between steps, to test
the stop ids.
"""

import dataclasses
import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from linnet_jax._version import __version__
from linnet_jax.export._jax_source import banner, config_source, section, undefined_names
from linnet_jax.files import MODEL_FILES, generation_config, prepare_target, staged, write_model_files
from linnet_jax.models import Config
from linnet_jax.models.params import LayerParams, declared, flatten_params, layer_shapes, param_shapes, unstack_layers
from linnet_jax.ops.rope import ROPE_TYPES
from linnet_jax.sharding import host

MODULE = "model.py"
WEIGHTS = "model.safetensors"
README = "README.md"

# Taken from linnet_jax as they are (numpy and the standard library only).
SOURCES: dict[str, list[str]] = {
    "linnet_jax.ops.rope": ["ROPE_TYPES", "RopeScaling", "inverse_frequencies", "_llama3_frequencies"],
    "linnet_jax.inputs": ["MIN_BUCKET", "bucket"],
}
# A layer's products the decoder computes as one, each group's weights stored side by side along their first output
# axis: w_qkv [D, H + 2G, K], b_qkv [H + 2G, K], w_gate_up [D, 2F]. A step makes 4 matrix-vector products a layer
# instead of 7, each longer (SmolLM2's shapes, 2 threads: the layers' products 32 -> 28 ms). A group's parts share
# one `when` (models/params.py): a config has all of them or none.
FUSED = {"w_qkv": ("wq", "wk", "wv"), "b_qkv": ("bq", "bk", "bv"), "w_gate_up": ("w_gate", "w_up")}
# Every Config field and where MODEL honours it; a field not named here is refused (see `check_config`).
READ_FIELDS = {
    "architecture": "the family: its differences are the fields below", "vocab_size": "SHAPES",
    "hidden_size": "SHAPES", "intermediate_size": "LAYER_SHAPES", "num_layers": "Decoder.layers",
    "num_heads": "Layer.forward", "num_kv_heads": "Layer.forward, Decoder.init_cache",
    "head_dim": "Layer.forward, inverse_frequencies", "rms_norm_eps": "rms_norm",
    "rope_theta": "inverse_frequencies", "rope_scaling": "inverse_frequencies",
    "max_position_embeddings": "generate", "tie_word_embeddings": "SHAPES (no lm_head), Decoder.forward",
    "qkv_bias": "Layer.forward", "o_bias": "Layer.forward", "qk_norm": "Layer.forward",
    "sliding_window": "layer_windows", "layer_windows": "Decoder.forward", "bos_token_id": "not computed with",
    "eos_token_ids": "EOS_TOKEN_IDS", "pad_token_id": "not computed with", "dtype": "the weights' dtype",
}

IMPORTS = """\
import dataclasses
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn
"""

MODEL = '''
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Root-mean-square norm over the last axis: x [..., D], weight [D] -> [..., D] in x's dtype (normalised in
    float32, cast back, then scaled, as transformers' LlamaRMSNorm)."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, K] rotated in Hugging Face's half-split layout by angles whose cos and sin are float32
    [B, T, 1, K/2]; in x's dtype."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def project(x: torch.Tensor, w: torch.Tensor, inputs: int = 1) -> torch.Tensor:
    """x [..., I...] times w [I..., O...] stored input-first, contracting x's last `inputs` axes: [..., O...]."""
    fan_in = math.prod(w.shape[:inputs])
    out = x.flatten(-inputs) @ w.reshape(fan_in, -1)
    return out.unflatten(-1, w.shape[inputs:]) if w.dim() - inputs > 1 else out


class Layer(nn.Module):
    """One pre-norm decoder block: its weights (LAYER_SHAPES) and its sliding window (0: full attention)."""

    def __init__(self, window: int, dtype: torch.dtype):
        super().__init__()
        for name, shape in LAYER_SHAPES.items():
            self.register_parameter(name, nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False))
        self.window = window

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                write: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """x + attention(norm(x)), then + swiglu(norm(x)). x [B, T, D]; cos, sin [B, T, 1, K/2]; mask bool
        [B, 1, 1, T, S + 1], which slots each query sees; write [B, T], the slot of each new token; keys
        [B, G, K, S + 1], values [B, G, S + 1, K]: this layer's cache, written in place. Returns [B, T, D]."""
        b, t, _ = x.shape
        g, d = CONFIG.num_kv_heads, CONFIG.head_dim
        r = CONFIG.num_heads // g  # query heads per key/value head: head h reads key/value head h // r
        h = rms_norm(x, self.attn_norm, CONFIG.rms_norm_eps)
        qkv = project(h, self.w_qkv)  # [B, T, H + 2G, K]: the query heads, then the keys', then the values'
        if CONFIG.qkv_bias:
            qkv = qkv + self.b_qkv
        q, k, v = qkv.split((CONFIG.num_heads, g, g), dim=-2)  # [B, T, H or G, K]
        if CONFIG.qk_norm:
            q, k = rms_norm(q, self.q_norm, CONFIG.rms_norm_eps), rms_norm(k, self.k_norm, CONFIG.rms_norm_eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rows = torch.arange(b, device=x.device)[:, None]  # [B, 1]
        keys[rows, :, :, write] = k.to(keys.dtype)  # k [B, T, G, K] into each row's slots write[b]
        values[rows, :, write] = v.to(values.dtype)
        grouped = q.view(b, t, g, r, d).permute(0, 2, 3, 1, 4).reshape(b, g, r * t, d)  # [B, G, R*T, K]
        scores = (grouped @ keys).float().view(b, g, r, t, -1) * d**-0.5  # [B, G, R, T, S+1]
        scores = scores.masked_fill(~mask, torch.finfo(torch.float32).min)
        probs = scores.softmax(-1).to(values.dtype).view(b, g, r * t, -1)
        mixed = (probs @ values).view(b, g, r, t, d).permute(0, 3, 1, 2, 4).reshape(b, t, g * r, d)  # [B, T, H, K]
        out = project(mixed, self.wo, inputs=2)
        x = x + (out + self.bo if CONFIG.o_bias else out)
        h = rms_norm(x, self.mlp_norm, CONFIG.rms_norm_eps)
        gate, up = project(h, self.w_gate_up).chunk(2, dim=-1)  # [B, T, F] each
        return x + project(F.silu(gate) * up, self.w_down)


class Decoder(nn.Module):
    """The decoder: SHAPES' weights around the layers. Its state_dict's names are WEIGHTS' names."""

    def __init__(self, dtype: torch.dtype = torch.float32):
        super().__init__()
        for name, shape in SHAPES.items():
            self.register_parameter(name, nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False))
        self.layers = nn.ModuleList(Layer(window, dtype) for window in CONFIG.layer_windows)
        inv_freq = inverse_frequencies(CONFIG.head_dim, CONFIG.rope_theta, CONFIG.rope_scaling)
        self.register_buffer("inv_freq", torch.from_numpy(inv_freq), persistent=False)  # float32 [K/2]

    def init_cache(self, batch: int = 1, max_len: int = MAX_LEN) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """An empty cache of max_len slots per row (and one for padding's writes): (keys, values), lists of L zero
        tensors, keys [batch, G, K, max_len + 1] and values [batch, G, max_len + 1, K], in the weights' dtype, on
        their device."""
        g, slots, d = CONFIG.num_kv_heads, max_len + 1, CONFIG.head_dim
        empty = lambda *shape: torch.zeros(shape, dtype=self.embed.dtype, device=self.embed.device)  # noqa: E731
        keys = [empty(batch, g, d, slots) for _ in self.layers]
        values = [empty(batch, g, slots, d) for _ in self.layers]
        for tensor in keys + values:  # written in place, never moved: CUDA graphs (torch.compile's "reduce-overhead")
            torch._dynamo.mark_static_address(tensor, guard=False)  # take a step whole; no recompile for a new cache
        return keys, values

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, keys: list[torch.Tensor],
                values: list[torch.Tensor]) -> torch.Tensor:
        """Feed tokens [B, T] at positions [B, T] (int64; -1: padding, attending to nothing and written to the
        padding slot) through the cache (keys, values from init_cache, written in place): a token at position
        p goes to slot p and sees slots 0 .. p (the window's only, under a sliding window). Returns the float32
        logits [B, V] of the last column. No host sync: one step is one graph for torch.compile."""
        x = F.embedding(tokens, self.embed)
        slots = torch.arange(values[0].shape[2], device=tokens.device)  # slot i holds position i
        at = positions[:, :, None]  # [B, T, 1]
        seen = (slots <= at)[:, None, None]  # [B, 1, 1, T, S + 1]; the padding slot (S) is past every position
        masks = {window: seen if window == 0 else seen & (at - slots < window)[:, None, None]
                 for window in dict.fromkeys(CONFIG.layer_windows)}
        write = torch.where(positions >= 0, positions, slots.shape[0] - 1)  # [B, T]
        angles = positions.clamp(min=0).float()[:, :, None] * self.inv_freq  # [B, T, K/2]
        cos, sin = angles.cos()[:, :, None], angles.sin()[:, :, None]
        for layer, k, v in zip(self.layers, keys, values):
            x = layer(x, cos, sin, masks[layer.window], write, k, v)
        x = rms_norm(x[:, -1], self.final_norm, CONFIG.rms_norm_eps)
        head = self.embed if CONFIG.tie_word_embeddings else self.lm_head
        return (x @ head.T).float()


def load_weights(path=None, device="cpu") -> Decoder:
    """The Decoder holding a safetensors file's weights (default: WEIGHTS beside this file), on `device`.
    A missing or misshapen tensor is an error naming it (load_state_dict, strict)."""
    state = load_file(Path(__file__).with_name(WEIGHTS) if path is None else path, device=str(device))
    module = Decoder(state["embed"].dtype).to(device)
    module.load_state_dict(state, strict=True, assign=True)
    return module.eval()


def pick(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
         generator: torch.Generator | None = None) -> torch.Tensor:
    """The next ids [B] from float32 logits [B, V]: the argmax when temperature is 0, else a draw from
    softmax(logits / temperature) kept to the top_k largest (0: all) and to the fewest whose mass reaches top_p."""
    if temperature == 0:
        return logits.argmax(-1)
    scaled = logits / temperature
    if top_k:
        scaled = scaled.masked_fill(scaled < scaled.topk(top_k).values[:, -1:], -math.inf)
    if top_p < 1:
        ordered, order = scaled.sort(-1, descending=True)
        probs = ordered.softmax(-1)
        beyond = probs.cumsum(-1) - probs >= top_p  # the mass before it already reaches top_p
        scaled = scaled.scatter(-1, order, ordered.masked_fill(beyond, -math.inf))
    return torch.multinomial(scaled.softmax(-1), 1, generator=generator)[:, 0]


@torch.inference_mode()
def generate(params: Decoder, ids: list[int], max_new_tokens: int, stop_ids=EOS_TOKEN_IDS, *,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None) -> list[int]:
    """Up to max_new_tokens new ids after the prompt `ids`, ending before the first stop id. params: the Decoder
    (load_weights), or torch.compile of it. Greedy when temperature is 0, else sampled (`pick`), seeded by seed.
    The cache has MAX_LEN slots: the prompt plus the new tokens must fit."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    limit = min(MAX_LEN, CONFIG.max_position_embeddings)
    if not ids or len(ids) + max_new_tokens > limit:
        raise ValueError(f"a prompt of {len(ids)} ids plus {max_new_tokens} new tokens does not fit the cache of "
                         f"{limit} positions (nor may the prompt be empty)")
    if not all(0 <= i < CONFIG.vocab_size for i in ids):
        raise ValueError(f"token ids must be in [0, {CONFIG.vocab_size}), got {min(ids)}..{max(ids)}")
    device = params.embed.device
    width = bucket(len(ids))  # few prompt shapes, few compiled graphs
    tokens = torch.zeros((1, width), dtype=torch.int64, device=device)
    positions = torch.full((1, width), -1, dtype=torch.int64, device=device)
    tokens[0, width - len(ids):] = torch.tensor(ids)  # left-padded: the last column is the prompt's last token
    positions[0, width - len(ids):] = torch.arange(len(ids))
    keys, values = params.init_cache()
    generator = None if seed is None else torch.Generator(device).manual_seed(seed)
    token = pick(params(tokens, positions, keys, values), temperature, top_k, top_p, generator)
    position = torch.full((1, 1), len(ids), dtype=torch.int64, device=device)
    new = []
    while True:
        new.append(int(token[0]))  # the one host sync per token, between steps
        if new[-1] in stop_ids or len(new) == max_new_tokens:
            return new[:-1] if new[-1] in stop_ids else new
        token = pick(params(token[:, None], position, keys, values), temperature, top_k, top_p, generator)
        position += 1
'''


def torch_source(model, out_dir, *, max_len: int = 1024, overwrite: bool = False) -> Path:
    """Write `model` as a plain PyTorch model.py plus model.safetensors in out_dir; returns its path.

    model.py needs torch, numpy and safetensors: `load_weights()` (the `nn.Module`, which torch.compile takes),
    `generate(params, ids, max_new_tokens, stop_ids=EOS_TOKEN_IDS, temperature=0, top_k=0, top_p=1, seed=None)`
    and the decoder's static cache of max_len slots. The config, the tokenizer files and a README go beside
    it. overwrite: an existing non-empty out_dir is a FileExistsError unless True (then only these files are
    replaced; all are written under a temporary name first).
    """
    model = model.dequantized()  # a quantized model's weights are written as the floats they stand for
    source = module_source(model, max_len)
    target = prepare_target(out_dir, overwrite)
    with staged(target, (MODULE, WEIGHTS, README, *MODEL_FILES)) as written:
        save_weights(model.params, written / WEIGHTS)
        (written / MODULE).write_text(source, encoding="utf-8")
        (written / README).write_text(readme(model), encoding="utf-8")
        write_model_files(written, model.config, model.tokenizer)
    return target


def save_weights(params, path: Path) -> None:
    """The weights under the Decoder's state_dict names (`decoder_state`)."""
    save_file(decoder_state(params), path)


def decoder_state(params) -> dict[str, np.ndarray]:
    """The generated Decoder's state_dict as host arrays: linnet_jax's flat names and layout, per layer
    ("layers.0.attn_norm"), each layer's FUSED groups concatenated ("layers.0.w_qkv")."""
    unstacked = unstack_layers(params)
    state = {name: host(array) for name, array in flatten_params(unstacked.replace(layers=())).items()}
    for i, layer in enumerate(unstacked.layers):
        tensors = fused_layer({field: host(array) for field, array in flatten_params(layer).items()}, np.concatenate)
        state |= {f"layers.{i}.{field}": tensor for field, tensor in tensors.items()}
    return state


def fused_layer(layer: dict, join: Callable[[list, int], Any]) -> dict:
    """A layer's tensors (or shapes) by field name, each FUSED group that it has made one, named by the group, in
    its first part's place: join(parts, axis) along the parts' first output axis (a weight's after its inputs, a
    bias's first)."""
    out = {}
    for field, value in layer.items():
        group = next((name for name, parts in FUSED.items() if field in parts), None)
        if group is None:
            out[field] = value
        elif field == FUSED[group][0]:
            out[group] = join([layer[part] for part in FUSED[group]], declared(LayerParams)[field]["inputs"] or 0)
    return out


def joined_shape(shapes: list[tuple[int, ...]], axis: int) -> tuple[int, ...]:
    """The shape of `shapes` concatenated along axis."""
    return (*shapes[0][:axis], sum(shape[axis] for shape in shapes), *shapes[0][axis + 1:])


def check_config(config: Config) -> None:
    """Refuse a config that MODEL cannot express: a field it does not read, a rope type beyond the frequencies."""
    unread = [field.name for field in dataclasses.fields(config) if field.name not in READ_FIELDS]
    if unread:
        raise NotImplementedError(f"export.torch_source cannot express the config field(s) {unread}: the generated "
                                  f"PyTorch decoder reads {sorted(READ_FIELDS)} (linnet_jax/export/_torch_source.py)")
    if config.rope_scaling.rope_type not in ROPE_TYPES:
        raise NotImplementedError(f"export.torch_source cannot express rope type {config.rope_scaling.rope_type!r}; "
                                  f"it has {ROPE_TYPES}")


def check_max_len(config: Config, max_len) -> int:
    if isinstance(max_len, bool) or not isinstance(max_len, int) or not 0 < max_len <= config.max_position_embeddings:
        raise ValueError(f"max_len must be an int in [1, {config.max_position_embeddings}] (the model's context), "
                         f"got {max_len!r}")
    return max_len


def module_source(model, max_len: int = 1024) -> str:
    """The text of model.py for this model, compiled and checked for undefined names."""
    check_config(model.config)
    shapes = flatten_params(param_shapes(model.config))
    eos = generation_config(model.config, model.tokenizer).get("eos_token_id", [])
    layer = fused_layer(layer_shapes(model.config), joined_shape)
    constants = (f"WEIGHTS = {WEIGHTS!r}\n"
                 f"MAX_LEN = {check_max_len(model.config, max_len)!r}  # the cache's slots per row\n"
                 f"EOS_TOKEN_IDS = {tuple(eos) if isinstance(eos, list) else (eos,)!r}\n"
                 "CONFIG = Config()\n"
                 "# every weight, by its name in WEIGHTS: linnet_jax's layout, projections input-first\n"
                 "# ([D, H, K], ...); a layer's q, k, v as one w_qkv [D, H + 2G, K] (biases b_qkv [H + 2G, K]),\n"
                 "# gate and up as one w_gate_up [D, 2F]\n"
                 f"SHAPES = {({n: s for n, s in shapes.items() if not n.startswith('layers.')})!r}\n"
                 f"LAYER_SHAPES = {layer!r}  # each of layers.0 .. layers.{model.config.num_layers - 1}\n")
    parts = [header(model), IMPORTS]
    for module, names in SOURCES.items():
        parts += section(importlib.import_module(module), names)
    parts += [banner("the configuration, inlined"), config_source(model.config), constants,
              banner("the decoder, in PyTorch, and generation"), MODEL]
    source = "\n\n\n".join(part.strip("\n") for part in parts) + "\n"
    compile(source, MODULE, "exec")
    missing = undefined_names(source)
    if missing:
        raise RuntimeError(f"the generated {MODULE} uses {sorted(missing)} without defining them: add them to SOURCES "
                           f"in {__file__}")
    return source


def header(model) -> str:
    """The module docstring: what the file is and how to use it."""
    return f'''"""{model!r}, as plain PyTorch.

Generated by linnet_jax {__version__} (`linnet_jax.export.torch_source`) from this model's config: the
config is inlined as constants, the rope frequencies are linnet_jax's own; no transformers, no linnet_jax.
Needs torch, numpy and safetensors; the weights are {WEIGHTS}.

    import model
    params = model.load_weights()                                    # the nn.Module, weights from {WEIGHTS}
    new_ids = model.generate(params, [1, 2, 3], max_new_tokens=16)   # greedy; stops at EOS_TOKEN_IDS
    fast = torch.compile(params)                                     # inductor: the same generate
    new_ids = model.generate(fast, [1, 2, 3], max_new_tokens=16, temperature=0.7, top_p=0.9, seed=0)
"""'''


def readme(model) -> str:
    return f"""# {model.config.architecture}, as plain PyTorch

Generated by linnet_jax {__version__} (`linnet_jax.export.torch_source`): `{MODULE}` needs torch, numpy and
safetensors only (no transformers, no linnet_jax); the weights are `{WEIGHTS}`, the tokenizer `tokenizer.json`.

```python
import sys, torch
from tokenizers import Tokenizer
sys.path.insert(0, "path/to/this/folder")
import model

params = model.load_weights()                      # an nn.Module; torch.compile(params) runs the same generate
tokenizer = Tokenizer.from_file("path/to/this/folder/tokenizer.json")
new = model.generate(params, tokenizer.encode("The capital of France is").ids, max_new_tokens=16)
print(tokenizer.decode(new))
```
"""
