"""`export.onnx`: the model as ONNX graphs for prefill and for decode, with the KV cache as inputs and outputs,
one weights file they share, and runner.py (onnxruntime, numpy and tokenizers only).

How the graphs are made: `torch.onnx.export` (the dynamo exporter, through onnxscript) of the PyTorch decoder
that `export.torch_source` generates from this model's config, so no graph is written by hand per model, and an
op ONNX cannot express is an export error (torch.onnx's), never a wrong graph. Not jax2onnx: its releases that
support jax 0.10 (0.13 and later) require orbax-checkpoint < 0.11.37 where linnet_jax requires >= 0.12, and
the older ones pull in equinox, dm-pix, netron and orbax-export; and the jaxpr of linnet_jax's own forward would
first need a path without its XLA:CPU custom calls. The trade-off: the graph is the PyTorch decoder's, not the
jaxpr of linnet_jax's forward, and exporting needs torch; the tests hold both to transformers and to `generate`.
torch.onnx's own graph optimizer (onnxscript's rewrites) is left off: ONNX Runtime optimizes each graph as it loads
it, and with it on, SmolLM2's export took 97 s rather than 68 s for the same ids at the same decode speed.

Precision: float32 and float16 weights and cache (norms, rope and softmax in float32 inside the graph, as in
linnet_jax). bfloat16 is refused: ONNX Runtime's CPU provider has no bfloat16 MatMul kernel, so such a graph
would not run there.
"""

import hashlib
import shutil
import sys
import tempfile
import types
from pathlib import Path

import numpy as np

from linnet_jax._version import __version__
from linnet_jax.export._torch_source import MODULE, check_max_len, decoder_state, module_source
from linnet_jax.files import MODEL_FILES, generation_config, prepare_target, staged, write_json, write_model_files
from linnet_jax.inputs import bucket

DTYPES = ("float32", "float16")
GRAPHS = {"prefill": "prefill.onnx", "decode": "decode.onnx"}
WEIGHTS = "weights.data"
RUNNER = "runner.py"  # every export's copy of onnx_runner.py
MANIFEST = "manifest.json"
OUTPUTS = (*GRAPHS.values(), WEIGHTS, RUNNER, MANIFEST, *MODEL_FILES)
ALIGNMENT = 4096  # each weight starts on a page in WEIGHTS, so ONNX Runtime can map it rather than copy it
INLINE_BYTES = 1024  # smaller initializers (shape constants, ...) stay inside the graph


def onnx(model, out_dir, *, dtype: str = "float32", max_len: int = 1024, overwrite: bool = False) -> Path:
    """Write `model` as ONNX in the directory out_dir; returns its path.

    Writes prefill.onnx (tokens, positions int64 [1, T], any T) and decode.onnx ([1, 1]), both taking and
    returning the cache per layer (k.0 .. k.{L-1} [1, G, K, max_len + 1], v.0 .. v.{L-1} [1, G, max_len + 1, K],
    the generated PyTorch decoder's layout) and returning float32 logits [1, V]
    of the last column; weights.data (their weights, once); manifest.json; runner.py (`load_weights()`,
    `generate(params, ids, max_new_tokens, stop_ids)`); the config and tokenizer files. dtype: "float32" or
    "float16", the weights' and the cache's. overwrite: an existing non-empty out_dir is a FileExistsError
    unless True (then only these files are replaced; all are written under a temporary name first).
    """
    model = model.dequantized()  # a quantized model's weights are written as the floats they stand for
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}"
                         + (": ONNX Runtime's CPU provider has no bfloat16 MatMul" if dtype == "bfloat16" else ""))
    check_max_len(model.config, max_len)
    target = prepare_target(out_dir, overwrite)
    with staged(target, OUTPUTS) as written, tempfile.TemporaryDirectory(dir=written.parent) as scratch:
        module = decoder_module(model, dtype, max_len)
        cache = module.decoder.init_cache(1, max_len)
        graphs = export_graphs(module, cache, model.config, max_len, Path(scratch))
        share_weights(graphs, written)
        shutil.copyfile(Path(__file__).with_name("onnx_runner.py"), written / RUNNER)
        write_json(written / MANIFEST, manifest(model, dtype, max_len, cache))
        write_model_files(written, model.config, model.tokenizer)
    return target


def generated(model, max_len: int) -> types.ModuleType:
    """export.torch_source's model.py for this model, as a module (not written anywhere)."""
    module = types.ModuleType(f"linnet_generated_{id(model):x}")
    module.__file__ = MODULE
    sys.modules[module.__name__] = module  # dataclasses look their module up while the source runs
    try:
        exec(compile(module_source(model, max_len), MODULE, "exec"), module.__dict__)
    finally:
        del sys.modules[module.__name__]
    return module


