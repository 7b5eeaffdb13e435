"""Fine-tuning throughput on this CPU: linnet_jax's train step against transformers + torch AdamW.

    python benchmarks/train.py [--steps 3] [--warmups 1] [--batch 4] [--seq-len 512] [--no-write]

SmolLM2-135M-Instruct in float32 (the embedded GGUF, each system loading the same file), batch 4 of 512
random ids (seed 0, every token a target), AdamW (lr 1e-5, no weight decay, no clipping). Rows: full
fine-tuning and LoRA r=8 (alpha 16, all seven projections), for linnet_jax (`train.make_train_step`, jitted,
donated state) and for transformers (sdpa attention) with torch.optim.AdamW (PEFT's LoRA for the LoRA row); and
linnet_jax's QLoRA (the same LoRA over the model loaded with quantize="int8"), against transformers' LoRA (torch has
no int8 training on the CPU: bitsandbytes' 8-bit layers are CUDA's); and DPO (sigmoid loss, beta 0.1) over the same
LoRA, linnet_jax's (`make_train_step(method="dpo")`: the reference is the base with the adapters off) against TRL's
DPOTrainer on PEFT (its `compute_loss`, whose reference is also the base with the adapters off): the batch's rows are
pairs (chosen, rejected), each row's second half its reply.
Each row runs in its own process (so peak RSS is its own): warm-up steps (compilation included), then the
median step time of the timed ones. tokens/s = batch × seq_len / step time. The first step's loss of each row is
compared with transformers' on the same weights and batch (|Δloss|, the distance from the reference). Prints a
markdown table and rewrites the block between `<!-- train-table:start -->` and `<!-- train-table:end -->` in
RESULTS.md (--no-write only prints; --json PATH also writes the rows as JSON, which benchmarks/page.py renders).
A row whose packages are missing says so and how to install them; a row that fails says so with its error's last
line.
"""

import argparse
import sys
from pathlib import Path

from decode import pretrained_source
from harness import (TORCH_INSTALL, command_line, median, missing_modules, peak_rss_gib, ratio, reply_once,
                     run_worker, timed, write_json, write_results)

ROWS = ("linnet_jax full", "transformers full", "linnet_jax LoRA r=8", "transformers LoRA r=8",
        "linnet_jax QLoRA r=8 (int8)", "linnet_jax DPO LoRA r=8", "TRL DPO LoRA r=8")
PEERS = {"linnet_jax full": "transformers full", "linnet_jax LoRA r=8": "transformers LoRA r=8",
         "linnet_jax QLoRA r=8 (int8)": "transformers LoRA r=8",
         "linnet_jax DPO LoRA r=8": "TRL DPO LoRA r=8"}  # the row each is compared with
BETA = 0.1
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MARKS = ("<!-- train-table:start -->", "<!-- train-table:end -->")
LR = 1e-5
PEFT_INSTALL = "pip install peft==0.21.2"
TRL_INSTALL = "pip install trl==1.16.0"


