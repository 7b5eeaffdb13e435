"""Batch helpers shared by the tests and the worker scripts they start (importable without torch)."""

import numpy as np


def right_padded(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Rows of ids as one right-padded int32 [B, T] array (padding 0) and its attention mask."""
    ids = np.zeros((len(rows), max(map(len, rows))), np.int32)
    mask = np.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, :len(row)], mask[i, :len(row)] = row, 1
    return ids, mask


def train_batches(vocab: int, steps: int, rows: int = 8, width: int = 16) -> list[dict[str, np.ndarray]]:
    """`steps` fixed batches of random rows for the train step: tokens [rows, width], every token a target."""
    rng = np.random.default_rng(0)
    return [{"tokens": rng.integers(0, vocab, (rows, width)).astype(np.int32), "loss_mask": np.ones((rows, width), np.int32)}
            for _ in range(steps)]


def train_losses(model, steps: int) -> list[float]:
    """The losses of `steps` full fine-tuning steps (AdamW, lr 1e-3) on train_batches, gathered to the host."""
    from linnet_jax import train
    from linnet_jax.sharding import host

    optimizer = train.optimizer(1e-3)
    state, step, losses = train.init_state(model, optimizer), train.make_train_step(optimizer), []
    for batch in train_batches(model.config.vocab_size, steps):
        state, metrics = step(state, train.shard_batch(batch, model.layout))
        losses.append(float(host(metrics["loss"])))
    return losses
