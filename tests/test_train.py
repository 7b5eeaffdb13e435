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
