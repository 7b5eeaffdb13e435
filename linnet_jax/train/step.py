"""The masked next-token loss, DPO's preference loss and the train step, pure functions over the model's params
pytree.

Axis names: B batch rows, T positions, V vocabulary, A accumulation micro-batches, P preference pairs.

A batch is a dict of arrays:
  tokens      int32 [B, T]
  loss_mask   [B, T], 1 where tokens[:, t] is a target predicted from the tokens before it
  segment_ids int32 [B, T], optional: the document of each token in a packed row, 0 for padding.
Positions follow from the segments (they restart at 0 in each document; padding is -1, never seen),
or are 0..T-1 without segment ids. A preference batch (DPO) holds P pairs as B = 2P rows, one document each:
row 2p the chosen reply of pair p, row 2p + 1 its rejected one, the loss mask on the replies.
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
from linnet_jax.ops import quantized
from linnet_jax.sharding import Layout, put
from linnet_jax.train.lora import init_lora


@flax.struct.dataclass
class TrainState:
    """What a train step carries: the step count, the params (trained in full fine-tuning, frozen under
    LoRA), the LoRA adapters (or None), the optimizer state of the trained part only and, for DPO's full
    fine-tuning, the frozen reference params (the model's own; None otherwise)."""

    step: jax.Array  # int32 []
    params: Params
    lora: Lora | None
    opt_state: Any
    config: Config = flax.struct.field(pytree_node=False)
    layout: Layout | None = flax.struct.field(pytree_node=False, default=None)
    reference: Params | None = None

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
    if compute_dtype is not None:  # a quantized weight's scales take the dtype (its int8 values stay)
        params, lora = jax.tree.map(lambda w: w.astype(compute_dtype), (params, lora), is_leaf=quantized.is_quantized)
    logits, _ = forward(params, config, tokens, positions, constrain=constrain, segment_ids=segments, lora=lora,
                        remat=remat)
    targets = jnp.pad(tokens[:, 1:], ((0, 0), (0, 1)))  # [B, T]; the last position's (0) is dropped below
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    losses = (jax.nn.logsumexp(logits, axis=-1) - picked)[:, :-1]  # sliced here, not the [B, T, V] logits (a copy)
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


def sequence_logps(params: Params, config: Config, batch: dict, **options) -> tuple[jax.Array, jax.Array]:
    """Each row's log-probability of its counted tokens (their sum) and how many count: float32 [B], [B].
    options: as token_losses."""
    losses, counts = token_losses(params, config, batch, **options)
    return -jnp.sum(losses * counts, axis=1), jnp.sum(counts, axis=1)


def dpo_terms(logps: jax.Array, reference_logps: jax.Array, beta: float) -> dict[str, jax.Array]:
    """Each pair's sigmoid DPO loss and rewards, as TRL's DPOTrainer computes them (loss_type "sigmoid").

    logps, reference_logps: float32 [2P], the policy's and the reference's log-probability of each reply, pairs
    interleaved (chosen, rejected). Returns float32 [P] each: loss -log σ(β (Δ_chosen - Δ_rejected)), with Δ the
    log-ratio to the reference; rewards/chosen β Δ_chosen and rewards/rejected β Δ_rejected (no gradient), their
    difference rewards/margins and rewards/accuracies, 1 where the chosen reply's reward is the higher.
    """
    logratios = logps - reference_logps
    chosen, rejected = logratios[0::2], logratios[1::2]
    rewards_chosen, rewards_rejected = (beta * jax.lax.stop_gradient(r) for r in (chosen, rejected))
    return {"loss": -jax.nn.log_sigmoid(beta * (chosen - rejected)), "rewards/chosen": rewards_chosen,
            "rewards/rejected": rewards_rejected, "rewards/margins": rewards_chosen - rewards_rejected,
            "rewards/accuracies": (rewards_chosen > rewards_rejected).astype(jnp.float32)}


def dpo_sums(params: Params, config: Config, batch: dict, *, beta: float = 0.1, reference: Params | None = None,
             reference_free: bool = False, lora: Lora | None = None, **options) -> tuple[jax.Array, dict]:
    """(the DPO loss summed over the batch's pairs, {"pairs": P, "tokens": counted tokens, "rewards/...": sums
    over the pairs}), float32 scalars. The policy is params (with the adapters `lora`); the reference is
    `reference`, or, without it, params with the adapters off (LoRA's frozen base); reference_free: log-probs of
    0 (no reference). options: as token_losses."""
    if not reference_free and reference is None and lora is None:
        raise ValueError("DPO needs a reference: frozen reference params, LoRA adapters over a frozen base (the "
                         "base is the reference), or reference_free=True")
    logps, counts = sequence_logps(params, config, batch, lora=lora, **options)
    if reference_free:
        reference_logps = jnp.zeros_like(logps)
    else:
        reference_logps, _ = sequence_logps(params if reference is None else reference, config, batch, **options)
        reference_logps = jax.lax.stop_gradient(reference_logps)
    terms = dpo_terms(logps, reference_logps, beta)
    sums = {name: jnp.sum(value) for name, value in terms.items()}
    return sums.pop("loss"), {"pairs": jnp.float32(len(logps) // 2), "tokens": jnp.sum(counts), **sums}


def dpo_loss(params: Params, config: Config, batch: dict, **options) -> tuple[jax.Array, dict]:
    """(the sigmoid DPO loss averaged over the batch's pairs, {"rewards/...": their means}): float32 scalars,
    TRL's DPOTrainer's loss and logged rewards. options: as dpo_sums."""
    total, sums = dpo_sums(params, config, batch, **options)
    pairs = sums.pop("pairs")
    return total / pairs, {name: value / pairs for name, value in sums.items() if name.startswith("rewards/")}


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
               seed: int = 0, reference: bool = False) -> TrainState:
    """The state a run starts from: the model's params, fresh adapters when `lora` is given (B = 0, so the
    model is unchanged; replicated over a sharded model's mesh), and the optimizer state of the trained part
    (placed like it). Full fine-tuning trains a copy of the params: the step donates its state, and the
    model stays usable. reference: keep the model's params, frozen, as DPO's reference in full fine-tuning
    (under LoRA the frozen base is the reference, with no second copy, and this is not needed)."""
    params, adapters = model.params, None
    if lora is not None:
        adapters = init_lora(model.config, lora, jax.random.key(seed))
    else:
        params = jax.tree.map(jnp.copy, params)
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params, lora=adapters, opt_state=None,
                       config=model.config, layout=model.layout,
                       reference=model.params if reference and lora is None else None)
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


METHODS = ("sft", "dpo")


def make_train_step(optimizer: optax.GradientTransformation, *, lora: LoraConfig | None = None, accum_steps: int = 1,
                    compute_dtype=None, remat: bool = False, method: str = "sft", beta: float = 0.1,
                    reference_free: bool = False):
    """step(state, batch) -> (state, metrics): one jitted update, the state donated (all of it but the frozen
    params under LoRA and DPO's reference params, which stay the model's).

    lora: train the state's adapters over frozen params (no gradient and no optimizer state for them);
    None trains the params. method: "sft", the masked next-token loss averaged over the target tokens, or
    "dpo", the sigmoid DPO loss (`dpo_terms`) of a preference batch averaged over its pairs, with temperature
    beta against the reference: the frozen base under LoRA (adapters off), the state's reference params in full
    fine-tuning (init_state(..., reference=True)), none with reference_free. accum_steps: split the batch into
    that many micro-batches, run one at a time and sum their gradients weighted by their target-token (pair)
    counts, so the update equals one step over the whole batch. compute_dtype: the forward's weight dtype (e.g.
    bfloat16 on GPU/TPU; keep float32 on the CPU); remat: recompute each layer in the backward pass.
    metrics: loss, grad_norm (before clipping), tokens (target count), lr; DPO adds rewards/chosen,
    rewards/rejected, rewards/margins and rewards/accuracies, means over the pairs (as TRL logs them).
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if not (isinstance(beta, (int, float)) and 0 < beta < float("inf")):
        raise ValueError(f"beta must be a finite number > 0, got {beta!r}")
    options = dict(remat=remat, compute_dtype=compute_dtype)

    def objective(trained, state: TrainState, batch: dict) -> tuple[jax.Array, dict]:
        """(the summed loss, {"count": what it is averaged over, "tokens", and sums averaged likewise})."""
        params, adapters = (state.params, trained) if lora is not None else (trained, None)
        constrain = state.layout.constrain if state.layout is not None else None
        if method == "sft":
            total, count = loss_sum(params, state.config, batch, lora=adapters, constrain=constrain, **options)
            return total, {"count": count, "tokens": count}
        total, sums = dpo_sums(params, state.config, batch, beta=beta, reference=state.reference,
                               reference_free=reference_free, lora=adapters, constrain=constrain, **options)
        return total, {"count": sums.pop("pairs"), **sums}

    gradient = jax.value_and_grad(objective, has_aux=True)

    def update(state: TrainState, kept: dict, batch: dict) -> tuple[TrainState, dict]:
        state = state.replace(**kept)
        if accum_steps == 1:
            (total, stats), grads = gradient(state.trained, state, batch)
        else:
            micro = micro_batches(batch, accum_steps)

            def accumulate(carry, micro):
                value = gradient(state.trained, state, micro)
                return jax.tree.map(lambda a, b: a + b.astype(jnp.float32), carry, value), None

            shapes = jax.eval_shape(gradient, state.trained, state, jax.tree.map(lambda x: x[0], micro))
            zero = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), shapes)
            ((total, stats), grads), _ = jax.lax.scan(accumulate, zero, micro)
        denominator = jnp.maximum(stats.pop("count"), 1)
        grads = jax.tree.map(lambda g, w: (g / denominator).astype(w.dtype), grads, state.trained)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.trained)
        trained = optax.apply_updates(state.trained, updates)
        state = state.replace(step=state.step + 1, opt_state=opt_state,
                              **({"lora": trained} if lora is not None else {"params": trained}))
        metrics = {"loss": total / denominator, "grad_norm": optax.tree.norm(grads), "tokens": stats.pop("tokens"),
                   "lr": learning_rate(opt_state), **{name: value / denominator for name, value in stats.items()}}
        return state.replace(**{name: None for name in kept}), metrics

    update = jax.jit(update, donate_argnums=0)

    def step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        if (lora is None) != (state.lora is None):
            raise ValueError("make_train_step(lora=...) needs a state with adapters (init_state(..., lora=...)), "
                             "and lora=None one without")
        if method == "dpo" and lora is None and not reference_free and state.reference is None:
            raise ValueError("DPO's full fine-tuning needs the frozen reference params in the state "
                             "(init_state(..., reference=True)), or reference_free=True")
        kept = {name: getattr(state, name) for name in ("params", "reference")
                if getattr(state, name) is not None and (name == "reference" or lora is not None)}
        new, metrics = update(state.replace(**{name: None for name in kept}), kept, batch)
        return new.replace(**kept), metrics

    return step


@functools.partial(jax.jit, static_argnames=("config", "remat", "compute_dtype"))
def gradients(params: Params, config: Config, batch: dict, *, lora: Lora | None = None, remat: bool = False,
              compute_dtype=None):
    """(loss, gradient) of `loss` with respect to the params, or to the adapters when `lora` is given. Jitted."""
    options = dict(remat=remat, compute_dtype=compute_dtype)
    if lora is None:
        return jax.value_and_grad(lambda p: loss(p, config, batch, **options))(params)
    return jax.value_and_grad(lambda adapters: loss(params, config, batch, lora=adapters, **options))(lora)


__all__ = ["METHODS", "TrainState", "dpo_loss", "dpo_sums", "dpo_terms", "gradients", "init_state", "learning_rate",
           "loss", "loss_sum", "make_train_step", "optimizer", "positions_from_segments", "sequence_logps",
           "shard_batch", "token_losses"]
