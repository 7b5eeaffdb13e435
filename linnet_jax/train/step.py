"""The masked next-token loss and the train step, pure functions over the model's params pytree.

Axis names: B batch rows, T positions, V vocabulary, A accumulation micro-batches.

A batch is a dict of arrays:
  tokens      int32 [B, T]
  loss_mask   [B, T], 1 where tokens[:, t] is a target predicted from the tokens before it
  segment_ids int32 [B, T], optional: the document of each token in a packed row, 0 for padding.
Positions follow from the segments (they restart at 0 in each document; padding is -1, never seen),
or are 0..T-1 without segment ids.
"""

import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from linnet_jax.models import Config, Params, forward
from linnet_jax.models.lora import Lora, LoraConfig
from linnet_jax.sharding import Layout, put
from linnet_jax.train.lora import init_lora


@flax.struct.dataclass
class TrainState:
    """What a train step carries: the step count, the params (trained in full fine-tuning, frozen under
    LoRA), the LoRA adapters (or None) and the optimizer state of the trained part only."""

    step: jax.Array  # int32 []
    params: Params
    lora: Lora | None
    opt_state: Any
    config: Config = flax.struct.field(pytree_node=False)
    layout: Layout | None = flax.struct.field(pytree_node=False, default=None)

    @property
    def trained(self) -> Params | Lora:
        """The part the optimizer updates: the adapters under LoRA, else the params."""
        return self.params if self.lora is None else self.lora


def positions_from_segments(segment_ids: jax.Array) -> jax.Array:
    """Each token's position inside its document (contiguous runs of one id), -1 for padding (id 0). [B, T] → [B, T]."""
    index = jnp.arange(segment_ids.shape[1])[None]
    starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], 1)
    first = jax.lax.cummax(jnp.where(starts, index, 0), axis=1)
    return jnp.where(segment_ids > 0, index - first, -1).astype(jnp.int32)


def token_losses(params: Params, config: Config, batch: dict, *, lora: Lora | None = None, remat: bool = False,
                 compute_dtype=None, constrain=None) -> tuple[jax.Array, jax.Array]:
    """Cross-entropy of each next-token prediction and which of them count: (float32 [B, T-1], float32 [B, T-1]).

    Entry t is the loss of predicting tokens[:, t+1] from the tokens up to t; it counts where
    loss_mask[:, t+1] is set and, with segment ids, t and t+1 are in the same document.
    compute_dtype: cast the weights (and adapters) to it for the forward; the gradient flows back in
    the params' dtype. Logits and the loss are float32 whatever the dtype.
    """
    tokens = batch["tokens"]
    segments = batch.get("segment_ids")
    positions = (jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape) if segments is None
                 else positions_from_segments(segments))
    if compute_dtype is not None:
        params, lora = jax.tree.map(lambda w: w.astype(compute_dtype), (params, lora))
    logits, _ = forward(params, config, tokens, positions, constrain=constrain, segment_ids=segments, lora=lora,
                        remat=remat)
    logits = logits[:, :-1]  # [B, T-1, V]
    targets = tokens[:, 1:]
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    losses = jax.nn.logsumexp(logits, axis=-1) - picked
    counts = batch["loss_mask"][:, 1:] > 0
    if segments is not None:
        counts &= segments[:, 1:] == segments[:, :-1]
    return losses, counts.astype(jnp.float32)


def loss_sum(params: Params, config: Config, batch: dict, **options) -> tuple[jax.Array, jax.Array]:
    """(sum of the counted token losses, how many count): float32 scalars. options: as token_losses."""
    losses, counts = token_losses(params, config, batch, **options)
    return jnp.sum(losses * counts), jnp.sum(counts)


def loss(params: Params, config: Config, batch: dict, **options) -> jax.Array:
    """Masked next-token cross-entropy averaged over the target tokens (float32 scalar; 0 with none)."""
    total, count = loss_sum(params, config, batch, **options)
    return total / jnp.maximum(count, 1)


def optimizer(learning_rate: float = 1e-4, *, steps: int | None = None, warmup: int = 0, weight_decay: float = 0.0,
              clip: float | None = 1.0, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8
              ) -> optax.GradientTransformation:
    """AdamW (PyTorch's defaults but weight decay 0) after clipping the global gradient norm to `clip`, its
    learning rate warmed up linearly over `warmup` steps, then cosine-decayed to a tenth by `steps`
    (constant without `steps`). The rate is an injected hyperparameter, so the step reports it."""
    if steps is None:
        schedule = optax.linear_schedule(0.0, learning_rate, warmup) if warmup else learning_rate
    else:
        schedule = optax.warmup_cosine_decay_schedule(learning_rate if not warmup else 0.0, learning_rate,
                                                      warmup, max(steps, warmup + 1), end_value=learning_rate / 10)
    adamw = optax.inject_hyperparams(optax.adamw)(learning_rate=schedule, b1=b1, b2=b2, eps=eps,
                                                  weight_decay=weight_decay)
    return adamw if clip is None else optax.chain(optax.clip_by_global_norm(clip), adamw)


def learning_rate(opt_state) -> jax.Array:
    """The learning rate an injected-hyperparameter optimizer state holds (NaN when it holds none)."""
    has = lambda node: isinstance(getattr(node, "hyperparams", None), dict)  # noqa: E731
    for node in jax.tree.leaves(opt_state, is_leaf=has):
        if has(node) and "learning_rate" in node.hyperparams:
            return jnp.asarray(node.hyperparams["learning_rate"], jnp.float32)
    return jnp.asarray(jnp.nan, jnp.float32)


