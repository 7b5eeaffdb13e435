"""Runs the train step on 8 fake CPU devices and prints one JSON line of results; tests/test_train_sharded.py
starts it:

    python tests/train_worker.py DIR CHECKPOINT_DIR    # DIR: a tiny HF directory whose heads divide the meshes

Each case loads the model on a mesh, trains a few steps (full fine-tuning and LoRA) on the same batches and
reports the losses; the test compares them with one device. A checkpoint saved on fsdp=8 is restored onto
data=2 × fsdp=4 and trained one more step.
"""

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import json  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

import linnet_jax  # noqa: E402
from linnet_jax import sharding, train  # noqa: E402

STEPS = 3
LORA = train.LoraConfig(rank=8, alpha=16, targets=("q_proj", "v_proj", "down_proj"))
CASES = {"one device": (None, None), "fsdp=8": (dict(fsdp=8), "fsdp"), "dp=2 x tp=4": (dict(data=2, tensor=4), "tp"),
         "fsdp=4 x tp=2": (dict(fsdp=4, tensor=2), "fsdp_tp")}
LORA_CASES = ("one device", "dp=2 x tp=4")


def batches(vocab: int) -> list[dict]:
    """STEPS + 1 batches of 8 packed rows of 32 tokens, made from random documents."""
    rng = np.random.default_rng(0)
    documents = []
    for i in range(40):
        n = int(rng.integers(4, 30))
        documents.append(train.Document(rng.integers(0, vocab, n).astype(np.int32), np.ones(n, np.int32), f"doc {i}"))
    stream = train.Batches(documents, batch_size=8, seq_len=32, seed=1)
    return [next(stream) for _ in range(STEPS + 1)]


def load(directory: str, mesh_axes, rules):
    if mesh_axes is None:
        return linnet_jax.load(directory, progress=False)
    return linnet_jax.load(directory, mesh=sharding.mesh(**mesh_axes), rules=rules, progress=False)


def run(model, data: list[dict], lora, steps: int = STEPS, state=None):
    """Losses of `steps` steps and the final state."""
    optimizer = train.optimizer(1e-3)
    state = state or train.init_state(model, optimizer, lora=lora, seed=0)
    step = train.make_train_step(optimizer, lora=lora)
    losses = []
    for batch in data[int(state.step):int(state.step) + steps]:
        state, metrics = step(state, train.shard_batch(batch, model.layout))
        losses.append(float(metrics["loss"]))
    return losses, state


def placed_like_params(state) -> bool:
    """Whether Adam's first moment of each trained array has that array's sharding."""
    adam = next(s for s in jax.tree.leaves(state.opt_state, is_leaf=lambda s: hasattr(s, "mu")) if hasattr(s, "mu"))
    return all(m.sharding.is_equivalent_to(p.sharding, p.ndim)
               for m, p in zip(jax.tree.leaves(adam.mu), jax.tree.leaves(state.trained)))


def main(directory: str, checkpoint_dir: str) -> None:
    results = {"devices": jax.device_count(), "cases": {}}
    data = None
    for case, (mesh_axes, rules) in CASES.items():
        model = load(directory, mesh_axes, rules)
        data = data or batches(model.config.vocab_size)
        full, state = run(model, data, None)
        lora = run(model, data, LORA)[0] if case in LORA_CASES else None
        split = {name: len(array.sharding.device_set) > 1 and array.addressable_shards[0].data.size < array.size
                 for name, array in {"embed": state.params.embed, "w_gate": state.params.layers.w_gate}.items()}
        results["cases"][case] = {"full": full, "lora": lora, "opt_state_placed_like_params": placed_like_params(state),
                                  "split": split}
    # A checkpoint saved on fsdp=8 after 2 steps restores onto data=2 x fsdp=4 and continues.
    saved_on = load(directory, dict(fsdp=8), "fsdp")
    _, state = run(saved_on, data, None, steps=2)
    with train.Checkpoints(checkpoint_dir) as checkpoints:
        checkpoints.save(state, {"epoch": 0, "row": 16}, force=True)
    restored_on = load(directory, dict(data=2, fsdp=4), "fsdp")
    fresh = train.init_state(restored_on, train.optimizer(1e-3))
    with train.Checkpoints(checkpoint_dir) as checkpoints:
        state, position = checkpoints.restore(fresh)
    results["restored"] = {"step": int(state.step), "position": position,
                           "mesh": dict(state.params.layers.wq.sharding.mesh.shape),
                           "opt_state_placed_like_params": placed_like_params(state)}
    results["restored"]["loss_step_3"] = run(restored_on, data, None, steps=1, state=state)[0][0]
    print(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:])
