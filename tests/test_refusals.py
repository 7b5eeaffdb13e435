"""Issue 11, "refuse what cannot be honoured" (and issue 19's exporters): each hostile or careless input's exact
reproducer, and the clear error (or the reference's result) it now gets. Tiny random models throughout."""

import dataclasses
import errno
import importlib
import io
import json
import os
import re
import stat
import subprocess
import sys

import gguf
import jax
import numpy as np
import pytest
import tokenizers
import torch
import transformers
from conftest import reference_logits
from safetensors.numpy import load_file, save_file
from test_load import copy_dir, edit_config, edit_weights

import linnet_jax
from linnet_jax import cli, export, train
from linnet_jax.gguf import write_gguf
from linnet_jax.models import params_to_hf
from linnet_jax.tokenizer import Tokenizer


def tiny(tiny_dir, name="llama_mha"):
    return linnet_jax.load(tiny_dir(name)[1], progress=False)


def snapshot(directory) -> dict:
    """Every file under `directory` by relative path, with its bytes."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


# ---- data loss ----

def test_hf_overwrite_deletes_only_what_it_writes(tiny_dir, tmp_path):
    model = tiny(tiny_dir)
    out = export.hf(model, tmp_path / "d", max_shard_size="100KB", progress=False)
    (out / "other-model.safetensors").write_text("x\n")
    (out / "README.md").write_text("mine\n")
    export.hf(model, out, overwrite=True, progress=False)
    assert (out / "other-model.safetensors").read_text() == "x\n" and (out / "README.md").read_text() == "mine\n"
    assert sorted(p.name for p in out.glob("model*")) == ["model.safetensors"]  # the old shards and index are gone


# exporter, the function it writes with (patched to fail with a full disk part-way), the target's name
FAILING_EXPORTS = {
    "gguf": (lambda m, p: export.gguf(m, p, dtype="f32", overwrite=True, progress=False),
             (gguf.GGUFWriter, "write_tensors_to_file"), "m.gguf"),
    "hf": (lambda m, p: export.hf(m, p, max_shard_size="100KB", overwrite=True, progress=False),
           ("linnet_jax.export._hf", "write_model_files"), "d"),
    "stablehlo": (lambda m, p: export.stablehlo(m, p, max_len=32, overwrite=True, progress=False),
                  ("linnet_jax.export._stablehlo", "save_file"), "d"),
    "jax_source": (lambda m, p: export.jax_source(m, p, overwrite=True),
                   ("linnet_jax.export._jax_source", "write_model_files"), "d"),
    "torch_source": (lambda m, p: export.torch_source(m, p, max_len=32, overwrite=True),
                     ("linnet_jax.export._torch_source", "write_model_files"), "d"),
    "onnx": (lambda m, p: export.onnx(m, p, max_len=32, overwrite=True),
             ("linnet_jax.export._onnx", "write_model_files"), "d"),
    "save": (lambda m, p: linnet_jax.save(m, p, overwrite=True), ("linnet_jax.checkpoint", "write_model_files"), "d"),
}


@pytest.mark.parametrize("kind", FAILING_EXPORTS)
def test_failed_export_leaves_the_target_untouched(tiny_dir, tmp_path, monkeypatch, kind):
    """A disk that fills part-way through: the earlier export in the target is byte for byte as it was, nothing
    partial is left beside it, and the error names the target."""
    write, (owner, name), target_name = FAILING_EXPORTS[kind]
    model = tiny(tiny_dir)
    target = tmp_path / target_name
    write(model, target)
    if target.is_dir():
        (target / "other-model.safetensors").write_text("x\n")
    before = snapshot(tmp_path)
    monkeypatch.setattr(importlib.import_module(owner) if isinstance(owner, str) else owner, name, disk_full)
    with pytest.raises(OSError, match=f"could not write {re.escape(str(target))}: No space left on device"):
        write(model, target)
    assert snapshot(tmp_path) == before
    assert [p.name for p in tmp_path.iterdir()] == [target_name]


# Every writer, refusing what is in the way even with overwrite=True (issue 19).
WRITERS = {name: write for name, (write, _, _) in FAILING_EXPORTS.items()} | {
    "peft": lambda m, p: export.peft(m, train.init_lora(m.config, train.LoraConfig(rank=8), jax.random.key(0)), p,
                                     overwrite=True)}


def test_exports_never_write_over_a_fifo_a_symlink_or_a_device(tiny_dir, tmp_path):
    """A named pipe, or a symbolic link (here to /dev/null), is never replaced: not even with overwrite=True, and
    not by `linnet-jax export` (issue 19, item 1)."""
    model = tiny(tiny_dir)
    fifo, link = tmp_path / "pipe", tmp_path / "null.gguf"
    os.mkfifo(fifo)
    link.symlink_to(os.devnull)
    with pytest.raises(FileExistsError, match=f"{re.escape(str(fifo))} already exists and is a named pipe .FIFO.; "
                                              "an export writes over a regular file or a directory only"):
        export.gguf(model, fifo, dtype="f32", progress=False)
    for name, write in WRITERS.items():
        for target, kind in ((fifo, "named pipe"), (link, "symbolic link")):
            with pytest.raises(FileExistsError, match=f"{re.escape(str(target))} already exists and is a {kind}"):
                write(model, target)
    with pytest.raises(SystemExit, match=f"linnet-jax export: error: {re.escape(str(fifo))} already exists and is a "
                                         "named pipe"):
        cli.main(["export", "--format", "gguf", "--model", str(tiny_dir("llama_mha")[1]), "--no-compilation-cache",
                  "--overwrite", str(fifo)])
    assert stat.S_ISFIFO(fifo.lstat().st_mode) and os.readlink(link) == os.devnull
    assert sorted(p.name for p in tmp_path.iterdir()) == ["null.gguf", "pipe"]  # nothing partial left either


def test_torch_source_and_onnx_refuse_a_taken_directory_and_a_bad_dtype(tiny_dir, tmp_path, capsys):
    """Issue 22's exporters: a non-empty directory without overwrite=True, and a dtype the graphs cannot be run
    in (ONNX Runtime's CPU provider has no bfloat16 MatMul), are refused before anything is written; the command
    line refuses a --dtype of another format's kind before loading the model."""
    model = tiny(tiny_dir)
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "mine.txt").write_text("x\n")
    for write in (export.torch_source, export.onnx):
        with pytest.raises(FileExistsError, match=f"{re.escape(str(taken))} already exists and is not empty; pass "
                                                  "overwrite=True to write over it"):
            write(model, taken)
    for dtype, reason in (("bfloat16", ": ONNX Runtime's CPU provider has no bfloat16 MatMul"), ("f16", "")):
        with pytest.raises(ValueError, match=re.escape(f"dtype must be one of ('float32', 'float16'), got "
                                                       f"{dtype!r}{reason}")):
            export.onnx(model, tmp_path / "out", dtype=dtype)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["export", "--format", "onnx", "--dtype", "bfloat16", "--model", str(tmp_path / "nope"),
                  str(tmp_path / "out")])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == ("linnet-jax: error: --dtype bfloat16 is not one of "
                                                        "('float32', 'float16') (for --format onnx)")
    assert snapshot(tmp_path) == {"taken/mine.txt": b"x\n"}


