"""Fine-tuning: data (JSON Lines → packed rows), the masked loss, the train step (full or LoRA), Orbax
checkpoints that resume exactly, and `finetune`, which the `linnet-jax finetune` command runs."""

from linnet_jax.models.lora import Lora
from linnet_jax.train.lora import TARGETS, LoraConfig, init_lora, merge_lora
from linnet_jax.train.step import (TrainState, gradients, init_state, learning_rate, loss, loss_sum, make_train_step,
                                   optimizer, positions_from_segments, shard_batch, token_losses)

__all__ = ["TARGETS", "Lora", "LoraConfig", "TrainState", "gradients", "init_lora", "init_state", "learning_rate",
           "loss", "loss_sum", "make_train_step", "merge_lora", "optimizer", "positions_from_segments", "shard_batch",
           "token_losses"]
