"""`finetune`: a whole run on a loaded Model, resumable. It neither loads nor exports: the caller does
(`linnet-jax finetune` loads `--model`, then exports the result with `linnet_jax.export.hf` and `.peft`).

    out_dir/
      metrics.jsonl   one JSON line per step: step, loss, grad_norm, tokens, lr (and tokens_per_s); DPO adds
                      rewards/chosen, rewards/rejected, rewards/margins, rewards/accuracies; every eval_every
                      steps, lm-eval's results on eval_tasks as "eval/<task>/<metric>,<filter>"
      checkpoints/    Orbax checkpoints (see checkpoints.py); resume=True continues from the latest

A non-empty out_dir is refused unless the run resumes there (resume=True) or starts again over what finetune
writes there (overwrite=True).
"""

import dataclasses
import hashlib
import json
import math
import shutil
import time
from pathlib import Path

import jax
from tqdm import tqdm

from linnet_jax.loaded import Model
from linnet_jax.models.config import QUANTIZE
from linnet_jax.models.lora import LoraConfig
from linnet_jax.train.checkpoints import Checkpoints, latest_saved_step
from linnet_jax.train.data import Batches, DataError, json_lines, load_documents, load_pairs
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


# What finetune and `linnet-jax finetune` write in out_dir: what overwrite=True replaces.
OUTPUTS = ("metrics.jsonl", "checkpoints", "model", "adapter")
# The settings a checkpoint's data position means something with (run_settings), and the flag of each.
SETTING_FLAGS = {"data_sha256": "--data", "seq_len": "--seq-len", "batch_size": "--batch-size",
                 "accum_steps": "--accum-steps", "packing": "--no-packing", "seed": "--seed", "dtype": "--dtype",
                 "method": "--method"}


def check_out_dir(out: Path, *, resume: bool, overwrite: bool) -> None:
    """Refuse to run in `out` when it is not a directory, or is a non-empty one and the run neither resumes
    (resume) nor starts again over what finetune writes there (overwrite): an error naming it."""
    if resume and overwrite:
        raise ValueError("resume and overwrite exclude each other: resume continues the run in out_dir, overwrite "
                         "starts again")
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"{out} is not a directory; expected the output directory of a run")
    if resume or overwrite or not out.exists() or not any(out.iterdir()):
        return
    latest = latest_saved_step(out / "checkpoints")
    run = "" if latest is None else f": {out / 'checkpoints'} holds checkpoints (last step {latest})"
    raise FileExistsError(f"{out} already exists and is not empty{run}; pass resume=True (--resume) to continue the "
                          f"run there, overwrite=True (--overwrite) to start again over what finetune writes there "
                          f"({', '.join(OUTPUTS)}), or choose another output directory")


def read_metrics(path: Path, through: int) -> list[dict]:
    """The metrics lines of steps 1..through (a resumed run drops what an interrupted one logged after its
    last checkpoint); a line that is not one finetune wrote is a DataError naming it."""
    if not path.is_file():
        return []
    lines = []
    for where, line in json_lines(path):
        if not (isinstance(line, dict) and isinstance(line.get("step"), int)):
            raise DataError(f'{where}: expected a JSON object with an int "step", as finetune writes, got {line!r:.80}')
        lines.append(line)
    return [line for line in lines if line["step"] <= through]


def run_settings(model: Model, data, *, seq_len: int, batch_size: int, accum_steps: int, packing: bool,
                 seed: int, method: str = "sft") -> dict:
    """What a checkpoint's data position means something with: the data file's contents (sha256), how its
    records are read (the method) and cut into batches, and the params' dtype."""
    with open(data, "rb") as file:
        digest = hashlib.file_digest(file, "sha256").hexdigest()
    return {"data_sha256": digest, "seq_len": seq_len, "batch_size": batch_size, "accum_steps": accum_steps,
            "packing": packing, "seed": seed, "dtype": model.config.dtype, "method": method}