# Runs each writer in a process whose files may not grow past 64 KB (a stand-in for a full disk), SIGXFSZ ignored
# so that a write past it fails with EFBIG; prints {writer: [error type, message, what is left in its folder]}.
FILE_SIZE_LIMIT = """
import json, resource, signal, sys, tempfile
from pathlib import Path
import jax
import linnet_jax
from linnet_jax import export, train
model = linnet_jax.load(sys.argv[1], progress=False)
lora = train.init_lora(model.config, train.LoraConfig(rank=8), jax.random.key(0))
writers = {"hf": lambda p: export.hf(model, p, progress=False),
           "stablehlo": lambda p: export.stablehlo(model, p, max_len=32, progress=False),
           "jax_source": lambda p: export.jax_source(model, p), "peft": lambda p: export.peft(model, lora, p),
           "torch_source": lambda p: export.torch_source(model, p, max_len=32),
           "onnx": lambda p: export.onnx(model, p, max_len=32),
           "gguf": lambda p: export.gguf(model, p, dtype="f32", progress=False),
           "save": lambda p: linnet_jax.save(model, p)}  # last: Orbax's threads outlive a failed save a moment
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
outcomes = {}
for name, write in writers.items():
    folder = Path(sys.argv[2]) / name
    folder.mkdir()
    try:
        write(folder / "out")
        outcomes[name] = [None, "", []]
    except Exception as error:
        outcomes[name] = [type(error).__name__, str(error), sorted(p.name for p in folder.iterdir())]
print(json.dumps(outcomes))
"""


