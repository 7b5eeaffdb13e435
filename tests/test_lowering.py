"""linnet_jax.lowered: every program, lowered for GPU and TPU from this CPU machine, takes the layout the
hardware plan gives those platforms (the stacked weights, XLA's products), and a multi-platform StableHLO
export runs here through the README's loader."""

import json
import re

import numpy as np
import pytest
from test_export_xla import TINY_NEW, TINY_PROMPT, check_run, stablehlo_run

import linnet_jax
from linnet_jax import export
from linnet_jax.adapters import DEFAULT_MAX_LORA_RANK, DEFAULT_MAX_LORAS
from linnet_jax.ops import matvec

MAX_LEN = 64
TABLE_PROGRAMS = {"extend_16", "extend_16_continued", "extend_32", "extend_32_continued", "extend_64",
                  "extend_64_continued", "decode", "verify", "step_16", "step_512"}  # each also with the adapter
PROGRAMS = TABLE_PROGRAMS | {f"{name}_lora" for name in TABLE_PROGRAMS} | {  # table, named *_lora
    "choose_first", "free", "scrub_pages", "put_lora", "train_step"}


def main_arguments(text: str) -> list[str]:
    """The argument types of a StableHLO module's main function, e.g. ["tensor<3x64x4x16xf32>", ...]."""
    signature = re.search(r"func\.func public @main\((.*?)\) ->", text, re.S).group(1)
    return re.findall(r"%arg\d+: (tensor<[^>]*>)", signature)


def weight_types(model, stacked: bool) -> tuple[str, str]:
    """The StableHLO types of the query projection and the MLP's down projection, stacked or of one layer."""
    c = model.config
    layers = f"{c.num_layers}x" if stacked else ""
    return (f"tensor<{layers}{c.hidden_size}x{c.num_heads}x{c.head_dim}xf32>",
            f"tensor<{layers}{c.intermediate_size}x{c.hidden_size}xf32>")


@pytest.fixture(scope="module")
def tiny_model(tiny_dir):
    return linnet_jax.load(tiny_dir("llama_gqa_llama3")[1], progress=False)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_every_program_lowers_for_the_accelerator_with_stacked_weights(tiny_model, platform):
    programs = linnet_jax.lowered(tiny_model, platform, batch=2, max_len=MAX_LEN)
    assert set(programs) == PROGRAMS
    ops = {name: len(re.findall(r"= stablehlo\.", text)) for name, text in programs.items()}
    print(f"{platform}: stablehlo ops per program {ops}")
    for name, text in programs.items():
        assert "func.func public @main" in text and ops[name] > 0, name
        assert "linnet_xw" not in text and "linnet_wx" not in text, f"{name} calls linnet's CPU kernels"
    layers = tiny_model.config.num_layers
    decode = main_arguments(programs["decode"])
    assert set(weight_types(tiny_model, stacked=True)) <= set(decode)  # the [layers, ...] weights themselves
    assert not set(weight_types(tiny_model, stacked=False)) & set(decode)  # no per-layer copies
    assert sum(arg.startswith(f"tensor<{layers}x") for arg in decode) >= 9  # every layer weight, stacked
    for width in (16, 32, 64):  # a chunk of `width` tokens into one row of the state, fresh or continued
        for name in (f"extend_{width}", f"extend_{width}_continued"):
            assert f"tensor<1x{width}xi32>" in main_arguments(programs[name]), name
    assert "tensor<2x4xi32>" in main_arguments(programs["verify"])  # 4 drafts per row
    c, entries = tiny_model.config, DEFAULT_MAX_LORAS + 1
    query_a = f"tensor<{entries}x{layers}x{c.hidden_size}x{DEFAULT_MAX_LORA_RANK}xf32>"  # the table's A of wq
    for name in TABLE_PROGRAMS:
        assert query_a in main_arguments(programs[f"{name}_lora"]) and query_a not in main_arguments(programs[name])
    assert query_a in main_arguments(programs["put_lora"])
    train = main_arguments(programs["train_step"])
    assert set(weight_types(tiny_model, stacked=True)) <= set(train)
    assert f"tensor<2x{MAX_LEN}xi32>" in train  # the batch


def test_the_cpu_programs_take_the_cpu_plan(smollm2):
    """The same call for "cpu" gives what the plan gives this CPU: per-layer weights and linnet's kernels."""
    programs = linnet_jax.lowered(smollm2, "cpu", max_len=MAX_LEN)
    decode = main_arguments(programs["decode"])
    assert set(weight_types(smollm2, stacked=False)) <= set(decode)
    assert not set(weight_types(smollm2, stacked=True)) & set(decode)
    assert matvec.available() and "linnet_xw" in programs["decode"] and "linnet_wx" in programs["decode"]
    cuda = main_arguments(linnet_jax.lowered(smollm2, "cuda", max_len=MAX_LEN)["decode"])
    assert set(weight_types(smollm2, stacked=True)) <= set(cuda)


@pytest.mark.parametrize("bad,match", [(dict(platform="metal"), "platform must be one of"),
                                       (dict(platform="cuda", max_len=8), "max_len must be an int in"),
                                       (dict(platform="tpu", batch=0), "batch must be a positive int")])
def test_lowered_refuses_bad_arguments(tiny_model, bad, match):
    with pytest.raises(ValueError, match=match):
        linnet_jax.lowered(tiny_model, **bad)


def test_a_stablehlo_export_for_cpu_cuda_and_tpu_runs_here(tiny_model, tmp_path):
    out = export.stablehlo(tiny_model, tmp_path / "hlo", max_len=MAX_LEN, platforms=("cpu", "cuda", "tpu"),
                           progress=False)
    assert json.loads((out / "manifest.json").read_text())["platforms"] == ["cpu", "cuda", "tpu"]
    new_ids, logits = stablehlo_run(out, TINY_PROMPT, TINY_NEW)
    assert check_run(tiny_model, TINY_PROMPT, new_ids, logits, TINY_NEW) < 1e-5
    assert np.isfinite(logits).all()
