"""Loading from an HF directory, a local hub cache, with dtypes; and every bad input's message."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import linnet_jax


def copy_dir(source, target):
    shutil.copytree(source, target)
    return target


def edit_config(directory, **changes):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def edit_weights(directory, edit):
    path = directory / "model.safetensors"
    state = load_file(path)
    edit(state)
    save_file(state, path, metadata={"format": "pt"})


def test_model_repr_and_params(tiny_dir):
    _, directory = tiny_dir("qwen2_bias_tied")
    model = linnet_jax.load(directory, progress=False)
    text = repr(model)
    assert "Qwen2ForCausalLM" in text and "layers=3" in text and "heads=4/2" in text and "float32" in text
    assert model.params.lm_head is None and model.params.layers.bq.shape == (3, 4, 16)
    assert model.params.layers.wq.shape == (3, 64, 4, 16)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_dtype_conversion(tiny_dir, dtype):
    _, directory = tiny_dir("llama_mha")
    model = linnet_jax.load(directory, dtype=dtype, progress=False)
    full = linnet_jax.load(directory, progress=False)
    assert model.config.dtype == dtype and model.params.embed.dtype == np.dtype(dtype)
    ids = np.arange(32)
    got, expected = np.asarray(linnet_jax.logits(model, ids)), np.asarray(linnet_jax.logits(full, ids))
    assert got.dtype == np.float32
    assert np.abs(got - expected).max() < 0.1 * np.abs(expected).max()


def test_sharded_checkpoint_loads_the_same(tiny_dir, tmp_path):
    reference, directory = tiny_dir("llama_linear_untied")
    reference.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    ids = np.arange(40)
    single = np.asarray(linnet_jax.logits(linnet_jax.load(directory, progress=False), ids))
    sharded = np.asarray(linnet_jax.logits(linnet_jax.load(tmp_path, progress=False), ids))
    assert np.array_equal(single, sharded)


def fake_hub_cache(cache, repo_id, directory, commit="0123456789abcdef0123456789abcdef01234567"):
    """The layout huggingface_hub keeps: models--org--name/{refs/main, snapshots/<commit>/...}."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(directory, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return cache