def test_a_save_past_a_file_size_limit_is_an_os_error_and_leaves_nothing(tiny_dir, tmp_path):
    """Under RLIMIT_FSIZE every writer raises an OSError naming its target (not Orbax's ValueError or a
    SafetensorError), and no `.out.partial-*` is left beside it (issue 19, item 13)."""
    environment = {key: value for key, value in os.environ.items() if key != "JAX_COMPILATION_CACHE_DIR"}
    result = subprocess.run([sys.executable, "-c", FILE_SIZE_LIMIT, str(tiny_dir("llama_mha")[1]), str(tmp_path)],
                            capture_output=True, text=True, timeout=300, env=environment)
    assert result.returncode == 0, result.stderr[-3000:]
    outcomes = json.loads(result.stdout.splitlines()[-1])
    assert set(outcomes) == set(WRITERS)
    for name, (kind, message, left) in outcomes.items():
        target = tmp_path / name / "out"
        assert kind == "OSError" and f"could not write {target}: " in message, (name, kind, message)
        # gguf's writer, and numpy's tofile under onnx_ir's external data (onnx), count bytes: no errno
        assert name in ("gguf", "onnx") or "File too large; it was left as it was" in message
        assert left == [], (name, left)


# ---- configs, checkpoints and GGUF metadata ----

def test_hidden_act_other_than_silu_is_refused(tiny_dir, tmp_path):
    directory = copy_dir(tiny_dir("llama_mha")[1], tmp_path / "m")
    edit_config(directory, hidden_act="gelu")
    with pytest.raises(ValueError, match=r"config.json: config field 'hidden_act' is 'gelu'; linnet_jax's MLP "
                                         r"computes SiLU"):
        linnet_jax.load(directory, progress=False)


def test_lm_head_with_tied_embeddings_loads_as_transformers_5_does(tiny_dir, tmp_path):
    """transformers 5 uses a checkpoint's lm_head.weight that differs from the embeddings, untied (and warns);
    one equal to them stays tied."""
    directory = copy_dir(tiny_dir("qwen2_bias_tied")[1], tmp_path / "m")
    head = np.random.default_rng(0).standard_normal((256, 64)).astype(np.float32)
    edit_weights(directory, lambda state: state.update({"lm_head.weight": head}))
    with pytest.warns(UserWarning, match="tie_word_embeddings=true, but the checkpoint's lm_head.weight differs"):
        model = linnet_jax.load(directory, progress=False)
    assert not model.config.tie_word_embeddings and np.array_equal(model.params.lm_head, head)
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                                  attn_implementation="eager").eval()
    ids = np.arange(20)[None]
    assert np.abs(np.asarray(linnet_jax.logits(model, ids)) - reference_logits(reference, ids)).max() < 1e-4
    edit_weights(directory, lambda state: state.update({"lm_head.weight": state["model.embed_tokens.weight"]}))
    assert linnet_jax.load(directory, progress=False).params.lm_head is None


def test_stray_safetensors_overriding_tensors_is_refused(tiny_dir, tmp_path):
    directory = copy_dir(tiny_dir("llama_mha")[1], tmp_path / "m")
    state = load_file(directory / "model.safetensors")
    save_file({"model.norm.weight": 2 * state["model.norm.weight"]}, directory / "other-model.safetensors")
    with pytest.raises(ValueError, match="tensor 'model.norm.weight' is in both model.safetensors and "
                                         "other-model.safetensors; which one the model uses would be a guess"):
        linnet_jax.load(directory, progress=False)


def test_layers_beyond_num_hidden_layers_are_refused(tiny_dir, tmp_path):
    directory = copy_dir(tiny_dir("llama_mha")[1], tmp_path / "m")
    edit_config(directory, num_hidden_layers=1)
    with pytest.raises(ValueError, match=r"holds tensors of layer\(s\) \[1, 2\], beyond num_hidden_layers=1"):
        linnet_jax.load(directory, progress=False)


def test_gguf_block_count_below_its_blocks_is_refused(tiny_dir, tmp_path):
    model = tiny(tiny_dir)
    hf_config = model.config.to_hf() | {"num_hidden_layers": 2}  # the file holds blk.0 to blk.2
    path = write_gguf(tmp_path / "m.gguf", hf_config, params_to_hf(model.params, model.config), progress=False)
    with pytest.raises(ValueError, match=r"m.gguf: holds tensors of layer\(s\) \[2\], beyond llama.block_count=2"):
        linnet_jax.load(path, progress=False)


