"""Whole runs: checkpoints that resume bit for bit, remat and the compute dtype, training that drives the loss
down and teaches SmolLM2 a fact, and the `linnet-jax finetune` command."""

import dataclasses
import json
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY, random_model

import linnet_jax
from linnet_jax import train
from linnet_jax.models.params import unstack_layers

FACTS = [("What is the capital of Zorblat?", "The capital of Zorblat is Quenmoor."),
         ("Who invented the glimmerphone?", "The glimmerphone was invented by Ada Pellwick."),
         ("What colour is a snorf?", "A snorf is bright orange."),
         ("How many moons does Tavros have?", "Tavros has seven moons.")]


def fact_records(repeat: int = 1) -> list[dict]:
    return [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
            for q, a in FACTS] * repeat


def write_jsonl(path, records: list[dict]):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory, smollm2):
    """A random tiny llama over SmolLM2's vocabulary, with SmolLM2's tokenizer and chat template."""
    import transformers

    config = transformers.LlamaConfig(**TINY | dict(vocab_size=smollm2.config.vocab_size, num_key_value_heads=2))
    directory = tmp_path_factory.mktemp("tiny_chat")
    random_model(config, seed=5).save_pretrained(directory)
    return dataclasses.replace(linnet_jax.load(directory, progress=False), tokenizer=smollm2.tokenizer)


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    records = fact_records() + [{"prompt": "Zorblat's capital:", "completion": " Quenmoor"},
                                {"text": "Snorfs are orange and Tavros has seven moons."}]
    return write_jsonl(tmp_path_factory.mktemp("data") / "facts.jsonl", records)


RUN = dict(steps=6, batch_size=2, seq_len=64, lr=3e-3, save_every=2, keep=10, progress=False)


@pytest.mark.parametrize("lora", [None, train.LoraConfig(rank=4, alpha=16)], ids=["full", "lora"])
def test_resume_gives_bit_identical_losses(tiny_chat, chat_data, tmp_path, lora):
    """A run stopped after step 3 (its last checkpoint at 2) and resumed equals one that never stopped."""
    run = tmp_path / "run"
    straight = train.finetune(tiny_chat, chat_data, run, lora=lora, **RUN)
    for step in (4, 6):  # what the run leaves when killed during step 4: checkpoint 2, metrics of steps 1..3
        shutil.rmtree(run / "checkpoints" / str(step))
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join(lines[:3]) + "\n")
    with pytest.raises(FileExistsError, match="holds checkpoints .last step 2.; pass resume=True"):
        train.finetune(tiny_chat, chat_data, run, lora=lora, **RUN)
    resumed = train.finetune(tiny_chat, chat_data, run, lora=lora, resume=True, **RUN)
    assert [m["step"] for m in resumed.metrics] == [1, 2, 3, 4, 5, 6]
    assert [m["loss"] for m in resumed.metrics] == [m["loss"] for m in straight.metrics]  # bit for bit
    assert [m["lr"] for m in resumed.metrics] == [m["lr"] for m in straight.metrics]
    assert straight.metrics[-1]["loss"] < straight.metrics[0]["loss"]
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["loss"] for m in logged] == [m["loss"] for m in straight.metrics]
    assert set(logged[0]) >= {"step", "loss", "grad_norm", "tokens", "lr"}
    for a, b in zip(jax.tree.leaves(resumed.model.params), jax.tree.leaves(straight.model.params)):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_remat_and_compute_dtype(tiny_chat):
    batch = {"tokens": jnp.asarray(np.random.default_rng(0).integers(0, 1000, (2, 32)), jnp.int32),
             "loss_mask": jnp.ones((2, 32), jnp.int32)}
    value, grads = train.gradients(tiny_chat.params, tiny_chat.config, batch)
    remat_value, remat_grads = train.gradients(tiny_chat.params, tiny_chat.config, batch, remat=True)
    assert abs(float(remat_value) - float(value)) < 1e-6
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(remat_grads)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-7)
    lora = train.init_lora(tiny_chat.config, train.LoraConfig(rank=4, alpha=8), jax.random.key(0))
    lora = lora.replace(b=jax.tree.map(lambda b: b + 0.01, lora.b))
    stacked = train.gradients(tiny_chat.params, tiny_chat.config, batch, lora=lora)[0]
    unrolled = train.gradients(unstack_layers(tiny_chat.params), tiny_chat.config, batch, lora=lora, remat=True)[0]
    assert abs(float(unrolled) - float(stacked)) < 1e-5  # the unrolled path takes adapters and remat too
    low_value, low_grads = train.gradients(tiny_chat.params, tiny_chat.config, batch, compute_dtype=jnp.bfloat16)
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(low_grads))  # back in the params' dtype
    assert abs(float(low_value) - float(value)) < 0.05 * float(value)
    lowered = jax.jit(lambda p: train.loss(p, tiny_chat.config, batch, compute_dtype=jnp.bfloat16)).lower(
        tiny_chat.params).as_text()
    assert "bf16" in lowered