def check_settings(saved: dict | None, settings: dict, where: str) -> None:
    """A ValueError naming each setting of this run that differs from those a checkpoint was saved with."""
    saved = saved or {}
    changed = [f"{SETTING_FLAGS[name]} ({name}: {saved.get(name)!r} then, {value!r} now)"
               for name, value in settings.items() if saved.get(name) != value]
    if changed:
        raise ValueError(f"{where} was saved with other settings, so its data position means nothing in this run: "
                         f"{'; '.join(changed)}. Resume with the settings it was saved with, or pass "
                         "resume_anyway=True (--resume-anyway) to resume regardless")


class Diverged(ValueError):
    """A step's loss or gradient norm is not finite: training diverged."""


def check_finite(record: dict, checkpoints: Checkpoints) -> None:
    """A Diverged error when a step's loss or gradient norm is not finite, naming the step and the last checkpoint."""
    if not (math.isfinite(record["loss"]) and math.isfinite(record["grad_norm"])):
        latest = checkpoints.latest_step()
        raise Diverged(f"step {record['step']}: the loss is {record['loss']} and the gradient norm "
                       f"{record['grad_norm']}: training diverged (at a learning rate of {record['lr']:.3g}); nothing "
                       "of this step was saved ("
                       + ("no checkpoint yet" if latest is None else f"the last checkpoint is step {latest}")
                       + "). Lower the learning rate (--lr) and start again")


def tuned_model(model: Model, state: TrainState) -> Model:
    """`model` with the state's params, and its adapters merged into them when the run trained LoRA."""
    tuned = dataclasses.replace(model, params=state.params)
    return tuned if state.lora is None else merge_lora(tuned, state.lora)


def evaluation(model: Model, tasks, include_path, limit) -> dict[str, float]:
    """lm-eval's numbers for the model on the tasks, as metrics.jsonl's "eval/<task>/<metric>,<filter>" fields."""
    from linnet_jax.eval import evaluate, metric_values

    return {f"eval/{name}": value for name, value in metric_values(evaluate(model, tasks, include_path=include_path,
                                                                            limit=limit)).items()}