@pytest.mark.parametrize("field, value, expected", [
    ("hidden_size", "64", "must be a positive integer, got str '64'"),
    ("num_hidden_layers", 2.0, "must be a positive integer, got float 2.0"),
    ("num_attention_heads", True, "must be a positive integer, got bool True"),
    ("architectures", "LlamaForCausalLM", "must be a list of strings, got str 'LlamaForCausalLM'"),
    ("eos_token_id", "2", "must be an integer or a list of integers, got str '2'"),
    ("rms_norm_eps", "1e-6", "must be a positive number, got str '1e-6'"),
    ("tie_word_embeddings", "false", "must be true or false, got str 'false'"),
    ("rope_scaling", "linear", "must be an object, got str 'linear'"),
])
def test_wrong_json_types_in_config_are_named(tiny_dir, tmp_path, field, value, expected):
    directory = copy_dir(tiny_dir("llama_mha")[1], tmp_path / "m")
    edit_config(directory, **{field: value})
    with pytest.raises(ValueError, match=re.escape(f"config.json: config field {field!r} {expected}")):
        linnet_jax.load(directory, progress=False)


@pytest.mark.parametrize("scaling, expected", [
    ({"rope_scaling": {"rope_type": "linear", "factor": 0}}, "'rope_scaling.factor' must be a positive number, got 0"),
    ({"rope_parameters": {"rope_type": "linear", "factor": -2.0}},
     "'rope_parameters.factor' must be a positive number, got -2.0"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 256}},
     "'rope_scaling.low_freq_factor' must be a positive number, got 0"),
])
def test_rope_scaling_factors_not_positive_are_refused(tiny_dir, tmp_path, scaling, expected):
    directory = copy_dir(tiny_dir("llama_mha")[1], tmp_path / "m")
    edit_config(directory, **scaling)
    with pytest.raises(ValueError, match=re.escape(expected)):
        linnet_jax.load(directory, progress=False)


@pytest.mark.parametrize("index, expected", [
    ('{"weight_map": {', "model.safetensors.index.json: not valid JSON"),
    ('{"metadata": {}}', "model.safetensors.index.json: expected a 'weight_map' object of tensor name -> shard file "
                         "name, got None"),
    ('{"weight_map": ["model-00001-of-00002.safetensors"]}', "expected a 'weight_map' object"),
    ("[]", "model.safetensors.index.json: expected a JSON object, got a list"),
])
def test_bad_index_is_named(tiny_dir, tmp_path, index, expected):
    directory = copy_dir(tiny_dir("llama_mha")[1], tmp_path / "m")
    (directory / "model.safetensors.index.json").write_text(index)
    with pytest.raises(ValueError, match=re.escape(expected)):
        linnet_jax.load(directory, progress=False)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_weight_is_refused(tiny_dir, tmp_path, bad):
    directory = copy_dir(tiny_dir("llama_mha")[1], tmp_path / "m")
    edit_weights(directory, lambda state: state["model.layers.1.mlp.up_proj.weight"].__setitem__((5, 7), bad))
    with pytest.raises(ValueError, match=re.escape(f"tensor 'model.layers.1.mlp.up_proj.weight' holds 1 non-finite "
                                                   f"value(s) (the first, {bad}, at flat index 327)")):
        linnet_jax.load(directory, progress=False)


def test_non_finite_gguf_weight_is_refused(tiny_dir, tmp_path):
    model = tiny(tiny_dir)
    state = params_to_hf(model.params, model.config)
    state["model.norm.weight"] = np.where(np.arange(64) == 3, np.nan, state["model.norm.weight"])
    path = write_gguf(tmp_path / "m.gguf", model.config.to_hf(), state, progress=False)
    with pytest.raises(ValueError, match=r"m.gguf: tensor 'model.norm.weight' holds 1 non-finite value"):
        linnet_jax.load(path, progress=False)


# ---- Orbax checkpoints ----

@pytest.fixture
def checkpoint(tiny_dir, tmp_path):
    return linnet_jax.save(tiny(tiny_dir, "qwen2_bias_tied"), tmp_path / "ckpt")


@pytest.mark.parametrize("edit, expected", [
    ({"hidden_size": 32}, "hidden_size do(es) not match the saved params: 'embed' was saved with shape (256, 64), "
                          "the config implies (256, 32)"),
    ({"num_hidden_layers": 2}, "num_hidden_layers do(es) not match the saved params: 'layers.attn_norm' was saved "
                               "with shape (3, 64), the config implies (2, 64)"),
    ({"dtype": "bfloat16", "torch_dtype": "bfloat16"}, "dtype 'bfloat16' does not match the saved params: 'embed' "
                                                       "was saved as float32"),
    ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, "does not match the saved params: it implies"),
])
def test_orbax_edited_config_is_refused(checkpoint, edit, expected):
    edit_config(checkpoint, **edit)
    with pytest.raises(ValueError, match=re.escape(f"{checkpoint / 'config.json'}") + ".*" + re.escape(expected)):
        linnet_jax.load(checkpoint, progress=False)