def batch(vocab: int, rows: int, length: int, preference: bool = False):
    """rows × length random ids (seed 0); every token a target, or, for a preference batch, the second half of each
    row (its reply; rows 2p and 2p + 1 the chosen and rejected replies of pair p)."""
    import numpy as np

    tokens = np.random.default_rng(0).integers(0, vocab, (rows, length)).astype(np.int32)
    mask = np.ones_like(tokens)
    if preference:
        mask[:, :length // 2] = 0
    return {"tokens": tokens, "loss_mask": mask}


def linnet_jax_steps(lora: bool, args, quantize: str | None = None, method: str = "sft") -> tuple[list[float], float]:
    """(step seconds, first loss) of linnet_jax's jitted step (over the model loaded with `quantize`)."""
    import jax

    import linnet_jax
    from linnet_jax import train

    model = linnet_jax.load(args.model_path, quantize=quantize, progress=False)
    config = train.LoraConfig(rank=8, alpha=16) if lora else None
    optimizer = train.optimizer(LR, clip=None)
    state = train.init_state(model, optimizer, lora=config)
    step = train.make_train_step(optimizer, lora=config, method=method, beta=BETA)
    data = train.shard_batch(batch(model.config.vocab_size, args.batch, args.seq_len, method == "dpo"), None)

    def one_step(state):
        state, metrics = step(state, data)
        return state, float(jax.block_until_ready(metrics["loss"]))

    return timed_steps(one_step, state, args)


def transformers_model(args):
    """transformers' model of the benchmark's file (float32, sdpa attention), and its (source, options)."""
    import torch
    import transformers

    from linnet_jax.load import default_model_path

    torch.set_num_threads(args.threads)
    source, options = pretrained_source(args.model_path or default_model_path())
    model = transformers.AutoModelForCausalLM.from_pretrained(source, **options, dtype=torch.float32,
                                                              attn_implementation="sdpa")
    return model, (source, options)


def peft_config():
    """PEFT's LoRA r=8, alpha 16, on the seven projections: the torch rows' adapters, as linnet_jax's LoRA rows'."""
    import peft

    return peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=list(TARGETS))


def transformers_steps(lora: bool, args) -> tuple[list[float], float]:
    """(step seconds, first loss) of transformers' model with torch.optim.AdamW."""
    import torch

    model, _ = transformers_model(args)
    if lora:
        import peft

        model = peft.get_peft_model(model, peft_config())
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    data = batch(model.config.vocab_size, args.batch, args.seq_len)
    tokens = torch.tensor(data["tokens"], dtype=torch.long)

    def one_step(state):  # None: torch's model and optimizer keep their own state
        logits = model(tokens).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return state, loss.item()

    return timed_steps(one_step, None, args)