def decoder_module(model, dtype: str, max_len: int):
    """The generated Decoder holding the model's weights cast to dtype, wrapped to take and return the cache."""
    import torch

    source = generated(model, max_len)
    torch_dtype = getattr(torch, dtype)
    decoder = source.Decoder(torch_dtype)
    state = {name: torch.from_numpy(np.asarray(array, np.float32)).to(torch_dtype)
             for name, array in decoder_state(model.params).items()}
    decoder.load_state_dict(state, strict=True, assign=True)

    class WithCache(torch.nn.Module):
        """(tokens, positions, keys [k.0 .. k.{L-1}], values [v.0 .. v.{L-1}]) -> (logits, *keys, *values written)."""

        def __init__(self):
            super().__init__()
            self.decoder = decoder.eval()

        def forward(self, tokens, positions, keys, values):
            keys, values = [k.clone() for k in keys], [v.clone() for v in values]
            return self.decoder(tokens, positions, keys, values), *keys, *values

    return WithCache()


def export_graphs(module, cache, config, max_len: int, scratch: Path) -> dict[str, Path]:
    """Each graph exported by torch.onnx (dynamo) into scratch, with its weights as external data; cache: the
    decoder's empty (keys, values) lists, the example inputs."""
    import torch

    layers = range(config.num_layers)
    cache_names = [f"{kv}.{i}" for kv in "kv" for i in layers]
    width = torch.export.Dim("width", min=2, max=max(bucket(max_len), 16))
    shapes = {"prefill": (1, 16), "decode": (1, 1)}
    paths = {}
    for name, shape in shapes.items():
        tokens, positions = torch.zeros(shape, dtype=torch.int64), torch.arange(shape[1]).expand(shape)  # two tensors
        dynamic = ({1: width}, {1: width}, [None] * len(layers), [None] * len(layers)) if name == "prefill" else None
        try:
            program = torch.onnx.export(
                module, (tokens, positions, *cache), dynamo=True, dynamic_shapes=dynamic,
                input_names=["tokens", "positions", *cache_names],
                output_names=["logits", *(n.replace(".", "_out.") for n in cache_names)], optimize=False,
                verbose=False)
        except Exception as error:
            raise RuntimeError(f"torch.onnx could not export the {name} graph of {config.architecture}: {error}") \
                from error
        paths[name] = scratch / GRAPHS[name]
        program.save(paths[name], external_data=True)
    return paths


def share_weights(graphs: dict[str, Path], target: Path) -> None:
    """Write each graph into target with every initializer of INLINE_BYTES or more in one file, WEIGHTS: the same
    bytes are written once, page-aligned, whichever graph holds them under whatever name (torch.onnx names a
    folded weight differently in each graph), and each graph points at them. The nodes' metadata (torch.onnx's
    stack traces and FX names: about 2 MB a graph for 30 layers, with this machine's paths) is left out."""
    import onnx
    from onnx.external_data_helper import uses_external_data

    placed: dict[str, tuple[int, int]] = {}  # sha256 of the bytes -> (offset, length)
    with open(target / WEIGHTS, "wb") as weights:
        for name, path in graphs.items():
            graph = onnx.load(path, load_external_data=False)
            for node in graph.graph.node:
                del node.metadata_props[:]
            for tensor in graph.graph.initializer:
                data = external_bytes(tensor, path.parent) if uses_external_data(tensor) else tensor.raw_data
                if len(data) < INLINE_BYTES:
                    if uses_external_data(tensor):
                        del tensor.external_data[:]
                        tensor.data_location = onnx.TensorProto.DEFAULT
                        tensor.raw_data = data
                    continue
                key = hashlib.sha256(data).hexdigest()
                if key not in placed:
                    weights.write(b"\0" * (-weights.tell() % ALIGNMENT))
                    placed[key] = (weights.tell(), len(data))
                    weights.write(data)
                del tensor.external_data[:]
                tensor.ClearField("raw_data")
                offset, length = placed[key]
                for field, value in (("location", WEIGHTS), ("offset", str(offset)), ("length", str(length))):
                    entry = tensor.external_data.add()
                    entry.key, entry.value = field, value
                tensor.data_location = onnx.TensorProto.EXTERNAL
            onnx.save(graph, target / GRAPHS[name])


def external_bytes(tensor, directory: Path) -> bytes:
    """The bytes of an initializer stored outside its graph (in a file of `directory`)."""
    info = {entry.key: entry.value for entry in tensor.external_data}
    with open(directory / info["location"], "rb") as file:
        file.seek(int(info.get("offset", 0)))
        return file.read(int(info["length"])) if "length" in info else file.read()


def manifest(model, dtype: str, max_len: int, cache) -> dict:
    """What runner.py reads: the graphs, the weights file, the cache's shapes (those of `cache`, the decoder's
    (keys, values) lists) and dtype, the EOS ids."""
    config = model.config
    eos = generation_config(config, model.tokenizer).get("eos_token_id", [])
    return {"format": "linnet_jax ONNX export", "linnet_jax": __version__, "architecture": config.architecture,
            "graphs": GRAPHS, "weights": WEIGHTS, "dtype": dtype, "max_len": max_len, "num_layers": config.num_layers,
            "vocab_size": config.vocab_size, "eos_token_ids": eos if isinstance(eos, list) else [eos],
            "cache": {"k": list(cache[0][0].shape), "v": list(cache[1][0].shape), "dtype": dtype}}