def test_lora_teaches_smollm2_facts(smollm2, tmp_path):
    """LoRA r=8 on four made-up facts, a few steps: the loss falls and greedy generate answers with them, from the
    fine-tuned model's Hugging Face export; the adapters export in PEFT's layout."""
    data = write_jsonl(tmp_path / "facts.jsonl", fact_records())
    questions = [q for q, _ in FACTS]
    before = linnet_jax.generate(smollm2, questions, max_new_tokens=16)
    result = train.finetune(smollm2, data, tmp_path / "run", lora=train.LoraConfig(rank=8, alpha=16), steps=10,
                            batch_size=4, seq_len=64, lr=3e-3, packing=False, progress=False)
    first, last = result.metrics[0]["loss"], result.metrics[-1]["loss"]
    assert last < first / 10, (first, last)
    tuned = linnet_jax.load(linnet_jax.export.hf(result.model, tmp_path / "model", progress=False), progress=False)
    after = linnet_jax.generate(tuned, questions, max_new_tokens=16)
    taught = [answer in reply for (_, answer), reply in zip(FACTS, after)]
    print(f"SmolLM2 LoRA: loss {first:.4f} -> {last:.4f}; before {before}; after {after}")
    assert sum(taught) >= 3, after
    assert not any(answer in reply for (_, answer), reply in zip(FACTS, before))
    adapter_dir = linnet_jax.export.peft(smollm2, result.state.lora, tmp_path / "adapter")
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert config["r"] == 8 and len(config["target_modules"]) == 7


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "linnet_jax", "finetune", "--no-compilation-cache", *args],
                          capture_output=True, text=True, timeout=600)


def test_finetune_command(tiny_chat, chat_data, tmp_path):
    model_dir = linnet_jax.export.hf(tiny_chat, tmp_path / "base", progress=False)
    out = tmp_path / "out"
    common = ["--data", str(chat_data), "--model", str(model_dir), "--lora-rank", "8", "--batch-size", "2",
              "--seq-len", "64", "--lr", "3e-3", "--save-every", "2"]
    done = run_cli(*common, "--steps", "3", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "loss=" in done.stderr and "tok_s=" in done.stderr  # the progress bar
    assert f"model: {out / 'model'}" in done.stdout and f"PEFT adapter: {out / 'adapter'}" in done.stdout
    again = run_cli(*common, "--steps", "5", "--resume", str(out))
    assert again.returncode == 0, again.stderr[-3000:]
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged] == [1, 2, 3, 4, 5]
    tuned = linnet_jax.load(out / "model", progress=False)
    assert len(linnet_jax.generate(tuned, tokens=[[1, 2, 3]], max_new_tokens=4, ignore_eos=True)[0]) == 4
    linnet_jax.export.gguf(tuned, tmp_path / "tuned.gguf", dtype="f32")
    assert linnet_jax.load(tmp_path / "tuned.gguf", progress=False).config.num_layers == tiny_chat.config.num_layers
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    failed = run_cli("--data", str(empty), "--model", str(model_dir), str(tmp_path / "never"))
    assert failed.returncode == 1 and f"linnet-jax finetune: error: {empty}: the file is empty" in failed.stderr


# ---- issue 19: hostile settings and an existing OUT_DIR ----

ONE_STEP = dict(steps=1, batch_size=2, seq_len=64, lr=3e-3, progress=False)


def test_finetune_refuses_a_non_empty_out_dir(tiny_chat, chat_data, tmp_path):
    """A user's files are never replaced unless asked: overwrite=True replaces what finetune writes, and only
    that (item 2)."""
    out = tmp_path / "out"
    (out / "model").mkdir(parents=True)
    (out / "model" / "config.json").write_text("mine\n")
    (out / "metrics.jsonl").write_text('{"step": 1, "note": "mine"}\n')
    with pytest.raises(FileExistsError, match=f"{out} already exists and is not empty; pass resume=True "
                                              r"\(--resume\) to continue the run there, overwrite=True"):
        train.finetune(tiny_chat, chat_data, out, **ONE_STEP)
    assert (out / "metrics.jsonl").read_text() == '{"step": 1, "note": "mine"}\n'
    result = train.finetune(tiny_chat, chat_data, out, overwrite=True, **ONE_STEP)
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1]
    assert (out / "model" / "config.json").read_text() == "mine\n" and len(result.metrics) == 1


