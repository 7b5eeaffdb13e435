"""Fine-tuning throughput on this CPU: linnet_jax's train step against transformers + torch AdamW.

    python benchmarks/train.py [--steps 3] [--warmups 1] [--batch 4] [--seq-len 512] [--no-write]

SmolLM2-135M-Instruct in float32 (the embedded GGUF, each system loading the same file), batch 4 of 512
random ids (seed 0, every token a target), AdamW (lr 1e-5, no weight decay, no clipping). Rows: full
fine-tuning and LoRA r=8 (alpha 16, all seven projections), for linnet_jax (`train.make_train_step`, jitted,
donated state) and for transformers (sdpa attention) with torch.optim.AdamW (PEFT's LoRA for the LoRA row).
Each row runs in its own process (so peak RSS is its own): warm-up steps (compilation included), then the
median step time of the timed ones. tokens/s = batch × seq_len / step time. The first step's loss of each row is
compared with transformers' on the same weights and batch (|Δloss|, the distance from the reference). Prints a
markdown table and rewrites the block between `<!-- train-table:start -->` and `<!-- train-table:end -->` in
RESULTS.md (--no-write only prints; --json PATH also writes the rows as JSON, which benchmarks/page.py renders).
A row whose packages are missing says so and how to install them; a row that fails says so with its error's last
line.
"""

import argparse
import json
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from decode import TORCH_INSTALL, missing_modules, peak_rss_gib, pretrained_source, write_json

ROWS = ("linnet_jax full", "transformers full", "linnet_jax LoRA r=8", "transformers LoRA r=8")
RESULTS = Path(__file__).with_name("RESULTS.md")
LR = 1e-5
PEFT_INSTALL = "pip install peft==0.21.2"


def batch(vocab: int, rows: int, length: int):
    import numpy as np

    tokens = np.random.default_rng(0).integers(0, vocab, (rows, length)).astype(np.int32)
    return {"tokens": tokens, "loss_mask": np.ones_like(tokens)}


def linnet_jax_steps(lora: bool, args) -> tuple[list[float], float]:
    """(step seconds, first loss) of linnet_jax's jitted step."""
    import jax

    import linnet_jax
    from linnet_jax import train

    model = linnet_jax.load(args.model_path, progress=False)
    config = train.LoraConfig(rank=8, alpha=16) if lora else None
    optimizer = train.optimizer(LR, clip=None)
    state = train.init_state(model, optimizer, lora=config)
    step = train.make_train_step(optimizer, lora=config)
    data = train.shard_batch(batch(model.config.vocab_size, args.batch, args.seq_len), None)
    times, first = [], None
    for _ in range(args.warmups + args.steps):
        start = time.perf_counter()
        state, metrics = step(state, data)
        loss = float(jax.block_until_ready(metrics["loss"]))
        times.append(time.perf_counter() - start)
        first = loss if first is None else first
    return times[args.warmups:], first


def transformers_steps(lora: bool, args) -> tuple[list[float], float]:
    """(step seconds, first loss) of transformers' model with torch.optim.AdamW."""
    import torch
    import transformers

    from linnet_jax.load import default_model_path

    torch.set_num_threads(args.threads)
    source, options = pretrained_source(args.model_path or default_model_path())
    model = transformers.AutoModelForCausalLM.from_pretrained(source, **options, dtype=torch.float32,
                                                              attn_implementation="sdpa")
    if lora:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    data = batch(model.config.vocab_size, args.batch, args.seq_len)
    tokens = torch.tensor(data["tokens"], dtype=torch.long)
    times, first = [], None
    for _ in range(args.warmups + args.steps):
        start = time.perf_counter()
        logits = model(tokens).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        first = loss.item() if first is None else first
    return times[args.warmups:], first


def child(row: str, args) -> dict:
    lora = "LoRA" in row
    run = linnet_jax_steps if row.startswith("linnet_jax") else transformers_steps
    times, first = run(lora, args)
    step = statistics.median(times)
    return {"row": row, "step_s": step, "tokens_per_s": args.batch * args.seq_len / step, "first_loss": first,
            "peak_rss_mib": peak_rss_gib() * 1024}


def missing(row: str) -> str | None:
    """"not installed: ..." for a transformers row whose packages are absent, else None."""
    if row.startswith("linnet_jax"):
        return None
    if "LoRA" in row:
        return missing_modules(("torch", "transformers", "peft"), f"{TORCH_INSTALL} && {PEFT_INSTALL}")
    return missing_modules(("torch", "transformers"), TORCH_INSTALL)


def run_row(row: str) -> dict:
    """One row in its own process: its result, or {"row", "error"} (not installed, or the failure's last line)."""
    if (why := missing(row)) is not None:
        return {"row": row, "error": why}
    done = subprocess.run([sys.executable, __file__, "--child", row, *sys.argv[1:]], capture_output=True, text=True)
    if done.returncode:
        print(f"{row} failed:\n{done.stderr[-3000:]}", file=sys.stderr)
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return {"row": row, "error": last}
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare(results: list[dict]) -> list[dict]:
    """Each result with `vs_transformers` (its tokens/s over transformers' same kind of row) and `loss_distance`
    (|first loss − transformers'|), None where that row did not run."""
    reference = {r["row"].split(" ", 1)[1]: r for r in results
                 if r["row"].startswith("transformers") and "error" not in r}
    compared = []
    for r in results:
        ref = None if "error" in r else reference.get(r["row"].split(" ", 1)[1])
        compared.append(r | {"vs_transformers": ref and r["tokens_per_s"] / ref["tokens_per_s"],
                             "loss_distance": ref and abs(r["first_loss"] - ref["first_loss"])})
    return compared


def table(results: list[dict], args) -> str:
    lines = [f"SmolLM2-135M-Instruct float32, batch {args.batch} × {args.seq_len} tokens, AdamW; median of "
             f"{args.steps} steps after {args.warmups} warm-up; {args.threads} threads.", "",
             "| row | step (s) | tokens/s | × transformers | peak RSS (MiB) | first loss | |Δloss| vs transformers |",
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


def write(text: str) -> None:
    block = f"<!-- train-table:start -->\n{text}\n<!-- train-table:end -->"
    old = RESULTS.read_text() if RESULTS.exists() else ""
    pattern = re.compile(r"<!-- train-table:start -->.*?<!-- train-table:end -->", re.S)
    new = pattern.sub(lambda _: block, old) if pattern.search(old) else old.rstrip() + "\n\n## Fine-tuning\n\n" + block + "\n"
    RESULTS.write_text(new)


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
        print(json.dumps(child(args.child, args)))
        return
    results = []
    for row in args.rows.split(","):
        results.append(run_row(row))
        print(results[-1], file=sys.stderr)
    text = table(results, args)
    print(text)
    if args.json:
        command = " ".join(["python benchmarks/train.py", *map(shlex.quote, sys.argv[1:])])
        write_json(args.json, "train", compare(results), args, command, skip=("json", "no_write", "child"))
    if not args.no_write:
        write(text)


if __name__ == "__main__":
    main()