def init_state(model, optimizer: optax.GradientTransformation, *, lora: LoraConfig | None = None,
               seed: int = 0) -> TrainState:
    """The state a run starts from: the model's params, fresh adapters when `lora` is given (B = 0, so the
    model is unchanged; replicated over a sharded model's mesh), and the optimizer state of the trained part
    (placed like it). Full fine-tuning trains a copy of the params: the step donates its state, and the
    model stays usable."""
    params, adapters = model.params, None
    if lora is not None:
        adapters = init_lora(model.config, lora, jax.random.key(seed))
    else:
        params = jax.tree.map(jnp.copy, params)
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params, lora=adapters, opt_state=None,
                       config=model.config, layout=model.layout)
    state = state.replace(opt_state=optimizer.init(state.trained))
    return state if model.layout is None else on_mesh(state, model.layout)


def on_mesh(tree, layout: Layout):
    """Every array of `tree` that is not already spread over the layout's mesh (the adapters, the step and the
    optimizer's counters), replicated over it."""
    devices = set(layout.mesh.devices.flat)
    return jax.tree.map(lambda x: x if x.sharding.device_set == devices else jax.device_put(x, layout.replicated()),
                        tree)


def shard_batch(batch: dict, layout: Layout | None) -> dict:
    """A host batch ({name: [B, T] array}) on the device, or over the layout's batch axes."""
    if layout is None:
        return {name: jnp.asarray(value) for name, value in batch.items()}
    return {name: put(np.asarray(value), layout.sharding(name, ("batch", "seq"), np.shape(value)))
            for name, value in batch.items()}


def micro_batches(batch: dict, accum_steps: int) -> dict:
    """[B, T] arrays as [A, B / A, T]: A micro-batches of consecutive rows."""
    rows = next(iter(batch.values())).shape[0]
    if rows % accum_steps:
        raise ValueError(f"a batch of {rows} rows does not split into accum_steps={accum_steps} micro-batches")
    return jax.tree.map(lambda x: x.reshape(accum_steps, rows // accum_steps, *x.shape[1:]), batch)


def make_train_step(optimizer: optax.GradientTransformation, *, lora: LoraConfig | None = None, accum_steps: int = 1,
                    compute_dtype=None, remat: bool = False):
    """step(state, batch) -> (state, metrics): one jitted update, the state donated (under LoRA all of it but
    the frozen params, which stay the model's).

    lora: train the state's adapters over frozen params (no gradient and no optimizer state for them);
    None trains the params. accum_steps: split the batch into that many micro-batches, run one at a time
    and sum their gradients weighted by their target-token counts, so the update equals one step over the
    whole batch. compute_dtype: the forward's weight dtype (e.g. bfloat16 on GPU/TPU; keep float32 on
    the CPU); remat: recompute each layer in the backward pass.
    metrics: loss (mean over the target tokens), grad_norm (before clipping), tokens (target count), lr.
    """
    options = dict(remat=remat, compute_dtype=compute_dtype)

    def objective(trained, state: TrainState, batch: dict):
        params, adapters = (state.params, trained) if lora is not None else (trained, None)
        constrain = state.layout.constrain if state.layout is not None else None
        total, count = loss_sum(params, state.config, batch, lora=adapters, constrain=constrain, **options)
        return total, count

    gradient = jax.value_and_grad(objective, has_aux=True)

    def update(state: TrainState, frozen: Params | None, batch: dict) -> tuple[TrainState, dict]:
        if frozen is not None:
            state = state.replace(params=frozen)
        if accum_steps == 1:
            (total, count), grads = gradient(state.trained, state, batch)
        else:
            def accumulate(carry, micro):
                (total, count), grads = gradient(state.trained, state, micro)
                return jax.tree.map(lambda a, b: a + b.astype(jnp.float32), carry, (total, count, grads)), None

            scalar = jnp.zeros((), jnp.float32)
            zero = (scalar, scalar, jax.tree.map(lambda w: jnp.zeros(w.shape, jnp.float32), state.trained))
            (total, count, grads), _ = jax.lax.scan(accumulate, zero, micro_batches(batch, accum_steps))
        denominator = jnp.maximum(count, 1)
        grads = jax.tree.map(lambda g, w: (g / denominator).astype(w.dtype), grads, state.trained)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.trained)
        trained = optax.apply_updates(state.trained, updates)
        state = state.replace(step=state.step + 1, opt_state=opt_state,
                              **({"lora": trained} if lora is not None else {"params": trained}))
        metrics = {"loss": total / denominator, "grad_norm": optax.tree.norm(grads), "tokens": count,
                   "lr": learning_rate(opt_state)}
        return state.replace(params=None) if frozen is not None else state, metrics

    update = jax.jit(update, donate_argnums=0)

    def step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        if (lora is None) != (state.lora is None):
            raise ValueError("make_train_step(lora=...) needs a state with adapters (init_state(..., lora=...)), "
                             "and lora=None one without")
        if lora is None:
            return update(state, None, batch)
        new, metrics = update(state.replace(params=None), state.params, batch)
        return new.replace(params=state.params), metrics

    return step


@functools.partial(jax.jit, static_argnames=("config", "remat", "compute_dtype"))
def gradients(params: Params, config: Config, batch: dict, *, lora: Lora | None = None, remat: bool = False,
              compute_dtype=None):
    """(loss, gradient) of `loss` with respect to the params, or to the adapters when `lora` is given. Jitted."""
    options = dict(remat=remat, compute_dtype=compute_dtype)
    if lora is None:
        return jax.value_and_grad(lambda p: loss(p, config, batch, **options))(params)
    return jax.value_and_grad(lambda adapters: loss(params, config, batch, lora=adapters, **options))(lora)


__all__ = ["TrainState", "gradients", "init_state", "learning_rate", "loss", "loss_sum", "make_train_step",
           "optimizer", "positions_from_segments", "shard_batch", "token_losses"]