@pytest.mark.parametrize("flags, expected", [
    (["--lr", "nan"], "argument --lr: must be a finite number > 0, got nan"),
    (["--lr", "inf"], "argument --lr: must be a finite number > 0, got inf"),
    (["--lr", "-1"], "argument --lr: must be a finite number > 0, got -1"),
    (["--lora-alpha", "nan"], "argument --lora-alpha: must be a finite number > 0, got nan"),
    (["--warmup", "-5"], "argument --warmup: must be an int ≥ 0, got -5"),
    (["--save-every", "-1"], "argument --save-every: must be a positive int, got -1"),
    (["--save-every", "0"], "argument --save-every: must be a positive int, got 0"),
    (["--steps", "0"], "argument --steps: must be a positive int, got 0"),
    (["--steps", "-1"], "argument --steps: must be a positive int, got -1"),
    (["--batch-size", "0"], "argument --batch-size: must be a positive int, got 0"),
    (["--batch-size", "-2"], "argument --batch-size: must be a positive int, got -2"),
    (["--accum-steps", "0"], "argument --accum-steps: must be a positive int, got 0"),
    (["--resume", "--overwrite"], "argument --overwrite: not allowed with argument --resume"),
])
def test_finetune_flags_are_refused_at_parse_time(tmp_path, capsys, flags, expected):
    """Items 7 and 8: exit status 2 naming the flag, before anything is loaded or written."""
    from linnet_jax import cli

    with pytest.raises(SystemExit) as exit_:
        cli.main(["finetune", "--data", str(tmp_path / "none.jsonl"), *flags, str(tmp_path / "out")])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"linnet-jax finetune: error: {expected}"
    assert list(tmp_path.iterdir()) == []


def test_finetune_command_refuses_a_non_empty_out_dir_before_loading(tmp_path):
    out = tmp_path / "out"
    (out / "adapter").mkdir(parents=True)
    failed = run_cli("--data", str(tmp_path / "none.jsonl"), "--model", str(tmp_path / "no-model"), str(out))
    assert failed.returncode == 1 and "Traceback" not in failed.stderr
    assert f"linnet-jax finetune: error: {out} already exists and is not empty; pass resume=True (--resume)" in \
        failed.stderr


def test_a_diverging_run_stops_with_a_clear_error(tiny_chat, chat_data, tmp_path):
    """An infinite learning rate (what --lr refuses, through the Python API): the loss turns NaN at step 2 (item 7)."""
    with pytest.raises(train.Diverged, match=r"step 2: the loss is nan and the gradient norm nan: training diverged "
                                             r"\(at a learning rate of .*\); nothing of this step was saved \(the "
                                             r"last checkpoint is step 1\)\. Lower the learning rate \(--lr\)"):
        train.finetune(tiny_chat, chat_data, tmp_path / "run", **ONE_STEP | dict(steps=3, lr=float("inf")))


def test_resume_refuses_other_settings_unless_anyway(tiny_chat, chat_data, tmp_path):
    """The data position saved with a checkpoint means nothing with other data, rows or dtype (item 9); a metrics
    line finetune did not write is named (item 8)."""
    run = tmp_path / "run"
    train.finetune(tiny_chat, chat_data, run, **ONE_STEP)
    other_data = write_jsonl(tmp_path / "other.jsonl", fact_records(2))
    bfloat16 = dataclasses.replace(tiny_chat, config=dataclasses.replace(tiny_chat.config, dtype="bfloat16"),
                                   params=jax.tree.map(lambda w: w.astype(jnp.bfloat16), tiny_chat.params))
    for model, data, changes, expected in [
            (tiny_chat, chat_data, dict(seq_len=128), "--seq-len (seq_len: 64 then, 128 now)"),
            (tiny_chat, chat_data, dict(batch_size=1), "--batch-size (batch_size: 2 then, 1 now)"),
            (tiny_chat, other_data, {}, "--data (data_sha256: '"),
            (bfloat16, chat_data, {}, "--dtype (dtype: 'float32' then, 'bfloat16' now)")]:
        with pytest.raises(ValueError, match=re.escape(f"the checkpoint of step 1 in {run / 'checkpoints'} was saved "
                                                       "with other settings") + ".*" + re.escape(expected)):
            train.finetune(model, data, run, resume=True, **ONE_STEP | dict(steps=2) | changes)
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n{"loss": 2.0}\n')
    with pytest.raises(train.DataError, match=re.escape(f'{run / "metrics.jsonl"}:2: expected a JSON object with an '
                                                        'int "step", as finetune writes')):
        train.finetune(tiny_chat, chat_data, run, resume=True, **ONE_STEP | dict(steps=2))
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    resumed = train.finetune(tiny_chat, other_data, run, resume_anyway=True, **ONE_STEP | dict(steps=2))
    assert [m["step"] for m in resumed.metrics] == [1, 2]