def trl_dpo_steps(args) -> tuple[list[float], float]:
    """(step seconds, first loss) of TRL's DPOTrainer.compute_loss over a PEFT LoRA model (the reference: the base,
    adapters off), backward and torch.optim.AdamW."""
    import tempfile

    import torch
    import transformers
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    model, (source, options) = transformers_model(args)
    model.is_quantized, model.hf_quantizer = False, None  # GGUF's, though its weights are float32: Trainer refuses it
    tokenizer = transformers.AutoTokenizer.from_pretrained(source, **options)
    with tempfile.TemporaryDirectory() as scratch:
        config = DPOConfig(output_dir=scratch, beta=BETA, loss_type=["sigmoid"], report_to=[], use_cpu=True,
                           bf16=False, logging_strategy="no", save_strategy="no")
        trainer = DPOTrainer(model=model, args=config, peft_config=peft_config(), processing_class=tokenizer,
                             train_dataset=Dataset.from_list([{"prompt": "a", "chosen": " b", "rejected": " c"}]))
    trainer.model.train()
    optimizer = torch.optim.AdamW([p for p in trainer.model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    data = batch(model.config.vocab_size, args.batch, args.seq_len, preference=True)
    order = list(range(0, args.batch, 2)) + list(range(1, args.batch, 2))  # TRL's layout: chosen rows, then rejected
    inputs = {"input_ids": torch.tensor(data["tokens"][order], dtype=torch.long),
              "attention_mask": torch.ones(data["tokens"].shape, dtype=torch.long),
              "completion_mask": torch.tensor(data["loss_mask"][order], dtype=torch.long)}

    def one_step(state):
        loss = trainer.compute_loss(trainer.model, inputs)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return state, loss.item()

    return timed_steps(one_step, None, args)


def timed_steps(one_step, state, args) -> tuple[list[float], float]:
    """(the step seconds after the warm-ups, the first step's loss) of `args.warmups + args.steps` calls of
    one_step(state) -> (state, loss)."""
    times, losses = [], []
    for _ in range(args.warmups + args.steps):
        seconds, (state, loss) = timed(one_step, state)
        times.append(seconds)
        losses.append(loss)
    return times[args.warmups:], losses[0]


def child(row: str, args) -> dict:
    lora = "LoRA" in row
    if row.startswith("linnet_jax"):
        times, first = linnet_jax_steps(lora, args, "int8" if "int8" in row else None, "dpo" if "DPO" in row else "sft")
    elif row.startswith("TRL"):
        times, first = trl_dpo_steps(args)
    else:
        times, first = transformers_steps(lora, args)
    step = median(times)
    return {"row": row, "step_s": step, "tokens_per_s": args.batch * args.seq_len / step, "first_loss": first,
            "peak_rss_mib": peak_rss_gib() * 1024}


def missing(row: str) -> str | None:
    """"not installed: ..." for a transformers row whose packages are absent, else None."""
    if row.startswith("linnet_jax"):
        return None
    if row.startswith("TRL"):
        return missing_modules(("torch", "transformers", "peft", "trl", "datasets"),
                               f"{TORCH_INSTALL} && {PEFT_INSTALL} && {TRL_INSTALL}")
    if "LoRA" in row:
        return missing_modules(("torch", "transformers", "peft"), f"{TORCH_INSTALL} && {PEFT_INSTALL}")
    return missing_modules(("torch", "transformers"), TORCH_INSTALL)


def run_row(row: str) -> dict:
    """One row in its own process: its result, or {"row", "error"} (not installed, or the failure)."""
    if (why := missing(row)) is not None:
        return {"row": row, "error": why}
    return {"row": row} | run_worker([sys.executable, str(Path(__file__).resolve()), "--child", row, *sys.argv[1:]])


def compare(results: list[dict]) -> list[dict]:
    """Each result with `vs_transformers` (its tokens/s over its torch peer's, `PEERS`; the peers' rows their own) and
    `loss_distance` (|first loss − the peer's|), None where that row did not run."""
    reference = {r["row"]: r for r in results if not r["row"].startswith("linnet_jax") and "error" not in r}
    compared = []
    for r in results:
        ref = None if "error" in r else reference.get(PEERS.get(r["row"], r["row"]))
        compared.append(r | {"vs_transformers": ref and ratio(r["tokens_per_s"], ref["tokens_per_s"]),
                             "loss_distance": ref and abs(r["first_loss"] - ref["first_loss"])})
    return compared


def table(results: list[dict], args) -> str:
    lines = [f"SmolLM2-135M-Instruct float32, batch {args.batch} × {args.seq_len} tokens, AdamW; median of "
             f"{args.steps} steps after {args.warmups} warm-up; {args.threads} threads. DPO: {args.batch // 2} pairs, "
             f"beta {BETA}.", "",
             "| row | step (s) | tokens/s | × torch peer | peak RSS (MiB) | first loss | |Δloss| vs the peer |",
             "|---|---|---|---|---|---|---|"]
    for r in compare(results):
        if "error" in r:
            lines.append(f"| {r['row']} | {r['error']} | - | - | - | - | - |")
            continue
        ratio = "-" if r["vs_transformers"] is None else f"{r['vs_transformers']:.2f}×"
        delta = "-" if r["loss_distance"] is None else f"{r['loss_distance']:.1e}"
        lines.append(f"| {r['row']} | {r['step_s']:.2f} | {r['tokens_per_s']:.0f} | {ratio} | {r['peak_rss_mib']:.0f} | "
                     f"{r['first_loss']:.4f} | {delta} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmups", type=int, default=1)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2, help="torch's intra-op threads")
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows to run")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the rows as JSON to PATH")
    parser.add_argument("--model-path", type=Path, help="a GGUF file or HF directory (default: SmolLM2's GGUF)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        sys.exit(reply_once(lambda: child(args.child, args)))
    results = []
    for row in args.rows.split(","):
        results.append(run_row(row))
        print(results[-1], file=sys.stderr)
    text = table(results, args)
    print(text)
    if args.json:
        command = command_line("train.py", sys.argv[1:])
        write_json(args.json, "train", compare(results), args, command, skip=("json", "no_write", "child"))
    if not args.no_write:
        write_results(text, MARKS, heading="## Fine-tuning\n\n")


if __name__ == "__main__":
    main()
