"""Training: the loss and its gradients against torch autograd on transformers' models, LoRA against PEFT,
accumulation, the LoRA identities, and training that drives the loss down."""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import record_parity

import linnet_jax
from linnet_jax import train
from linnet_jax.models.params import params_to_hf

GRAD_BOUND = 1e-4  # ‖g − g_ref‖ / ‖g_ref‖ for every tensor
LOSS_BOUND = 1e-5
GRADIENT_TABLE: dict[str, tuple[float, float, str]] = {}


def masked_batch(vocab: int, lengths: list[int], width: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Right-padded random rows: segment_ids 1 on real tokens and 0 on padding; the first third of each row is
    a prompt that does not count in the loss."""
    rng = np.random.default_rng(seed)
    tokens = np.zeros((len(lengths), width), np.int32)
    segments = np.zeros_like(tokens)
    mask = np.zeros_like(tokens)
    for row, length in enumerate(lengths):
        tokens[row, :length] = rng.integers(0, vocab, length)
        segments[row, :length] = 1
        mask[row, length // 3:length] = 1
    return {"tokens": tokens, "loss_mask": mask, "segment_ids": segments}


def torch_loss(model: torch.nn.Module, batch: dict[str, np.ndarray]) -> torch.Tensor:
    """The same masked mean cross-entropy through transformers (right padding as attention_mask)."""
    tokens = torch.tensor(batch["tokens"], dtype=torch.long)
    logits = model(tokens, attention_mask=torch.tensor(batch["segment_ids"] > 0, dtype=torch.long)).logits
    losses = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten(), reduction="none")
    counts = torch.tensor(batch["loss_mask"][:, 1:] * (batch["segment_ids"][:, 1:] > 0), dtype=torch.float32).flatten()
    return (losses * counts).sum() / counts.sum()


def relative_errors(ours: dict[str, np.ndarray], reference: dict[str, np.ndarray]) -> dict[str, float]:
    assert set(ours) == set(reference), set(ours) ^ set(reference)
    return {name: float(np.linalg.norm(ours[name] - reference[name]) / np.linalg.norm(reference[name]))
            for name in reference}


def check_gradients(case: str, model, reference: torch.nn.Module, batch: dict[str, np.ndarray]) -> None:
    value, grads = train.gradients(model.params, model.config, jax.tree.map(jnp.asarray, batch))
    reference = copy.deepcopy(reference)
    expected = torch_loss(reference, batch)
    expected.backward()
    expected_grads = {name: p.grad.numpy() for name, p in reference.named_parameters()}
    errors = relative_errors(params_to_hf(grads, model.config), expected_grads)
    worst = max(errors, key=errors.get)
    loss_diff = abs(float(value) - expected.item())
    GRADIENT_TABLE[case] = (loss_diff, errors[worst], worst)
    record_parity(f"train {case}: |loss - torch|", loss_diff)
    record_parity(f"train {case}: worst gradient ‖g - g_torch‖/‖g_torch‖", errors[worst])
    assert loss_diff < LOSS_BOUND, (float(value), float(expected))
    assert errors[worst] < GRAD_BOUND, (worst, errors[worst])


@pytest.mark.parametrize("name", ["llama_gqa_llama3", "llama_linear_untied", "qwen2_bias_tied", "mistral_sliding"])
def test_gradients_match_torch(name, tiny_dir):
    reference, directory = tiny_dir(name)
    model = linnet_jax.load(directory, progress=False)
    batch = masked_batch(model.config.vocab_size, [40, 29, 33], 40)  # past mistral's 16-token window
    check_gradients(f"tiny {name}", model, reference, batch)


def test_gradients_match_torch_smollm2(smollm2, smollm2_reference):
    batch = masked_batch(smollm2.config.vocab_size, [48, 37], 48, seed=1)
    check_gradients("SmolLM2", smollm2, smollm2_reference, batch)


def random_adapters(config, rank: int, targets: tuple[str, ...], seed: int = 0) -> train.Lora:
    """Adapters with B random too, so that every adapter gets a gradient and changes the logits."""
    lora = train.init_lora(config, train.LoraConfig(rank=rank, alpha=2.0 * rank, targets=targets), jax.random.key(seed))
    keys = jax.random.split(jax.random.key(seed + 1), len(lora.b))
    return lora.replace(b={field: 0.05 * jax.random.normal(key, b.shape) for key, (field, b) in zip(keys, lora.b.items())})


def full_logits(model, tokens: np.ndarray, lora=None) -> np.ndarray:
    positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    return np.asarray(jax.jit(lambda p, l: linnet_jax.models.forward(p, model.config, tokens, positions, lora=l)[0])(
        model.params, lora))


def peft_model(reference: torch.nn.Module, adapter_dir, trainable: bool = False):
    import peft

    return peft.PeftModel.from_pretrained(copy.deepcopy(reference), adapter_dir, is_trainable=trainable)


LORA_CASES = {"llama_linear_untied": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
              "qwen2_bias_tied": ("q_proj", "v_proj", "o_proj", "down_proj"),
              "mistral_sliding": ("k_proj", "gate_proj", "up_proj")}


def check_lora_gradients(case: str, model, reference: torch.nn.Module, lora, batch: dict, adapter_dir) -> None:
    """Our adapters, exported with export.peft and loaded by PEFT: same loss and adapter gradients."""
    value, grads = train.gradients(model.params, model.config, jax.tree.map(jnp.asarray, batch), lora=lora)
    adapted = peft_model(reference, adapter_dir, trainable=True)
    expected = torch_loss(adapted, batch)
    expected.backward()
    expected_grads = {n.replace(".default", ""): p.grad.numpy() for n, p in adapted.named_parameters() if p.requires_grad}
    from linnet_jax.export._peft import peft_state

    errors = relative_errors(peft_state(grads), expected_grads)
    worst = max(errors, key=errors.get)
    loss_diff = abs(float(value) - expected.item())
    GRADIENT_TABLE[case] = (loss_diff, errors[worst], worst)
    record_parity(f"train {case}: |loss - PEFT|", loss_diff)
    record_parity(f"train {case}: worst adapter gradient vs PEFT", errors[worst])
    assert loss_diff < LOSS_BOUND and errors[worst] < GRAD_BOUND, (loss_diff, worst, errors[worst])


@pytest.mark.parametrize("name", sorted(LORA_CASES))
def test_lora_gradients_match_peft(name, tiny_dir, tmp_path):
    reference, directory = tiny_dir(name)
    model = linnet_jax.load(directory, progress=False)
    lora = random_adapters(model.config, 4, LORA_CASES[name])
    with pytest.warns(UserWarning, match="rank 4 is not one vLLM serves"):
        linnet_jax.export.peft(model, lora, tmp_path / "adapter")
    batch = masked_batch(model.config.vocab_size, [40, 26], 40, seed=2)
    check_lora_gradients(f"tiny {name} LoRA r=4 vs PEFT", model, reference, lora, batch, tmp_path / "adapter")


def test_lora_gradients_match_peft_smollm2(smollm2, smollm2_reference, tmp_path):
    lora = random_adapters(smollm2.config, 8, tuple(train.TARGETS))
    linnet_jax.export.peft(smollm2, lora, tmp_path / "adapter")
    batch = masked_batch(smollm2.config.vocab_size, [32], 32, seed=3)
    check_lora_gradients("SmolLM2 LoRA r=8 vs PEFT", smollm2, smollm2_reference, lora, batch, tmp_path / "adapter")


def test_lora_identities_and_peft_export(tiny_dir, tmp_path):
    """B = 0 leaves the logits exactly; merged equals unmerged; PEFT on our HF export gives our logits."""
    reference, directory = tiny_dir("qwen2_bias_tied")
    model = linnet_jax.load(directory, progress=False)
    tokens = np.random.default_rng(0).integers(0, model.config.vocab_size, (2, 24)).astype(np.int32)
    fresh = train.init_lora(model.config, train.LoraConfig(rank=8, alpha=16), jax.random.key(0))
    assert np.array_equal(full_logits(model, tokens, fresh), full_logits(model, tokens))
    lora = random_adapters(model.config, 8, tuple(train.TARGETS))
    adapted = full_logits(model, tokens, lora)
    assert np.abs(adapted - full_logits(model, tokens)).max() > 1e-2  # the adapters do change the model
    merged = train.merge_lora(model, lora)
    merge_diff = float(np.abs(np.asarray(linnet_jax.logits(merged, tokens)) - adapted).max())
    record_parity("train tiny qwen2 LoRA merged vs unmerged (not transformers)", merge_diff)
    assert merge_diff < 1e-5
    linnet_jax.export.hf(model, tmp_path / "base", progress=False)
    linnet_jax.export.peft(model, lora, tmp_path / "adapter", base=str(tmp_path / "base"))
    import json

    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16 and config["modules_to_save"] is None
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32,
                                                             attn_implementation="eager")
    with torch.no_grad():
        expected = peft_model(base, tmp_path / "adapter").eval()(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    peft_diff = float(np.abs(expected - adapted).max())
    record_parity("train tiny qwen2 export.peft loaded by PEFT on export.hf", peft_diff)
    assert peft_diff < 1e-4


def lora_state_sizes(state: train.TrainState) -> tuple[int, int]:
    """(scalars in the optimizer state's arrays, scalars in the adapters)."""
    return sum(x.size for x in jax.tree.leaves(state.opt_state)), sum(x.size for x in jax.tree.leaves(state.lora))


def test_lora_step_freezes_the_base(tiny_dir):
    model = linnet_jax.load(tiny_dir("llama_mha")[1], progress=False)
    config = train.LoraConfig(rank=8, alpha=16, targets=("q_proj", "v_proj"))
    optimizer = train.optimizer(1e-2)
    state = train.init_state(model, optimizer, lora=config)
    before = jax.tree.map(np.asarray, state.params)
    opt_size, lora_size = lora_state_sizes(state)
    assert lora_size < opt_size < 2 * lora_size + 16  # Adam's two moments of the adapters, and a few scalars
    step = train.make_train_step(optimizer, lora=config)
    batch = train.shard_batch(masked_batch(model.config.vocab_size, [20, 14], 20), None)
    for _ in range(2):
        state, metrics = step(state, batch)
    assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state.params)))
    assert float(np.abs(np.asarray(state.lora.b["wq"])).max()) > 0  # B left zero: the adapters did train
    assert int(state.step) == 2 and float(metrics["lr"]) == pytest.approx(1e-2)
    with pytest.raises(ValueError, match="needs a state with adapters"):
        train.make_train_step(optimizer)(state, batch)


