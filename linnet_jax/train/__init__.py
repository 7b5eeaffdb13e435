"""Fine-tuning: data (JSON Lines → packed rows), the masked loss, the train step (full or LoRA), Orbax
checkpoints that resume exactly, and `finetune`, a whole run on a loaded Model (the `linnet-jax finetune`
command loads the model, runs it and exports the result)."""

from linnet_jax.models.lora import TARGETS, Lora, LoraConfig
from linnet_jax.train.checkpoints import Checkpoints
from linnet_jax.train.data import Batches, DataError, Document, load_documents, pack
from linnet_jax.train.lora import init_lora, merge_lora
from linnet_jax.train.step import (TrainState, gradients, init_state, learning_rate, loss, loss_sum, make_train_step,
                                   optimizer, positions_from_segments, shard_batch, token_losses)
from linnet_jax.train.loop import Diverged, Result, finetune

__all__ = ["TARGETS", "Batches", "Checkpoints", "DataError", "Diverged", "Document", "Lora", "LoraConfig", "Result",
           "TrainState", "finetune", "gradients", "init_lora", "init_state", "learning_rate", "load_documents", "loss", "loss_sum",
           "make_train_step", "merge_lora", "optimizer", "pack", "positions_from_segments", "shard_batch",
           "token_losses"]
