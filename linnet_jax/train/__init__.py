"""Fine-tuning: data (JSON Lines → packed rows, or preference pairs), the masked loss or DPO's, the train step
(full or LoRA), Orbax checkpoints that resume exactly, and `finetune`, a whole run on a loaded Model (the
`linnet-jax finetune` command loads the model, runs it and exports the result)."""

from linnet_jax.models.lora import TARGETS, Lora, LoraConfig
from linnet_jax.train.checkpoints import Checkpoints
from linnet_jax.train.data import Batches, DataError, Document, load_documents, load_pairs, pack
from linnet_jax.train.lora import init_lora, merge_lora
from linnet_jax.train.step import (METHODS, TrainState, dpo_loss, dpo_sums, dpo_terms, gradients, init_state,
                                   learning_rate, loss, loss_sum, make_train_step, optimizer, positions_from_segments,
                                   sequence_logps, shard_batch, token_losses)
from linnet_jax.train.loop import Diverged, Result, finetune

__all__ = ["METHODS", "TARGETS", "Batches", "Checkpoints", "DataError", "Diverged", "Document", "Lora", "LoraConfig",
           "Result", "TrainState", "dpo_loss", "dpo_sums", "dpo_terms", "finetune", "gradients", "init_lora",
           "init_state", "learning_rate", "load_documents", "load_pairs", "loss", "loss_sum", "make_train_step", "merge_lora",
           "optimizer", "pack", "positions_from_segments", "sequence_logps", "shard_batch", "token_losses"]