@pytest.mark.parametrize("lora", [None, train.LoraConfig(rank=4, alpha=8)], ids=["full", "lora"])
def test_accumulation_equals_a_larger_batch(tiny_dir, lora):
    """accum_steps=4 over 8 rows of unequal target counts = one step over the 8 rows: same metrics and update."""
    model = linnet_jax.load(tiny_dir("llama_gqa_llama3")[1], progress=False)
    batch = masked_batch(model.config.vocab_size, [32, 5, 17, 32, 9, 28, 12, 3], 32, seed=4)
    results = []
    for accum_steps in (1, 4):
        optimizer = train.optimizer(1e-3)
        state = train.init_state(model, optimizer, lora=lora, seed=1)
        if lora is not None:  # non-zero B, so that A gets a gradient too
            state = state.replace(lora=random_adapters(model.config, 4, lora.targets, seed=1))
            state = state.replace(opt_state=optimizer.init(state.lora))
        step = train.make_train_step(optimizer, lora=lora, accum_steps=accum_steps)
        state, metrics = step(state, train.shard_batch(batch, None))
        results.append((jax.tree.map(np.asarray, state.trained), {k: float(v) for k, v in metrics.items()}))
    (one, m1), (four, m4) = results
    assert m1["tokens"] == m4["tokens"] == float((batch["loss_mask"][:, 1:] * batch["segment_ids"][:, 1:]).sum())
    assert m4["loss"] == pytest.approx(m1["loss"], rel=1e-6) and m4["grad_norm"] == pytest.approx(m1["grad_norm"], rel=1e-5)
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(four)):
        # Adam's first step moves a weight by lr·g/(|g| + 1e-8): where g is within a few 1e-8 of zero, the float32
        # sums of g in another order (the micro-batches) move it by ~1e-3 of lr = 1e-3, i.e. ~1e-6. Measured on
        # jaxlib 0.12.0.1: 1.23e-6 (one w_gate entry of 0.065) and 6.8e-7 (one w_down entry); atol 3e-6 leaves 2.4x.
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=3e-6)


@pytest.fixture(scope="module", autouse=True)
def print_gradient_table():
    yield
    if GRADIENT_TABLE:
        print("\ncase | |loss - reference| | worst ‖g - g_ref‖/‖g_ref‖ | tensor")
        for case, (loss_diff, error, name) in GRADIENT_TABLE.items():
            print(f"{case} | {loss_diff:.1e} | {error:.1e} | {name}")
