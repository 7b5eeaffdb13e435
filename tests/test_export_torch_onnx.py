"""The exports that leave JAX: export.torch_source's generated PyTorch model.py (eager and torch.compile) and
export.onnx's graphs with their runner.py (ONNX Runtime), each run in a fresh process that cannot import
linnet_jax nor jax (nor, for ONNX, torch). Greedy ids must equal linnet_jax.generate's; the logits of the
cached steps are held to transformers eager float32 (the parity table's rows)."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch._inductor.utils import run_and_get_code
from conftest import TINY_CONFIGS, record_parity, reference_logits
from standalone import BLOCKED, imported_modules, run_python

import linnet_jax
from linnet_jax import export
from linnet_jax.export import _torch_source

TINY_PROMPT = [int(i) for i in np.random.default_rng(0).integers(3, 256, 20)]
NEW = 24
TINY_MAX_LEN = 64
NO_JAX = (*BLOCKED, "jax", "jaxlib")
F32_BOUND = 1e-4
# ONNX float16 weights and cache against transformers float32: measured 0.061 on SmolLM2 (30 layers, logits of
# magnitude ~20; 37-token chat + 24) and 0.003-0.008 on the tiny families (3 layers).
F16_BOUND = 0.1

TORCH_RUN = """
module = load(out / "model.py")
params = module.load_weights()
new = module.generate(params, ids, max_new_tokens=new_tokens, stop_ids=())
keys, values = params.init_cache()
with torch.inference_mode():
    rows = [params(torch.tensor([ids]), torch.arange(len(ids))[None], keys, values)]
    for i, token in enumerate(new[:-1]):
        rows.append(params(torch.tensor([[token]]), torch.tensor([[len(ids) + i]]), keys, values))
logits = torch.cat(rows).numpy()
"""
ONNX_RUN = """
runner = load(out / "runner.py")
params = runner.load_weights(threads=2)
new = runner.generate(params, ids, max_new_tokens=new_tokens, stop_ids=())
logits, cache = runner.step(params.prefill, np.asarray([ids]), np.arange(len(ids))[None],
                            runner.empty_cache(params.manifest))
rows = [logits]
for i, token in enumerate(new[:-1]):
    logits, cache = runner.step(params.decode, np.asarray([[token]]), np.asarray([[len(ids) + i]]), cache)
    rows.append(logits)
logits = np.concatenate(rows)
"""
# Runs RUN for each export in `cases` ([out dir, prompt ids, new tokens]), leaving ids.json and logits.npy in each.
STANDALONE = """
import importlib.util
import json
from pathlib import Path
import numpy as np
{imports}