def test_hub_id_from_offline_cache(tiny_dir, tmp_path):
    """A hub id resolves from a local HF cache with HF_HUB_OFFLINE=1, in a fresh process, to the same logits."""
    _, directory = tiny_dir("llama_mha")
    cache = fake_hub_cache(tmp_path / "hub", "linnet/tiny-llama", directory)
    expected = np.asarray(linnet_jax.logits(linnet_jax.load(directory, progress=False), np.arange(16)))
    script = (
        "import numpy as np, linnet_jax, sys\n"
        f"m = linnet_jax.load('linnet/tiny-llama', cache_dir={str(cache)!r}, progress=False)\n"
        "np.save(sys.argv[1], np.asarray(linnet_jax.logits(m, np.arange(16))))\n"
        f"try:\n    linnet_jax.load('linnet/absent', cache_dir={str(cache)!r})\n"
        "except FileNotFoundError as e:\n    print('ERROR:', e)\n"
    )
    env = os.environ | {"HF_HUB_OFFLINE": "1", "JAX_PLATFORMS": "cpu"}
    out = tmp_path / "logits.npy"
    result = subprocess.run([sys.executable, "-c", script, str(out)], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert np.array_equal(np.load(out), expected)
    assert "could not get 'linnet/absent'" in result.stdout


def test_import_changes_no_global_jax_setting():
    script = (
        "import jax\n"
        "before = {k: getattr(jax.config, k) for k in ('jax_enable_x64', 'jax_default_matmul_precision', "
        "'jax_compilation_cache_dir', 'jax_platforms')}\n"
        "import linnet_jax\n"
        "after = {k: getattr(jax.config, k) for k in before}\n"
        "assert before == after, (before, after)\n"
    )
    run_fresh(script)


def test_import_leaves_the_exporters_and_gguf_until_used():
    script = (
        "import sys\n"
        "import linnet_jax\n"
        "heavy = [m for m in sys.modules if m.split('.')[0] == 'gguf' or m.startswith(('linnet_jax.gguf', "
        "'linnet_jax.export._', 'orbax'))]\n"
        "assert not heavy, heavy\n"
        "assert callable(linnet_jax.export.hf) and callable(linnet_jax.export.gguf) and 'gguf' in sys.modules\n"
    )
    run_fresh(script)


def test_loading_holds_the_weights_once():
    """Loading SmolLM2's GGUF reads one tensor at a time and hands XLA:CPU its host buffers uncopied: the
    process's peak RSS while loading, less what importing jax took, stays near the weights' size
    (it was 2.3x before the loader stopped holding the whole dequantized file beside the device copy).
    The peak is the process's own (VmHWM): ru_maxrss would start from pytest's, carried over across exec."""
    script = (
        "import jax, jax.numpy as jnp\n"
        "def peak_kib():\n"
        "    return next(int(line.split()[1]) for line in open('/proc/self/status') if line.startswith('VmHWM:'))\n"
        "jnp.zeros(1).block_until_ready()\n"
        "import linnet_jax\n"
        "before = peak_kib()\n"
        "model = linnet_jax.load(progress=False)\n"
        "weights = sum(x.nbytes for x in jax.tree.leaves(model.params)) / 1024\n"
        "peak = peak_kib() - before\n"
        "assert peak < 1.5 * weights, f'peak RSS while loading {peak / weights:.2f}x the weights'\n"
        "print(f'{peak / weights:.2f}')\n"
    )
    run_fresh(script)


def run_fresh(script: str) -> None:
    """Run a python script in a fresh process; its failure fails the test."""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


# --- bad input ---------------------------------------------------------------------------------


def test_missing_source_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        linnet_jax.load(tmp_path / "nothing-here")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        linnet_jax.load(tmp_path)


def config_only(tiny_dir, tmp_path):
    """A directory holding a tiny model's config.json and no weights."""
    target = tmp_path / "m"
    target.mkdir()
    shutil.copy(tiny_dir("llama_mha")[1] / "config.json", target)
    return target


def test_directory_without_weights(tiny_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="no weights"):
        linnet_jax.load(config_only(tiny_dir, tmp_path))


def test_pickle_checkpoints_are_refused(tiny_dir, tmp_path):
    target = config_only(tiny_dir, tmp_path)
    (target / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ValueError, match=r"only pickle checkpoints \(pytorch_model.bin\); they are refused"):
        linnet_jax.load(target)
    with pytest.raises(ValueError, match="pickle checkpoints are refused"):
        linnet_jax.load(target / "pytorch_model.bin")


def test_unknown_architecture(tiny_dir, tmp_path):
    target = copy_dir(tiny_dir("llama_mha")[1], tmp_path / "m")
    edit_config(target, architectures=["GPTNeoXForCausalLM"], model_type="gpt_neox")
    with pytest.raises(ValueError, match=r"config.json: unknown architecture \['GPTNeoXForCausalLM'\]; supported"):
        linnet_jax.load(target)


def test_missing_config_field(tiny_dir, tmp_path):
    target = copy_dir(tiny_dir("llama_mha")[1], tmp_path / "m")
    edit_config(target, hidden_size=None)
    with pytest.raises(ValueError, match=r"missing required field\(s\) \['hidden_size'\]"):
        linnet_jax.load(target)


def test_missing_tensor(tiny_dir, tmp_path):
    target = copy_dir(tiny_dir("llama_mha")[1], tmp_path / "m")
    edit_weights(target, lambda state: state.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match="tensor 'model.layers.1.mlp.up_proj.weight' is missing"):
        linnet_jax.load(target, progress=False)


def test_misshapen_tensor(tiny_dir, tmp_path):
    target = copy_dir(tiny_dir("llama_mha")[1], tmp_path / "m")

    def shrink(state):
        state["model.layers.2.self_attn.k_proj.weight"] = state["model.layers.2.self_attn.k_proj.weight"][:32]

    edit_weights(target, shrink)
    with pytest.raises(ValueError, match=r"'model.layers.2.self_attn.k_proj.weight' has shape \(32, 64\), "
                                         r"expected \(64, 64\)"):
        linnet_jax.load(target, progress=False)


def test_truncated_safetensors(tiny_dir, tmp_path):
    target = copy_dir(tiny_dir("llama_mha")[1], tmp_path / "m")
    weights = target / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match="model.safetensors.*truncated"):
        linnet_jax.load(target, progress=False)


def test_bad_dtype(tiny_dir):
    with pytest.raises(ValueError, match="dtype 'int8' is not supported"):
        linnet_jax.load(tiny_dir("llama_mha")[1], dtype="int8")


def test_token_ids_outside_vocabulary(tiny_dir):
    model = linnet_jax.load(tiny_dir("llama_mha")[1], progress=False)
    with pytest.raises(ValueError, match=r"id 256 outside the vocabulary \[0, 256\)"):
        linnet_jax.logits(model, [1, 2, 256])
    with pytest.raises(ValueError, match="id -1 outside"):
        linnet_jax.logits(model, [[1, -1]])
    with pytest.raises(ValueError, match="non-empty"):
        linnet_jax.logits(model, [])
    with pytest.raises(ValueError, match="attention_mask has shape"):
        linnet_jax.logits(model, [[1, 2, 3]], attention_mask=[[1, 1]])