def test_orbax_corrupt_bytes_are_refused(checkpoint):
    data = max((p for p in (checkpoint / "params").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    corrupt = bytearray(data.read_bytes())
    corrupt[len(corrupt) // 2] ^= 0xFF
    data.write_bytes(bytes(corrupt))
    with pytest.raises(ValueError, match=re.escape(str(checkpoint)) + r": the saved params '[\w.]+' do not match the "
                                         r"shape, dtype and sha256 recorded when they were saved; the checkpoint is "
                                         r"corrupt"):
        linnet_jax.load(checkpoint, progress=False)


# ---- tokenizer ----

@pytest.fixture
def with_tokenizer(tiny_dir):
    """A tiny model with a tiny word-level tokenizer and a chat template."""
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "abc": 1}, unk_token="[UNK]"))
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    return dataclasses.replace(tiny(tiny_dir), tokenizer=Tokenizer(backend, chat_template=template, unk_token="[UNK]"))


def test_lone_surrogate_in_a_prompt_is_named(with_tokenizer):
    with pytest.raises(ValueError, match=r"the text holds a lone surrogate, U\+D800, at position 3: it is not a "
                                         "character and cannot be encoded as UTF-8"):
        linnet_jax.generate(with_tokenizer, "abc\ud800", 4, chat=False)
    with pytest.raises(ValueError, match=r"messages\[1\]\['content'\] holds a lone surrogate, U\+DFFF, at position 1"):
        with_tokenizer.tokenizer.apply_chat_template([{"role": "system", "content": "abc"},
                                                      {"role": "user", "content": "a\udfff"}])


# ---- the command line ----

def run_cli(*args, stdin: bytes = b"") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "linnet_jax", *args, "--no-compilation-cache"], input=stdin,
                          capture_output=True, timeout=300)


def test_cli_bad_model_is_one_line_and_exit_1(tmp_path):
    result = run_cli("generate", "hi", "--model", str(tmp_path / "nope"))
    assert result.returncode == 1
    assert result.stderr.decode().splitlines() == [
        f"linnet-jax generate: error: {tmp_path / 'nope'}: no such file or directory (and not a hub id of the form "
        "'org/name') (--debug shows the traceback)"]


@pytest.mark.parametrize("flags, expected", [
    (["--top-p", "2"], "linnet-jax: error: top_p must be in (0, 1], got [2.0]"),
    (["--temperature", "-1"], "linnet-jax: error: temperature must be ≥ 0, got [-1.0]"),
    (["--max-new-tokens", "-5"], "linnet-jax generate: error: argument --max-new-tokens: must be a positive int, "
                                 "got -5"),
    (["--raw", "--system", "Be brief."], "linnet-jax: error: --system needs the chat template; drop --raw"),
])
def test_cli_bad_flags_exit_2_before_loading(tmp_path, capsys, flags, expected):
    """The model does not exist: a flag error that comes first was found before loading."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(["generate", "hi", "--model", str(tmp_path / "nope"), *flags])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == expected


def test_cli_debug_shows_the_traceback(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        cli.main(["generate", "hi", "--model", str(tmp_path / "nope"), "--debug", "--no-compilation-cache"])


def test_cli_chat_names_invalid_utf8_and_goes_on(tiny_dir):
    result = run_cli("chat", "--model", str(tiny_dir("llama_mha")[1]), stdin=b"ab\xffc\n\n")
    assert result.returncode == 0, result.stderr.decode()
    assert "linnet-jax chat: that line is not valid UTF-8 (byte 0xFF at position 2); type it again" in \
        result.stderr.decode()
    assert "Traceback" not in result.stderr.decode()


def test_cli_chat_reads_valid_utf8_after_an_invalid_line(tiny_dir, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"\xfe\nok\n"), encoding="utf-8"))
    monkeypatch.setattr(cli, "stream_reply", lambda model, prompt, args: print("reply to", prompt[-1]["content"]))
    assert cli.main(["chat", "--model", str(tiny_dir("llama_mha")[1]), "--no-compilation-cache"]) == 0
    captured = capsys.readouterr()
    assert "byte 0xFE at position 0" in captured.err and "reply to ok" in captured.out