def finetune(model: Model, data, out_dir, *, lora: LoraConfig | None = LoraConfig(), steps: int = 100,
             batch_size: int = 4, seq_len: int = 512, lr: float = 1e-4, warmup: int = 0, accum_steps: int = 1,
             save_every: int = 100, keep: int = 3, resume: bool = False, resume_anyway: bool = False,
             overwrite: bool = False, seed: int = 0, packing: bool = True, truncate: bool = False,
             remat: bool = False, compute_dtype=None, method: str = "sft", beta: float = 0.1,
             reference_free: bool = False, eval_tasks=None, eval_every: int | None = None, eval_include_path=None,
             eval_limit: float | None = None, quantize: str | None = None, progress: bool = True) -> Result:
    """Fine-tune `model` (a Model with a tokenizer) on the JSON Lines file `data`, writing out_dir as the module
    docstring lays out; returns the last state and the fine-tuned model.

    lora: adapters of that rank and alpha on its targets (default rank 8, alpha 16, all seven projections);
    None trains every weight. A step runs accum_steps micro-batches of batch_size rows of seq_len tokens
    (packed unless packing=False), one at a time: one update over batch_size × accum_steps rows. The learning
    rate warms up over `warmup` steps, then decays by a cosine to a tenth at `steps`.
    out_dir must be empty or new, unless: resume=True continues from the latest checkpoint in
    out_dir/checkpoints (step, weights, optimizer state, data position), and appends to its metrics, refusing
    a checkpoint saved with other settings (`run_settings`: the data, seq_len, batch_size, ...) unless
    resume_anyway=True (which implies resume); overwrite=True starts again, replacing out_dir's metrics.jsonl
    and checkpoints/ (`linnet-jax finetune` then replaces its model/ and adapter/ exports) and leaving anything
    else there.
    method: "sft" (records as `load_documents` reads them) or "dpo": preference records (`load_pairs`: a prompt or
    messages, a chosen and a rejected reply), batch_size pairs a micro-batch, one reply a row (never packed),
    the sigmoid DPO loss with temperature beta against the reference: the frozen base under LoRA (the adapters
    off; no second copy), a frozen copy of the initial params in full fine-tuning (the model's own arrays),
    none with reference_free.
    eval_tasks (lm-eval task names, a list or one comma-separated string; lm-eval needed): every eval_every steps
    (default: at the last step only) and at the last, run lm-eval on the model as trained so far
    (`linnet_jax.eval.evaluate`, tasks of eval_include_path added, eval_limit documents per task) and add its
    numbers to that step's line of metrics.jsonl.
    quantize: "int8" trains LoRA adapters over the model's products' weights as int8 (QLoRA; `Model.quantized`):
    the base gets no gradient and no float copy. A model loaded quantized (`load(..., quantize="int8")`) trains so
    too. Its fine-tuned model (`Result.model`) has the adapters merged into the dequantized weights.
    A step whose loss or gradient norm is not finite stops the run with a `Diverged` error.
    """
    if model.tokenizer is None:
        raise ValueError("finetune needs a model with a tokenizer to encode the data")
    if quantize not in (None, *QUANTIZE):
        raise ValueError(f"quantize must be None or one of {QUANTIZE}, got {quantize!r}")
    model = model.quantized() if quantize else model
    if model.quantization and lora is None:
        raise ValueError(f"the model's weights are {model.quantization}: they train only under LoRA adapters "
                         "(QLoRA); pass lora=LoraConfig(...), or fine-tune the float model")
    out = Path(out_dir)
    resume = resume or resume_anyway
    check_out_dir(out, resume=resume, overwrite=overwrite)
    if eval_every is not None and not eval_tasks:
        raise ValueError("eval_every needs eval_tasks (--eval-tasks), the lm-eval tasks to run")
    if eval_tasks:
        from linnet_jax.eval import tasks_to_run

        tasks_to_run(eval_tasks, eval_include_path)  # an unknown task is refused before training, not after
    tx = optimizer(lr, steps=steps, warmup=warmup)
    step_fn = make_train_step(tx, lora=lora, accum_steps=accum_steps, compute_dtype=compute_dtype, remat=remat,
                              method=method, beta=beta, reference_free=reference_free)
    if method == "dpo":
        packing, rows = False, 2 * batch_size  # a pair is two rows, one reply each
        documents, truncated = load_pairs(data, model.tokenizer, seq_len, truncate=truncate)
    else:
        rows = batch_size
        documents, truncated = load_documents(data, model.tokenizer, seq_len, truncate=truncate)
    settings = run_settings(model, data, seq_len=seq_len, batch_size=batch_size, accum_steps=accum_steps,
                            packing=packing, seed=seed, method=method)
    batches = Batches(documents, rows * accum_steps, seq_len, seed=seed, packing=packing)
    state = init_state(model, tx, lora=lora, seed=seed, reference=method == "dpo" and not reference_free)
    metrics_path = out / "metrics.jsonl"
    if overwrite:
        shutil.rmtree(out / "checkpoints", ignore_errors=True)
        metrics_path.unlink(missing_ok=True)
    with Checkpoints(out / "checkpoints", save_every=save_every, keep=keep) as checkpoints:
        if resume and (latest := checkpoints.latest_step()) is not None:
            if not resume_anyway:
                check_settings(checkpoints.settings(latest), settings,
                               f"the checkpoint of step {latest} in {checkpoints.directory}")
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
                check_finite(record, checkpoints)
                if eval_tasks and (record["step"] == steps or (eval_every and record["step"] % eval_every == 0)):
                    record |= evaluation(tuned_model(model, state), eval_tasks, eval_include_path, eval_limit)
                log.write(json.dumps(record) + "\n")
                log.flush()
                history.append(record)
                checkpoints.save(state, batches.get_state(), settings=settings, force=record["step"] == steps)
                bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
                bar.update()
    return Result(state, tuned_model(model, state), history, truncated)
