"""Shared fixtures: random-weight tiny transformers models saved as HF directories, SmolLM2, and a
parity report printed at the end of the run."""

from __future__ import annotations

import atexit
import gc
import json
import os
import shutil
import tempfile

import jax
import numpy as np
import pytest

# One persistent JAX compilation cache for the whole run: this process, pytest-xdist's workers and every child
# (notebooks, the CLI, sharding and distributed workers, standalone exports, benchmark scripts) inherit it, so a
# program one of them compiled is not compiled again by another. Made by the first process; removed at its exit.
# Every program goes in, not only those that took JAX's default second to compile: most of the suite's programs
# compile in under a second, and files and processes compile the same ones again and again.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="linnet-tests-jax-cache-")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], True)


@pytest.fixture(scope="module", autouse=True)
def _compiled_programs_freed_after_each_file():
    """Every compiled XLA:CPU program holds memory mappings, and JAX keeps each one for the life of the process.
    An xdist worker that ran a few hundred test files reached Linux's 65,530 mappings (vm.max_map_count) and
    jaxlib segfaulted in its next compile or serialize: `test_engine.py` and `test_engine_v2.py` alone leave
    33,800 mappings. Programs a file compiled are dropped after it (a later file reads them back from the
    persistent cache above)."""
    yield
    jax.clear_caches()
    gc.collect()


try:  # Python 3.11's suite; Python >= 3.12 has no torch here and runs `pytest -m "not torch"` (.ci/run)
    import torch
    import transformers
except ImportError:
    torch = transformers = None
else:
    torch.set_num_threads(2)

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PARITY: dict[str, float] = {}

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            max_position_embeddings=4096, initializer_range=0.1)

# name -> (transformers config class's name, fields beyond TINY)
TINY_CONFIGS = {
    "llama_mha": ("LlamaConfig", dict(num_key_value_heads=4)),
    "llama_gqa_llama3": ("LlamaConfig", dict(
        num_key_value_heads=2, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=256))),
    "llama_linear_untied": ("LlamaConfig", dict(
        num_key_value_heads=2, tie_word_embeddings=False, rope_scaling=dict(rope_type="linear", factor=4.0))),
    "llama_attention_bias": ("LlamaConfig", dict(num_key_value_heads=1, attention_bias=True)),
    "mistral_sliding": ("MistralConfig", dict(num_key_value_heads=2, sliding_window=16)),
    "qwen2_bias_tied": ("Qwen2Config", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3_qk_norm": ("Qwen3Config", dict(num_key_value_heads=2, head_dim=32)),
}
# The fixtures that build a model with transformers: every test using one is marked `torch`.
REFERENCE_FIXTURES = {"tiny_dir", "shardable_dir", "smollm2_reference", "smollm2_reference_tokenizer", "tiny_chat",
                      "tiny_chat_dir"}


def record_parity(case: str, diff: float) -> None:
    PARITY[case] = max(diff, PARITY.get(case, 0.0))


def pytest_collection_modifyitems(items):
    for item in items:
        if REFERENCE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.torch)


def pytest_sessionfinish(session):
    """An xdist worker hands its parity rows to the controller, which prints the table."""
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["parity"] = json.dumps(PARITY)


def pytest_testnodedown(node, error):
    """(pytest-xdist, on the controller) a worker's parity rows joined to the run's."""
    for case, diff in json.loads(getattr(node, "workeroutput", {}).get("parity", "{}")).items():
        record_parity(case, diff)


def pytest_terminal_summary(terminalreporter):
    if PARITY:
        terminalreporter.section("max |logit difference| against transformers eager float32")
        for case, diff in sorted(PARITY.items()):
            terminalreporter.write_line(f"{case:60s} {diff:.3e}")


def randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Norm weights around 1 and non-zero biases, so that a dropped norm or bias shows in the logits."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.2 * torch.randn(param.shape, generator=generator))
            elif name.endswith("bias"):
                param.copy_(0.2 * torch.randn(param.shape, generator=generator))
    return model


def random_model(config: transformers.PretrainedConfig, seed: int) -> transformers.PreTrainedModel:
    """A float32 eager model of `config` whose random weights depend on `seed` only: the same whichever tests ran
    before (a near-tie between two logits must not come and go with the test order), and no RNG moved for them."""
    config._attn_implementation = "eager"
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
        return randomize(model, seed).eval()


def build_tiny(name: str, seed: int = 0) -> transformers.PreTrainedModel:
    config_class, fields = TINY_CONFIGS[name]
    return random_model(getattr(transformers, config_class)(**TINY | fields), seed)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """name -> (transformers model, directory it was saved to). Built once per name per session."""
    built = {}

    def get(name: str):
        if name not in built:
            model = build_tiny(name)
            directory = tmp_path_factory.mktemp(name)
            model.save_pretrained(directory)
            built[name] = (model, directory)
        return built[name]

    return get


def reference_logits(model: torch.nn.Module, ids: np.ndarray, attention_mask: np.ndarray | None = None) -> np.ndarray:
    with torch.no_grad():
        mask = None if attention_mask is None else torch.tensor(attention_mask)
        return model(torch.tensor(ids), attention_mask=mask).logits.float().numpy()


@pytest.fixture(scope="session")
def smollm2_gguf():
    from linnet_jax.load import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm2_contents(smollm2_gguf):
    """read_gguf of the SmolLM2 file: (hf_config, state, metadata)."""
    from linnet_jax.gguf import read_gguf

    return read_gguf(smollm2_gguf, progress=False)


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf):
    import linnet_jax

    return linnet_jax.load(smollm2_gguf, progress=False)


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_gguf):
    """transformers' own GGUF loader on the same file: the reference, float32 eager."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@pytest.fixture(scope="session")
def smollm2_reference_tokenizer(smollm2_gguf):
    return transformers.AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


@pytest.fixture(scope="module")
def tiny_chat_dir(smollm2, tmp_path_factory):
    """A random tiny llama with SmolLM2's vocabulary, tokenizer and special ids, saved as an HF directory."""
    config = transformers.LlamaConfig(**TINY | dict(vocab_size=smollm2.config.vocab_size, num_key_value_heads=2,
                                                    bos_token_id=smollm2.config.bos_token_id,
                                                    eos_token_id=list(smollm2.config.eos_token_ids)))
    directory = tmp_path_factory.mktemp("tiny_chat")
    random_model(config, seed=0).save_pretrained(directory)
    smollm2.tokenizer.save(directory)
    return directory


@pytest.fixture(scope="module")
def tiny_chat(tiny_chat_dir):
    """tiny_chat_dir loaded (a module's own; test_train_run's is another model of that name)."""
    import linnet_jax

    return linnet_jax.load(tiny_chat_dir, progress=False)


@pytest.fixture(scope="session")
def shardable_dir(tmp_path_factory):
    """A random tiny llama whose 8 query and 4 kv heads, MLP and vocab divide every mesh the sharding tests use,
    saved as a Hugging Face directory."""
    config = transformers.LlamaConfig(**TINY | dict(num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                                                    intermediate_size=128))
    directory = tmp_path_factory.mktemp("shardable")
    random_model(config, seed=3).save_pretrained(directory)
    return directory
