"""`finetune`: a whole run on a loaded Model, resumable. It neither loads nor exports: the caller does
(`linnet-jax finetune` loads `--model`, then exports the result with `linnet_jax.export.hf` and `.peft`).

    out_dir/
      metrics.jsonl   one JSON line per step: step, loss, grad_norm, tokens, lr (and tokens_per_s)
      checkpoints/    Orbax checkpoints (see checkpoints.py); resume=True continues from the latest
"""

import dataclasses
import json
import time
from pathlib import Path

import jax
from tqdm import tqdm

from linnet_jax.loaded import Model
from linnet_jax.models.lora import LoraConfig
from linnet_jax.train.checkpoints import Checkpoints
from linnet_jax.train.data import Batches, load_documents
from linnet_jax.train.lora import merge_lora
from linnet_jax.train.step import TrainState, init_state, make_train_step, optimizer, shard_batch


@dataclasses.dataclass
class Result:
    """What a run returns: its last state (the trained params, or the adapters over the frozen base params),
    the fine-tuned model (LoRA merged: what `linnet_jax.export.hf` writes), each step's metrics, and how
    many records were cut to seq_len."""

    state: TrainState
    model: Model
    metrics: list[dict]
    truncated: int


def read_metrics(path: Path, through: int) -> list[dict]:
    """The metrics lines of steps 1..through (a resumed run drops what an interrupted one logged after its
    last checkpoint)."""
    if not path.is_file():
        return []
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [line for line in lines if line["step"] <= through]


def tuned_model(model: Model, state: TrainState) -> Model:
    """`model` with the state's params, and its adapters merged into them when the run trained LoRA."""
    tuned = dataclasses.replace(model, params=state.params)
    return tuned if state.lora is None else merge_lora(tuned, state.lora)


def finetune(model: Model, data, out_dir, *, lora: LoraConfig | None = LoraConfig(), steps: int = 100,
             batch_size: int = 4, seq_len: int = 512, lr: float = 1e-4, warmup: int = 0, accum_steps: int = 1,
             save_every: int = 100, keep: int = 3, resume: bool = False, seed: int = 0, packing: bool = True,
             truncate: bool = False, remat: bool = False, compute_dtype=None, progress: bool = True) -> Result:
    """Fine-tune `model` (a Model with a tokenizer) on the JSON Lines file `data`, writing out_dir as the module
    docstring lays out; returns the last state and the fine-tuned model.

    lora: adapters of that rank and alpha on its targets (default rank 8, alpha 16, all seven projections);
    None trains every weight. A step runs accum_steps micro-batches of batch_size rows of seq_len tokens
    (packed unless packing=False), one at a time: one update over batch_size × accum_steps rows. The learning
    rate warms up over `warmup` steps, then decays by a cosine to a tenth at `steps`. resume=True continues
    from the latest checkpoint in out_dir/checkpoints (step, weights, optimizer state, data position); without
    it an out_dir that has checkpoints is an error.
    """
    if model.tokenizer is None:
        raise ValueError("finetune needs a model with a tokenizer to encode the data")
    out = Path(out_dir)
    documents, truncated = load_documents(data, model.tokenizer, seq_len, truncate=truncate)
    batches = Batches(documents, batch_size * accum_steps, seq_len, seed=seed, packing=packing)
    tx = optimizer(lr, steps=steps, warmup=warmup)
    state = init_state(model, tx, lora=lora, seed=seed)
    step_fn = make_train_step(tx, lora=lora, accum_steps=accum_steps, compute_dtype=compute_dtype, remat=remat)
    metrics_path = out / "metrics.jsonl"
    with Checkpoints(out / "checkpoints", save_every=save_every, keep=keep) as checkpoints:
        if checkpoints.latest_step() is not None and not resume:
            raise FileExistsError(f"{out / 'checkpoints'} holds checkpoints (last step {checkpoints.latest_step()}); "
                                  "pass resume=True (--resume) to continue, or choose another output directory")
        if resume and checkpoints.latest_step() is not None:
            state, position = checkpoints.restore(state)
            batches.set_state(position)
        done = int(state.step)
        history = read_metrics(metrics_path, done)
        out.mkdir(parents=True, exist_ok=True)
        metrics_path.write_text("".join(json.dumps(m) + "\n" for m in history))
        with metrics_path.open("a") as log, tqdm(total=steps, initial=done, desc="finetune", unit="step",
                                                 disable=not progress) as bar:
            for _ in range(done, steps):
                batch = next(batches)
                start = time.perf_counter()
                state, metrics = step_fn(state, shard_batch(batch, state.layout))
                record = {"step": int(state.step), **{k: float(v) for k, v in jax.device_get(metrics).items()}}
                record["tokens_per_s"] = int((batch["segment_ids"] > 0).sum()) / (time.perf_counter() - start)
                log.write(json.dumps(record) + "\n")
                log.flush()
                history.append(record)
                checkpoints.save(state, batches.get_state(), force=record["step"] == steps)
                bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
                bar.update()
    return Result(state, tuned_model(model, state), history, truncated)