def load(path):
    spec = importlib.util.spec_from_file_location(f"export_{{abs(hash(str(path)))}}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

for out, ids, new_tokens in {cases!r}:
    out = Path(out)
{run}
    (out / "ids.json").write_text(json.dumps(new))
    np.save(out / "logits.npy", logits)
"""


def standalone_runs(kind: str, cases: list[tuple[Path, list[int]]], tmp_path: Path) -> list[tuple[list[int], np.ndarray]]:
    """Each export of `cases` (out dir, prompt) run for NEW greedy tokens in one fresh process that cannot import
    linnet_jax, jax (nor, for ONNX, torch): [(new ids, logits [NEW, V] of the steps that chose them)]."""
    run, imports, blocked = {"torch": (TORCH_RUN, "import torch\ntorch.set_num_threads(2)", NO_JAX),
                             "onnx": (ONNX_RUN, "", (*NO_JAX, "torch"))}[kind]
    script = STANDALONE.format(imports=imports, cases=[(str(out), ids, NEW) for out, ids in cases],
                               run="\n".join(f"    {line}" for line in run.strip().splitlines()))
    run_python("import sys\n" + "".join(f"sys.modules[{n!r}] = None\n" for n in blocked) + script, tmp_path)
    return [(json.loads((out / "ids.json").read_text()), np.load(out / "logits.npy")) for out, _ in cases]


def checked(model, reference, ids: list[int], new_ids: list[int], logits: np.ndarray) -> float:
    """Assert new_ids are linnet_jax.generate's greedy ids; return max |logit difference| from transformers eager."""
    assert new_ids == linnet_jax.generate(model, tokens=[ids], max_new_tokens=NEW, ignore_eos=True)[0]
    expected = reference_logits(reference, np.asarray([ids + new_ids[:-1]]))[0, len(ids) - 1:]
    assert logits.shape == expected.shape == (NEW, model.config.vocab_size)
    return float(np.abs(logits - expected).max())


def load_module(path: Path):
    spec = importlib.util.spec_from_file_location(f"generated_{abs(hash(str(path)))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_models(tiny_dir):
    """Every tiny family: name -> (transformers reference, linnet_jax Model)."""
    return {name: (tiny_dir(name)[0], linnet_jax.load(tiny_dir(name)[1], progress=False)) for name in TINY_CONFIGS}


@pytest.fixture(scope="module")
def smollm2_prompt(smollm2):
    return smollm2.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                                 tokenize=True)


@pytest.mark.parametrize("kind", ["torch", "onnx"])
def test_tiny_families_run_standalone(tiny_models, tmp_path, kind):
    """Llama (MHA, GQA with llama3 rope, linear rope with an untied head, attention biases), Mistral's sliding
    window, Qwen2's biases with tied embeddings, Qwen3's q/k norms: exported, and run without linnet_jax or jax."""
    outs = {}
    for name, (_, model) in tiny_models.items():
        if kind == "torch":
            outs[name] = export.torch_source(model, tmp_path / name, max_len=TINY_MAX_LEN)
        else:
            outs[name] = export.onnx(model, tmp_path / name, max_len=TINY_MAX_LEN)
    runs = standalone_runs(kind, [(out, TINY_PROMPT) for out in outs.values()], tmp_path)
    for (name, (reference, model)), (new_ids, logits) in zip(tiny_models.items(), runs):
        diff = checked(model, reference, TINY_PROMPT, new_ids, logits)
        record_parity(f"tiny {name} via export.{'torch_source' if kind == 'torch' else 'onnx float32'} (standalone)",
                      diff)
        assert diff <= F32_BOUND, (name, diff)


def test_smollm2_exports_run_standalone(smollm2, smollm2_reference, smollm2_prompt, tmp_path):
    """SmolLM2: the generated PyTorch (float32) and ONNX Runtime float32 and float16, 24 greedy tokens each."""
    max_len = 128
    torch_out = export.torch_source(smollm2, tmp_path / "torch", max_len=max_len)
    source = (torch_out / "model.py").read_text()
    assert imported_modules(source) <= {"dataclasses", "math", "pathlib", "numpy", "torch", "safetensors"}
    assert "num_layers = 30" in source and "MAX_LEN = 128" in source and len(source.encode()) < 30_000
    (torch_ids, torch_logits), = standalone_runs("torch", [(torch_out, smollm2_prompt)], tmp_path)
    diff = checked(smollm2, smollm2_reference, smollm2_prompt, torch_ids, torch_logits)
    record_parity(f"SmolLM2 via export.torch_source (standalone, {len(smollm2_prompt)}-token chat + {NEW})", diff)
    assert diff <= F32_BOUND and "Paris" in smollm2.tokenizer.decode(torch_ids)

    outs = {dtype: export.onnx(smollm2, tmp_path / dtype, dtype=dtype, max_len=max_len)
            for dtype in ("float32", "float16")}
    runner = (outs["float32"] / "runner.py").read_text()
    assert imported_modules(runner) <= {"json", "pathlib", "typing", "numpy", "onnxruntime", "tokenizers"}
    weights = (outs["float32"] / "weights.data").stat().st_size
    assert 3.99 * smollm2.config.num_params() < weights < 4.01 * smollm2.config.num_params()  # once, not per graph
    assert all((out / graph).stat().st_size < 1_000_000 for out in outs.values()
               for graph in ("prefill.onnx", "decode.onnx"))
    runs = dict(zip(outs, standalone_runs("onnx", [(out, smollm2_prompt) for out in outs.values()], tmp_path)))
    f32_ids, f32_logits = runs["float32"]
    diff = checked(smollm2, smollm2_reference, smollm2_prompt, f32_ids, f32_logits)
    record_parity(f"SmolLM2 via export.onnx float32 (ONNX Runtime, {len(smollm2_prompt)}-token chat + {NEW})", diff)
    assert diff <= F32_BOUND
    f16_ids, f16_logits = runs["float16"]
    expected = reference_logits(smollm2_reference, np.asarray([smollm2_prompt + f16_ids[:-1]]))[0, len(smollm2_prompt) - 1:]
    diff = float(np.abs(f16_logits - expected).max())
    record_parity(f"SmolLM2 via export.onnx float16 (ONNX Runtime, {len(smollm2_prompt)}-token chat + {NEW})", diff)
    assert diff <= F16_BOUND and "Paris" in smollm2.tokenizer.decode(f16_ids)


def test_torch_compile_gives_the_same_tokens_without_graph_breaks(tiny_models, tmp_path):
    """torch.compile (inductor) of load_weights() runs through the same generate to the same ids; a decode step
    is one graph (torch._dynamo.explain: no break), so CUDA graphs can take it, and it writes the cache in place
    (no buffer of a cache tensor's shape in inductor's code: a scatter_ there made it copy every layer's cache).
    Its products are 4 a layer (q, k and v as one, o, gate and up as one, down) and the head's."""
    model = tiny_models["mistral_sliding"][1]
    module = load_module(export.torch_source(model, tmp_path / "src", max_len=TINY_MAX_LEN) / "model.py")
    params = module.load_weights()
    eager = module.generate(params, TINY_PROMPT, max_new_tokens=NEW, stop_ids=())
    assert eager == linnet_jax.generate(model, tokens=[TINY_PROMPT], max_new_tokens=NEW, ignore_eos=True)[0]
    keys, values = params.init_cache()
    explained = torch._dynamo.explain(params)(torch.tensor([[5]]), torch.tensor([[3]]), keys, values)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    torch._dynamo.reset()
    with torch.inference_mode():
        _, code = run_and_get_code(torch.compile(params), torch.tensor([[5]]), torch.tensor([[3]]), keys, values)
    code = "\n".join(code)
    assert not [t.shape for t in (keys[0], values[0]) if f"empty_strided_cpu({tuple(t.shape)}" in code]
    assert code.count("extern_kernels.mm(") == 4 * model.config.num_layers + 1  # no biases here (those: addmm)
    torch._dynamo.reset()
    compiled = torch.compile(params)
    assert module.generate(compiled, TINY_PROMPT, max_new_tokens=NEW, stop_ids=()) == eager
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert module.generate(compiled, TINY_PROMPT, max_new_tokens=NEW, stop_ids=()) == eager  # a new cache, ...
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # ... no new graph (no recompile)


def test_torch_source_samples_stops_and_refuses(tiny_models, tmp_path, monkeypatch):
    model = tiny_models["qwen2_bias_tied"][1]
    module = load_module(export.torch_source(model, tmp_path / "src", max_len=TINY_MAX_LEN) / "model.py")
    params = module.load_weights()
    greedy = module.generate(params, TINY_PROMPT, max_new_tokens=NEW, stop_ids=())
    assert module.generate(params, TINY_PROMPT, NEW, (), temperature=0.8, top_k=1, seed=1) == greedy
    drawn = [module.generate(params, TINY_PROMPT, NEW, (), temperature=1.5, top_p=0.95, seed=s) for s in (0, 0, 1)]
    assert drawn[0] == drawn[1] != drawn[2] and drawn[0] != greedy  # seeded: reproducible; a draw, not the argmax
    assert module.generate(params, TINY_PROMPT, NEW, stop_ids=(greedy[5],)) == greedy[:greedy.index(greedy[5])]
    with pytest.raises(ValueError, match="does not fit the cache of 64 positions"):
        module.generate(params, TINY_PROMPT, TINY_MAX_LEN - len(TINY_PROMPT) + 1)
    assert (tmp_path / "src" / "README.md").read_text().count("model.generate(") == 1

    with pytest.raises(ValueError, match=r"max_len must be an int in \[1, 4096\]"):
        export.torch_source(model, tmp_path / "a", max_len=0)
    fields = dict(_torch_source.READ_FIELDS)
    del fields["qk_norm"]
    monkeypatch.setattr(_torch_source, "READ_FIELDS", fields)
    with pytest.raises(NotImplementedError, match=r"cannot express the config field\(s\) \['qk_norm'\]"):
        export.torch_source(model, tmp_path / "c")
    assert not (tmp_path / "a").exists() and not (tmp_path / "c").exists()
