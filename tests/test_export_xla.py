"""The exports that stay in XLA, verified by running them in a fresh process that cannot import linnet_jax
(nor flax): export.stablehlo through the load.py every export carries, export.jax_source's generated model.py.
Greedy ids must equal linnet_jax.generate, logits linnet_jax.logits; each reports its distance from transformers."""

import ast
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import record_parity, reference_logits, transformers
from standalone import imported_modules, run_python, run_standalone

import linnet_jax
from linnet_jax import cli, export
from linnet_jax.export import _jax_source
from linnet_jax.models.params import flatten_params, unstack_layers

ROOT = Path(__file__).resolve().parent.parent
STANDALONE_IMPORTS = {"collections", "dataclasses", "functools", "math", "pathlib", "jax", "numpy", "safetensors"}
TINY_PROMPT = [int(i) for i in np.random.default_rng(0).integers(3, 256, 20)]  # bucket 32
TINY_NEW = 12
SMOLLM2_NEW = 16


LOADER = ROOT / "linnet_jax" / "export" / "stablehlo_loader.py"


def exported_loader(out: Path):
    """The export's own load.py, imported from its path (in this process)."""
    spec = importlib.util.spec_from_file_location("exported_stablehlo_load", out / "load.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def eight_devices() -> dict[str, str]:
    """A child's environment with 8 fake CPU devices (this process keeps its one)."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()
    return os.environ | {"XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}


def stablehlo_run(out: Path, ids: list[int], new: int,
                  env: dict[str, str] | None = None) -> tuple[list[int], np.ndarray]:
    """The export's load.py, imported from the export's directory where linnet_jax cannot be: greedy's ids and
    logits, and greedy_ids (the on-device loop) must give the same ids."""
    return run_standalone(f"""
import json
import numpy as np
sys.path.insert(0, {str(out)!r})
import load

exported = load.Export({str(out)!r})
new, logits = exported.greedy({ids}, {new})
assert exported.greedy_ids({ids}, {new}) == new, (exported.greedy_ids({ids}, {new}), new)
open("ids.json", "w").write(json.dumps(new))
np.save("logits.npy", logits)
""", out, env)


def jax_source_run(out: Path, ids: list[int], new: int) -> tuple[list[int], np.ndarray]:
    return run_standalone(f"""
import json
import jax
import numpy as np
sys.path.insert(0, {str(out)!r})
import model

params = model.load_weights()
new = model.generate(params, {ids}, {new}, stop_ids=())
seen = {ids} + new[:-1]
forward = jax.jit(model.forward, static_argnums=1)
logits, _ = forward(params, model.CONFIG, np.asarray([seen]), np.arange(len(seen))[None])
open("ids.json", "w").write(json.dumps(new))
np.save("logits.npy", np.asarray(logits[0, {len(ids) - 1}:]))
""", out)


def check_run(model, ids: list[int], new_ids: list[int], logits: np.ndarray, new: int) -> float:
    """Assert that new_ids are linnet_jax.generate's greedy ids; return the largest |logit difference| from
    linnet_jax.logits over the same sequence, at the positions that chose them."""
    assert new_ids == linnet_jax.generate(model, tokens=[ids], max_new_tokens=new, ignore_eos=True)[0]
    expected = np.asarray(linnet_jax.logits(model, [ids + new_ids[:-1]]))[0, len(ids) - 1:]
    assert logits.shape == expected.shape == (new, model.config.vocab_size)
    return float(np.abs(logits - expected).max())


def transformers_distance(reference, ids: list[int], new_ids: list[int], logits: np.ndarray) -> float:
    expected = reference_logits(reference, np.asarray([ids + new_ids[:-1]]))[0, len(ids) - 1:]
    return float(np.abs(logits - expected).max())


def test_stablehlo_tiny_runs_standalone(tiny_dir, tmp_path):
    reference, directory = tiny_dir("llama_gqa_llama3")
    model = linnet_jax.load(directory, progress=False)
    out = export.stablehlo(model, tmp_path / "hlo", max_len=64, progress=False)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["buckets"] == [16, 32] and (manifest["batch"], manifest["max_len"]) == (1, 64)
    assert [(t["name"], tuple(t["shape"])) for t in manifest["weights"]["tensors"]] == [
        (name, w.shape) for name, w in flatten_params(unstack_layers(model.params)).items()]
    assert manifest["weights"]["tensors"][1]["name"] == "layers.0.attn_norm"  # per layer: the unrolled programs
    assert manifest["cache"]["k.1"] == {"shape": [2, 64, 16], "dtype": "float32", "fill": 0.0}
    assert sorted(manifest["cache"]) == sorted(f"{kv}.{i}" for kv in "kv" for i in range(3))  # no other state
    assert manifest["capacity"]["slots_per_row"] == 64 and "written to slot p" in manifest["capacity"]["rule"]
    assert "mesh" not in manifest and "spec" not in manifest["weights"]["tensors"][0]  # unsharded: no mesh
    for name in ("prefill_T16", "prefill_T32", "decode"):
        text = (out / f"{name}.mlir").read_text()
        assert "func.func public @main" in text and "stablehlo.dot_general" in text
        assert "custom_call" not in text  # never linnet's CPU kernels (ops.matvec): the loader has no linnet_jax
        assert (out / f"{name}.bin").stat().st_size < 100_000  # the weights (500 KB) are not inside
    assert (out / "weights.safetensors").stat().st_size > 500_000
    assert (out / "load.py").read_text() == LOADER.read_text()  # every export carries the one loader
    assert imported_modules(LOADER.read_text()) <= STANDALONE_IMPORTS | {"json"}

    new_ids, logits = stablehlo_run(out, TINY_PROMPT, TINY_NEW)
    assert check_run(model, TINY_PROMPT, new_ids, logits, TINY_NEW) < 1e-5
    record_parity("tiny llama_gqa_llama3 via export.stablehlo (standalone)",
                  transformers_distance(reference, TINY_PROMPT, new_ids, logits))


def test_stablehlo_batch_of_two_different_prompts(tiny_dir, tmp_path):
    """A batch-2 export: rows of different lengths left-padded in one prefill, then a decode step."""
    model = linnet_jax.load(tiny_dir("mistral_sliding")[1], progress=False)  # a 16-slot sliding window
    out = export.stablehlo(model, tmp_path / "hlo", batch=2, max_len=64, progress=False)
    exported = exported_loader(out).Export(out)
    prompts = [TINY_PROMPT, TINY_PROMPT[:7]]
    rows = [exported_loader(out).left_padded(prompt, 32, 1) for prompt in prompts]
    tokens, positions = (np.concatenate(arrays) for arrays in zip(*rows))
    logits, cache = exported.prefill[32](exported.weights, tokens, positions, exported.empty_cache())
    step = np.asarray([5, 9], np.int32)
    decoded, _ = exported.decode(exported.weights, step, np.asarray([len(p) for p in prompts], np.int32), cache)
    for row, prompt in enumerate(prompts):
        full = np.asarray(linnet_jax.logits(model, [prompt + [int(step[row])]]))[0]
        assert np.abs(np.asarray(logits[row]) - full[-2]).max() < 1e-5
        assert np.abs(np.asarray(decoded[row]) - full[-1]).max() < 1e-5
    # slot p holds position p: a position past the 64 slots is refused before the call, not dropped silently
    with pytest.raises(ValueError, match="the cache is full: its 64 slots per row hold positions 0 .. 63, got "
                                         "position 64"):
        exported.decode(exported.weights, step, np.asarray([63, 64], np.int32), exported.empty_cache())
    assert exported.start(TINY_PROMPT, 64 - len(TINY_PROMPT))[0].shape == (2, model.config.vocab_size)  # just fits
    for ids, new in ((TINY_PROMPT, 65 - len(TINY_PROMPT)), ([], 1), (list(range(33)), 1)):
        with pytest.raises(ValueError, match="do not fit the exported cache"):
            exported.start(ids, new)


def test_stablehlo_sharded_export_reloads_on_a_mesh(shardable_dir, tmp_path):
    """Loaded on mesh(data=2, tensor=4) in an 8-device child and exported; the artifacts carry their shardings
    and, in another 8-device child that cannot import linnet_jax, the export's load.py rebuilds the mesh from
    the manifest and gives the greedy ids of generate on the sharded and on the unsharded model."""
    out = tmp_path / "hlo"
    run_python(f"""
import json
import jax
import linnet_jax
from linnet_jax import export, sharding

assert jax.device_count() == 8
model = linnet_jax.load({str(shardable_dir)!r}, mesh=sharding.mesh(data=2, tensor=4), progress=False)
export.stablehlo(model, {str(out)!r}, batch=2, max_len=64, progress=False)
ids = linnet_jax.generate(model, tokens=[{TINY_PROMPT}] * 2, max_new_tokens={TINY_NEW}, ignore_eos=True)
open("sharded_ids.json", "w").write(json.dumps(ids))
""", tmp_path, eight_devices())

    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["mesh"] == {"axis_names": ["data", "fsdp", "tensor"], "axis_sizes": [2, 1, 4]}
    specs = {t["name"]: t["spec"] for t in manifest["weights"]["tensors"]}
    assert specs["layers.0.wq"] == [None, "tensor", None] and specs["final_norm"] == [None]  # per layer
    assert manifest["cache"]["k.1"]["spec"] == [["data", "fsdp", "tensor"], None, None]
    assert manifest["prefill"]["32"]["specs"] == {"tokens": [["data", "fsdp"], None],
                                                  "positions": [["data", "fsdp"], None],
                                                  "logits": [["data", "fsdp"], "tensor"]}
    assert manifest["decode"]["specs"]["tokens"] == [["data", "fsdp"]]
    for name in ("prefill_T16", "prefill_T32", "decode"):
        text = (out / f"{name}.mlir").read_text()
        # JAX 0.10 lowers through Shardy: the shardings are sdy.sharding attributes over an sdy.mesh
        assert 'sdy.mesh @mesh = <["data"=2, "fsdp"=1, "tensor"=4]>' in text and "mhlo.num_partitions = 8" in text
        t = "" if name == "decode" else f"x{name.removeprefix('prefill_T')}"  # decode's tokens are [B]
        batch_split = '{"data", "fsdp"}' + (", {}" if t else "")
        for argument, shape, dims in (("weights['layers.0.wq']", "64x8x8xf32", '{}, {"tensor"}, {}'),
                                      ("weights['final_norm']", "64xf32", "{}"),
                                      ("cache['v.1']", "8x8x64xf32", '{"data", "fsdp", "tensor"}, {}, {}'),
                                      ("tokens" if t else "token", f"2{t}xi32", batch_split)):
            pattern = (re.escape(f"tensor<{shape}> {{sdy.sharding = #sdy.sharding<@mesh, [{dims}]>") +
                       r"[^}]*\} " + re.escape(f'loc("{argument}")'))
            assert re.search(pattern, text), (name, argument)
        assert text.count("sdy.sharding_constraint") >= 3  # forward's: the embedding, each block (a scan), logits
        assert jax.export.deserialize((out / f"{name}.bin").read_bytes()).nr_devices == 8

    new_ids, logits = stablehlo_run(out, TINY_PROMPT, TINY_NEW, eight_devices())
    assert [new_ids] * 2 == json.loads((tmp_path / "sharded_ids.json").read_text())
    model = linnet_jax.load(shardable_dir, progress=False)  # unsharded, on this process's one device
    assert check_run(model, TINY_PROMPT, new_ids, logits, TINY_NEW) < 1e-5


def test_jax_source_tiny_runs_standalone(tiny_dir, tmp_path):
    reference, directory = tiny_dir("qwen3_qk_norm")  # q/k norms, head_dim 32 != hidden / heads
    model = linnet_jax.load(directory, progress=False)
    out = export.jax_source(model, tmp_path / "src")
    source = (out / "model.py").read_text()
    assert len(source.encode()) < 100_000  # code, no weight constants (the weights are 500 KB)
    compile(source, "model.py", "exec")
    imported = imported_modules(source)
    assert imported <= STANDALONE_IMPORTS, imported
    assert ast.get_docstring(ast.parse(source)).startswith(repr(model))

    new_ids, logits = jax_source_run(out, TINY_PROMPT, TINY_NEW)
    assert check_run(model, TINY_PROMPT, new_ids, logits, TINY_NEW) < 1e-5
    record_parity("tiny qwen3_qk_norm via export.jax_source (standalone)",
                  transformers_distance(reference, TINY_PROMPT, new_ids, logits))


def test_jax_source_generate_stops_and_takes_a_cache_size(tiny_dir, tmp_path):
    """model.py's generate decodes on the device: it ends before a stop id met mid-loop, gives the same ids
    with an exact cache size (max_len), and refuses a max_len that cannot hold the prompt and the new tokens."""
    model = linnet_jax.load(tiny_dir("qwen3_qk_norm")[1], progress=False)
    out = export.jax_source(model, tmp_path / "src")
    spec = importlib.util.spec_from_file_location("generated_tiny_model", out / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    params = module.load_weights()
    full = module.generate(params, TINY_PROMPT, TINY_NEW, stop_ids=())
    assert full == linnet_jax.generate(model, tokens=[TINY_PROMPT], max_new_tokens=TINY_NEW, ignore_eos=True)[0]
    exact = len(TINY_PROMPT) + TINY_NEW  # slot p holds position p: the prompt's padding takes no slot
    assert module.generate(params, TINY_PROMPT, TINY_NEW, stop_ids=(), max_len=exact) == full
    stop = full[3]
    assert module.generate(params, TINY_PROMPT, TINY_NEW, stop_ids=(stop,)) == full[:full.index(stop)]
    with pytest.raises(ValueError, match=f"max_len must be an int of at least {exact}"):
        module.generate(params, TINY_PROMPT, TINY_NEW, stop_ids=(), max_len=exact - 1)


def test_jax_source_refuses_a_module_missing_a_definition(tiny_dir, monkeypatch):
    """A decoder function the list does not name (a new helper, say) is an error naming it, not a broken file."""
    model = linnet_jax.load(tiny_dir("qwen3_qk_norm")[1], progress=False)
    sources = dict(_jax_source.MODEL_SOURCES)
    sources["linnet_jax.models.decoder"] = [n for n in sources["linnet_jax.models.decoder"] if n != "write_slots"]
    monkeypatch.setattr(_jax_source, "MODEL_SOURCES", sources)
    with pytest.raises(RuntimeError, match=r"uses \['write_slots'\] without defining"):
        _jax_source.module_source(model)
    source = "import math\nclass A:\n    x: B = math.pi\ndef f(y=C):\n    return [g(i) for i in y]\n"
    assert _jax_source.undefined_names(source) == {"B", "C", "g"}


@pytest.fixture(scope="module")
def smollm2_prompt(smollm2):
    return smollm2.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                                 tokenize=True)


@pytest.mark.parametrize("fmt", ["stablehlo", "jax_source"])
def test_smollm2_export_runs_standalone(smollm2, smollm2_prompt, tmp_path, fmt, request):
    if fmt == "stablehlo":
        out = export.stablehlo(smollm2, tmp_path / fmt, max_len=128, progress=False)
        weights = (out / "weights.safetensors").stat().st_size
        assert all(f.stat().st_size < weights / 1000 for f in out.glob("*.bin"))  # weights are arguments
        new_ids, logits = stablehlo_run(out, smollm2_prompt, SMOLLM2_NEW)
    else:
        out = export.jax_source(smollm2, tmp_path / fmt)
        new_ids, logits = jax_source_run(out, smollm2_prompt, SMOLLM2_NEW)
    # Measured: stablehlo 9.9e-5 (cached prefill and decode against one full forward: float32 sums in
    # another order through 30 layers, logits of magnitude ~20), jax_source 0 (its forward is the same program).
    assert check_run(smollm2, smollm2_prompt, new_ids, logits, SMOLLM2_NEW) < 5e-4
    assert "Paris" in smollm2.tokenizer.decode(new_ids)
    if transformers is not None:  # the parity table's row; Python >= 3.12 runs the test without transformers
        record_parity(f"SmolLM2 via export.{fmt} (standalone, {len(smollm2_prompt)}-token chat + {SMOLLM2_NEW})",
                      transformers_distance(request.getfixturevalue("smollm2_reference"), smollm2_prompt, new_ids,
                                            logits))


def test_exports_refuse_bad_arguments(tiny_dir, tmp_path):
    model = linnet_jax.load(tiny_dir("llama_gqa_llama3")[1], progress=False)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("x")
    for exporter in (export.stablehlo, export.jax_source):
        with pytest.raises(FileExistsError, match="taken"):
            exporter(model, tmp_path / "taken")
    with pytest.raises(ValueError, match=r"max_len must be an int in \(16, 4096\]"):
        export.stablehlo(model, tmp_path / "a", max_len=16)
    with pytest.raises(ValueError, match="batch must be a positive int"):
        export.stablehlo(model, tmp_path / "b", batch=0)


@pytest.mark.parametrize("fmt, dtype, written", [
    ("stablehlo", None, "manifest.json"), ("jax-source", "bfloat16", "model.py"), ("hf", None, "config.json"),
    ("gguf", "q8_0", None), ("torch-source", "bfloat16", "model.py"), ("onnx", "float16", "decode.onnx")])
def test_cli_export_dispatches_each_format(tiny_dir, tmp_path, fmt, dtype, written):
    directory = tiny_dir("llama_linear_untied")[1]  # GGUF has no llama3 rope scaling
    out = tmp_path / ("m.gguf" if fmt == "gguf" else "out")
    argv = ["export", "--format", fmt, "--model", str(directory), "--no-compilation-cache", str(out)]
    assert cli.main(argv + (["--dtype", dtype] if dtype else [])) == 0
    if written:
        assert (out / written).exists()
    if fmt in ("jax-source", "torch-source"):
        assert "dtype = 'bfloat16'" in (out / "model.py").read_text()
    if fmt == "onnx":
        assert json.loads((out / "manifest.json").read_text())["dtype"] == "float16"
    if fmt == "gguf":
        import gguf

        assert {t.tensor_type.name for t in gguf.GGUFReader(out).tensors} == {"F32", "Q8_0"}
    with pytest.raises(SystemExit, match="already exists"):
        cli.main(argv)
    assert cli.main(argv + ["--overwrite"]) == 0


@pytest.mark.parametrize("flags, words", [
    (["--format", "stablehlo", "--dtype", "q8_0"], "--dtype q8_0"),
    (["--format", "jax-source", "--max-len", "64"], "--max-len is for --format onnx, stablehlo, torch-source, not "
                                                    "jax-source"),
    (["--format", "stablehlo", "--max-len", "0"], "--max-len: must be a positive int, got 0")])
def test_cli_export_refuses_flags_before_loading(tmp_path, capsys, flags, words):
    with pytest.raises(SystemExit) as exit:
        cli.main(["export", "--model", "/nowhere", *flags, str(tmp_path / "out")])
    assert exit.value.code == 2 and words in capsys.readouterr().err


def exported_max_len(out: Path) -> int:
    """The cache positions an export is built for: its manifest's max_len (stablehlo, onnx) or model.py's MAX_LEN."""
    if (out / "manifest.json").exists():
        return json.loads((out / "manifest.json").read_text())["max_len"]
    return int(re.search(r"^MAX_LEN = (\d+)", (out / "model.py").read_text(), re.MULTILINE).group(1))


@pytest.mark.parametrize("fmt", ["stablehlo", "torch-source", "onnx"])
def test_cli_export_fits_a_context_under_1024(tiny_dir, tmp_path, fmt):
    """A model of 256 positions exports with --max-len's default (its context: the exporters' 1024 does not fit)
    and with --max-len 64."""
    short = tmp_path / "short"
    shutil.copytree(tiny_dir("llama_linear_untied")[1], short)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 256}))
    for flags, max_len in (([], 256), (["--max-len", "64"], 64)):
        out = tmp_path / f"out{max_len}"
        assert cli.main(["export", "--format", fmt, "--model", str(short), "--no-compilation-cache", *flags,
                         str(out)]) == 0
        assert exported_max_len(out) == max_len


def test_cli_export_of_the_default_model(tmp_path):
    result = subprocess.run([sys.executable, "-m", "linnet_jax", "export", "--format", "jax-source",
                             "--no-compilation-cache", str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(tmp_path / "out")
    source = (tmp_path / "out" / "model.py").read_text()
    assert "num_layers = 30" in source and "vocab_size = 49152" in source
    assert (tmp_path / "out" / "weights.safetensors").stat().st_size > 500_000_000
    assert (tmp_path / "out" / "tokenizer.json").exists()
