"""The command line: `linnet-jax generate "PROMPT"`, `linnet-jax chat`, `linnet-jax export`, `linnet-jax serve`
(the OpenAI-compatible server), `linnet-jax finetune` (SFT or DPO) and `linnet-jax eval` (lm-eval in process)
(also `python -m linnet_jax`).

A bad flag is refused before the model loads (exit status 2); any other failure the user can fix (a
missing model, a file in the way, a prompt that does not fit) prints one line naming it and exits 1.
`--debug` shows the traceback instead.
"""

import argparse
import io
import json
import os
import re
import socket
import sys
import time
from pathlib import Path

from linnet_jax.compilation import enable_compilation_cache
from linnet_jax.export._onnx import DTYPES as ONNX_DTYPES
from linnet_jax.models.config import DTYPES, QUANTIZE

# --format -> the --dtype values it takes: for gguf the GGUF storage type, for onnx the graphs' (weights' and
# cache's), else the weights' dtype.
EXPORT_DTYPES = {"stablehlo": DTYPES, "jax-source": DTYPES, "torch-source": DTYPES, "hf": DTYPES,
                 "onnx": ONNX_DTYPES, "gguf": ("f32", "f16", "bf16", "q8_0")}
GGUF_DEFAULT = "f16"
# The formats whose programs or decoder are built for a cache of --max-len positions, and their default (the
# exporters' own, or the model's context if shorter).
EXPORT_MAX_LEN_FORMATS = ("onnx", "stablehlo", "torch-source")
EXPORT_MAX_LEN = 1024
# What a user can cause and fix: printed as one line (exit status 1) unless --debug.
USER_ERRORS = (ValueError, TypeError, OSError)
# A byte that is not UTF-8, as stdin's surrogateescape error handler reads it.
INVALID_BYTE = re.compile("[\udc80-\udcff]")


def parser() -> argparse.ArgumentParser:
    source = argparse.ArgumentParser(add_help=False)
    source.add_argument("--model", default=None, help="HF directory, hub id or .gguf (default: SmolLM2-135M-Instruct)")
    source.add_argument("--no-compilation-cache", action="store_true", help="do not use the persistent JAX cache")
    source.add_argument("--debug", action="store_true", help="show the traceback of an error")
    weights = argparse.ArgumentParser(add_help=False)
    weights.add_argument("--dtype", default=None, choices=DTYPES, help="the params' dtype (default: as stored)")
    weights.add_argument("--quantize", default=None, choices=QUANTIZE,
                         help="int8: the products' weights as int8 (a GGUF's Q8_0 blocks as stored)")
    common = argparse.ArgumentParser(add_help=False, parents=[source, weights])
    common.add_argument("--max-new-tokens", type=positive_int, default=256)
    common.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    common.add_argument("--top-k", type=int, default=0)
    common.add_argument("--top-p", type=float, default=1.0)
    common.add_argument("--min-p", type=float, default=0.0)
    common.add_argument("--seed", type=int, default=0)
    common.add_argument("--system", default=None, help="a system message for the chat template")
    common.add_argument("--raw", action="store_true", help="no chat template: the prompt as plain text")
    common.add_argument("--ignore-eos", action="store_true", help="run to --max-new-tokens")
    main = argparse.ArgumentParser(prog="linnet-jax", description="Llama-family models in JAX.")
    commands = main.add_subparsers(dest="command", required=True)
    run = commands.add_parser("generate", parents=[common], help="generate from one prompt, streamed")
    run.add_argument("prompt")
    commands.add_parser("chat", parents=[common], help="an interactive chat, streamed")
    export = commands.add_parser("export", parents=[source], help="export the model (prints the path written)")
    export.add_argument("--format", required=True, choices=sorted(EXPORT_DTYPES))
    export.add_argument("--dtype", default=None, help=f"the weights' dtype, {', '.join(DTYPES)}; for gguf the GGUF "
                        f"type, {', '.join(EXPORT_DTYPES['gguf'])} (default {GGUF_DEFAULT}); for onnx "
                        f"{', '.join(ONNX_DTYPES)} (default {ONNX_DTYPES[0]})")
    export.add_argument("--max-len", type=positive_int, default=None,
                        help=f"the cache's positions (prompt + new tokens) the export is built for, for "
                        f"{', '.join(EXPORT_MAX_LEN_FORMATS)} (default {EXPORT_MAX_LEN}, or the model's context if "
                        f"shorter)")
    export.add_argument("--overwrite", action="store_true", help="write over an existing OUT")
    export.add_argument("out", metavar="OUT", help="a directory (a .gguf file for --format gguf)")
    serve = commands.add_parser("serve", parents=[source, weights], help="an OpenAI-compatible HTTP server")
    serve.add_argument("--slots", type=positive_int, default=16, help="the most requests in flight together")
    serve.add_argument("--max-len", type=positive_int, default=None,
                       help="the longest request: prompt + new tokens (default: the model's context)")
    serve.add_argument("--page-size", type=positive_int, default=None,
                       help="positions per page of the KV cache (default 64)")
    serve.add_argument("--kv-cache-gb", type=positive_float, default=None,
                       help="the KV cache's pool in GiB, shared by every request (default: slots x max-len positions, "
                            "at most 2 GiB)")
    serve.add_argument("--max-queue", type=positive_int, default=256, help="waiting requests before 429s")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=port, default=8000)
    serve.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY (all but /health)")
    serve.add_argument("--max-request-bytes", type=positive_int, default=None,
                       help="the largest request body taken; larger ones are answered 413 (default 1 MiB)")
    serve.add_argument("--shutdown-deadline", type=non_negative_float, default=30.0,
                       help="seconds running requests get to finish after SIGTERM/SIGINT before they are cancelled")
    serve.add_argument("--prefill-chunk", type=positive_int, default=256,
                       help="the most tokens of one prompt per step: longer prompts go in chunks, the decoding "
                            "requests running in each step")
    serve.add_argument("--max-step-tokens", type=positive_int, default=None,
                       help="the most tokens one step carries, decoding and prefilling (default 2 x prefill-chunk, "
                            "at least slots x (1 + speculative tokens))")
    serve.add_argument("--no-prefix-cache", action="store_true", help="recompute shared prompt prefixes every time")
    serve.add_argument("--speculative-config", type=json.loads, default=None, metavar="JSON",
                       help='n-gram speculative decoding, vLLM\'s names: \'{"method": "ngram", '
                            '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\'')
    serve.add_argument("--lora", type=lora_module, action="append", default=None, metavar="NAME=PATH",
                       help="serve a PEFT LoRA adapter directory as model NAME beside the base (repeatable)")
    serve.add_argument("--max-loras", type=positive_int, default=None,
                       help="the most adapters loaded at once (default 4; given alone: none yet, loaded at runtime "
                            "with POST /v1/load_lora_adapter)")
    serve.add_argument("--allow-runtime-lora-updating", action="store_true",
                       help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (else 404): anyone who can "
                            "reach the server (or holds --api-key) may then load any adapter it can read; confine them "
                            "with --lora-dir")
    serve.add_argument("--lora-dir", default=None, metavar="DIR",
                       help="with --allow-runtime-lora-updating: load_lora_adapter's lora_path is an adapter under "
                            "DIR (relative to it; no way out through '..' or links)")
    serve.add_argument("--max-lora-rank", type=positive_int, default=16, help="the largest adapter rank taken")
    spread = serve.add_argument_group("one model over several processes (jax.distributed; every process is given "
                                      "the same flags but --process-id; process 0 serves HTTP)")
    spread.add_argument("--coordinator", type=coordinator, default=None, metavar="HOST:PORT",
                        help="process 0's address for jax.distributed (its coordination service listens there)")
    spread.add_argument("--num-processes", type=positive_int, default=None, help="processes in the job")
    spread.add_argument("--process-id", type=non_negative_int, default=None, help="this process's index")
    spread.add_argument("--mesh", type=mesh_sizes, default=None, metavar="AXIS=SIZE,...",
                        help="the device mesh the weights and cache are split over, axes from data, fsdp, tensor "
                             "(default with --coordinator: fsdp over every process's devices)")
    spread.add_argument("--rules", default=None, choices=("single", "dp", "fsdp", "tp", "fsdp_tp"),
                        help="the sharding preset (default: every rule the mesh's axes allow)")
    serve.add_argument("--replicas", type=positive_int, default=None,
                       help="serve N replicas on Ray Serve (the ray extra), each with its own engine")
    serve.add_argument("--ray-address", default=None,
                       help="with --replicas: join the Ray cluster at ADDR (default: start a local Ray instance)")
    serve.add_argument("--replica-cpus", type=positive_float, default=None,
                       help="with --replicas: the Ray CPUs each replica reserves (default 1; below 2: one compute "
                            "thread)")
    add_finetune(commands.add_parser("finetune", parents=[source, weights],
                                     help="fine-tune on a JSON Lines file (full, LoRA or QLoRA)"))
    evaluate = commands.add_parser("eval", parents=[source, weights], help="run lm-eval tasks on the model, in process")
    evaluate.add_argument("--tasks", required=True, help="comma-separated lm-eval task (or group) names")
    evaluate.add_argument("--include-path", default=None, metavar="DIR", help="a directory of your own task YAMLs")
    evaluate.add_argument("--limit", type=positive_float, default=None,
                          help="at most N documents per task (a fraction of each below 1)")
    evaluate.add_argument("--num-fewshot", type=non_negative_int, default=None)
    evaluate.add_argument("--batch-size", type=positive_int, default=16, help="prompts generated together")
    evaluate.add_argument("--max-length", type=positive_int, default=None,
                          help="the most tokens a scored window holds (default: the model's context)")
    evaluate.add_argument("--output", default=None, metavar="FILE.json", help="also write lm-eval's results there")
    evaluate.add_argument("--log-samples", action="store_true", help="keep each request and answer in --output")
    evaluate.add_argument("--overwrite", action="store_true", help="write over an existing --output")
    return main


def positive_int(text: str) -> int:
    """argparse type: an int ≥ 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {value}")
    return value


def lora_module(text: str) -> tuple[str, str]:
    """argparse type: NAME=PATH, an adapter's served name and its PEFT directory."""
    from linnet_jax.adapters import check_adapter_name

    name, equals, path = text.partition("=")
    if not (name and equals and path):
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    try:
        return check_adapter_name(name), path
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


def non_negative_int(text: str) -> int:
    """argparse type: an int ≥ 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an int ≥ 0, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite float > 0."""
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def port(text: str) -> int:
    """argparse type: a TCP port, 0 to 65535."""
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in [0, 65535], got {value}")
    return value


def coordinator(text: str) -> str:
    """argparse type: HOST:PORT, a jax.distributed coordinator's address."""
    host, _, number = text.rpartition(":")
    if not host or not number.isdigit() or not 0 < int(number) <= 65535:
        raise argparse.ArgumentTypeError(f"must be HOST:PORT (a port in [1, 65535]), got {text!r}")
    return text


def mesh_sizes(text: str) -> dict[str, int]:
    """argparse type: AXIS=SIZE,... over the mesh axes data, fsdp and tensor."""
    from linnet_jax.sharding import MESH_AXES

    sizes = {}
    for part in text.split(","):
        axis, _, size = part.partition("=")
        if axis not in MESH_AXES or axis in sizes or not size.isdigit() or int(size) < 1:
            raise argparse.ArgumentTypeError(f"must be AXIS=SIZE,... with distinct axes from {MESH_AXES} and sizes "
                                             f"≥ 1, got {text!r}")
        sizes[axis] = int(size)
    return sizes


def non_negative_float(text: str) -> float:
    """argparse type: a finite float ≥ 0."""
    value = float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number ≥ 0, got {text}")
    return value


def check_flags(arguments: argparse.ArgumentParser, args) -> None:
    """Refuse (exit status 2) flags that cannot work together or that generate would refuse, before any loading."""
    if args.command == "export":
        if args.dtype not in (None, *EXPORT_DTYPES[args.format]):
            arguments.error(f"--dtype {args.dtype} is not one of {EXPORT_DTYPES[args.format]} "
                            f"(for --format {args.format})")
        if args.max_len is not None and args.format not in EXPORT_MAX_LEN_FORMATS:
            arguments.error(f"--max-len is for --format {', '.join(EXPORT_MAX_LEN_FORMATS)}, not {args.format}")
        return
    if args.command == "finetune":
        if args.quantize and not args.lora_rank:
            arguments.error(f"--quantize {args.quantize} trains LoRA adapters over the quantized weights (QLoRA): it "
                            "needs --lora-rank > 0")
        if args.method != "dpo" and (args.beta is not None or args.reference_free):
            arguments.error("--beta and --reference-free are DPO's: add --method dpo")
        if args.eval_every is not None and not args.eval_tasks:
            arguments.error("--eval-every needs --eval-tasks")
        if (args.eval_include_path or args.eval_limit) and not args.eval_tasks:
            arguments.error("--eval-include-path and --eval-limit need --eval-tasks")
        return
    if args.command == "eval":
        if args.log_samples and not args.output:
            arguments.error("--log-samples needs --output, the file the samples go to")
        return
    from linnet_jax.inputs import make_sampling

    if args.command == "serve":
        from linnet_jax.adapters import DEFAULT_MAX_LORAS, peft_rank
        from linnet_jax.load import DEFAULT_MODEL
        from linnet_jax.serve.errors import check_api_key
        from linnet_jax.serve.engine import step_tokens
        from linnet_jax.speculative import check_fits, speculative_config

        spread = (args.coordinator, args.num_processes, args.process_id)
        if any(value is not None for value in spread) and any(value is None for value in spread):
            arguments.error("--coordinator, --num-processes and --process-id go together")
        if args.num_processes is not None and args.process_id >= args.num_processes:
            arguments.error(f"--process-id must be in [0, --num-processes={args.num_processes}), got {args.process_id}")
        if args.replicas is not None and args.allow_runtime_lora_updating:
            arguments.error("--allow-runtime-lora-updating is not served with --replicas: a load would reach one "
                            "replica only; give the adapters with --lora")
        if args.lora_dir is not None and not args.allow_runtime_lora_updating:
            arguments.error("--lora-dir needs --allow-runtime-lora-updating")
        if args.lora_dir is not None and not Path(args.lora_dir).is_dir():
            arguments.error(f"--lora-dir {args.lora_dir}: not a directory")
        if args.num_processes is not None and (args.lora or args.max_loras or args.allow_runtime_lora_updating):
            arguments.error("--lora, --max-loras and --allow-runtime-lora-updating are not served across processes: "
                            "serve adapters from one process")
        if args.rules is not None and args.mesh is None and args.coordinator is None:
            arguments.error("--rules needs --mesh (or --coordinator)")
        if args.replicas is None and (given := next((flag for flag, value in (
                ("--ray-address", args.ray_address), ("--replica-cpus", args.replica_cpus)) if value is not None), None)):
            arguments.error(f"{given} needs --replicas")
        if args.replicas is not None and args.coordinator is not None:
            arguments.error("--replicas and --coordinator do not go together: replicas are engines of their own, "
                            "--coordinator spreads one engine over processes")
        if args.max_len is not None and args.max_len < 2:
            arguments.error(f"--max-len must be at least 2 (a prompt token and a new one), got {args.max_len}")
        names = [name for name, _ in args.lora or ()]
        if repeated := next((name for name in names if names.count(name) > 1), None):
            arguments.error(f"--lora {repeated}=... is given twice")
        if len(names) > (args.max_loras or DEFAULT_MAX_LORAS):
            arguments.error(f"{len(names)} --lora adapters need --max-loras {len(names)} or more")
        for name, path in args.lora or ():
            if name == (args.model or DEFAULT_MODEL):
                arguments.error(f"--lora {name}=...: {name!r} is the base model's name")
            try:
                rank = peft_rank(path)
            except ValueError as error:
                arguments.error(f"--lora {name}={path}: {error}")
            if rank > args.max_lora_rank:
                arguments.error(f"--lora {name}={path}: the adapter's rank {rank} is above --max-lora-rank "
                                f"{args.max_lora_rank}")
        try:
            speculative = speculative_config(args.speculative_config, "--speculative-config")
            check_fits(speculative, args.slots, args.max_len or 2**31,
                       step_tokens(args.slots, args.prefill_chunk, speculative, args.max_step_tokens),
                       "--speculative-config")
            check_api_key(args.api_key, "--api-key")
        except ValueError as error:
            arguments.error(str(error))
        if args.process_id:  # a follower serves no HTTP
            return
        try:
            check_address(args.host, args.port)
        except OSError as error:
            arguments.error(f"cannot listen on --host {args.host} --port {args.port}: {error}")
        return

    if args.raw and args.system:
        arguments.error("--system needs the chat template; drop --raw")
    try:
        make_sampling(1, args.temperature, args.top_k, args.top_p, args.min_p, 1.0, args.seed)
    except (ValueError, TypeError, OverflowError) as error:
        arguments.error(str(error))


def check_address(host: str, port: int) -> None:
    """That a server can listen on host:port: each address it resolves to is bound, then released at once (an
    OSError says why not: an unknown host, an address of another machine, a port in use)."""
    for family, kind, protocol, _, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                                  flags=socket.AI_PASSIVE):
        with socket.socket(family, kind, protocol) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)


def add_finetune(command: argparse.ArgumentParser) -> None:
    command.add_argument("--data", required=True, metavar="FILE.jsonl",
                         help='records {"messages": [...]}, {"prompt": ..., "completion": ...} or {"text": ...}')
    command.add_argument("--lora-rank", type=non_negative_int, default=8, help="0 = full fine-tuning")
    command.add_argument("--lora-alpha", type=positive_float, default=16.0)
    command.add_argument("--lora-targets", default=None,
                         help="comma-separated HF module names (default: q_proj,...,down_proj, all seven)")
    command.add_argument("--steps", type=positive_int, default=100)
    command.add_argument("--batch-size", type=positive_int, default=4, help="rows per micro-batch")
    command.add_argument("--seq-len", type=positive_int, default=512)
    command.add_argument("--lr", type=positive_float, default=1e-4)
    command.add_argument("--warmup", type=non_negative_int, default=0, help="steps of linear warmup")
    command.add_argument("--accum-steps", type=positive_int, default=1,
                         help="micro-batches per step (a step sees batch-size x accum-steps rows)")
    command.add_argument("--save-every", type=positive_int, default=100, help="checkpoint every N steps")
    command.add_argument("--keep", type=positive_int, default=3, help="checkpoints kept")
    again = command.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true", help="continue from OUT_DIR's latest checkpoint")
    again.add_argument("--resume-anyway", action="store_true",
                       help="--resume even when --data, --seq-len, --batch-size, ... differ from the checkpoint's")
    again.add_argument("--overwrite", action="store_true",
                       help="start again in a non-empty OUT_DIR, replacing what finetune writes there")
    command.add_argument("--seed", type=int, default=0)
    command.add_argument("--no-packing", action="store_true", help="one record per row, padded")
    command.add_argument("--truncate", action="store_true", help="cut records longer than --seq-len (counted)")
    command.add_argument("--remat", action="store_true", help="recompute activations in the backward pass")
    command.add_argument("--compute-dtype", default=None, choices=DTYPES, help="the forward's dtype (default: params')")
    command.add_argument("--method", default="sft", choices=("sft", "dpo"),
                         help='dpo: preference records {"prompt" or "messages", "chosen", "rejected"}; --batch-size '
                              "counts pairs")
    command.add_argument("--beta", type=positive_float, default=None, help="DPO's temperature (default 0.1)")
    command.add_argument("--reference-free", action="store_true",
                         help="DPO without a reference model (its log-probabilities taken as 0)")
    command.add_argument("--eval-tasks", default=None, help="lm-eval tasks run on the model as it trains")
    command.add_argument("--eval-every", type=positive_int, default=None,
                         help="run --eval-tasks every N steps (and at the last; default: the last only)")
    command.add_argument("--eval-include-path", default=None, metavar="DIR", help="a directory of task YAMLs")
    command.add_argument("--eval-limit", type=positive_float, default=None, help="documents per task")
    command.add_argument("out", metavar="OUT_DIR")


def lora_config(args):
    """The `linnet_jax.train.LoraConfig` the LoRA flags ask for; None for full fine-tuning (--lora-rank 0)."""
    from linnet_jax import train

    if not args.lora_rank:
        return None
    targets = {"targets": tuple(t.strip() for t in args.lora_targets.split(","))} if args.lora_targets else {}
    return train.LoraConfig(args.lora_rank, args.lora_alpha, **targets)


def run_finetune(args) -> None:
    """Load the model, run linnet_jax.train.finetune, export what it trained and print where.

    OUT_DIR/model is the fine-tuned model (LoRA merged) as a Hugging Face directory, which load, generate and
    every export accept; with LoRA, OUT_DIR/adapter holds the adapters in PEFT's layout (PEFT, vLLM). A non-empty
    OUT_DIR is refused, before loading, unless --resume, --resume-anyway or --overwrite.
    """
    from linnet_jax import export, load, train
    from linnet_jax.load import DEFAULT_MODEL
    from linnet_jax.train.loop import check_out_dir

    check_out_dir(Path(args.out), resume=args.resume or args.resume_anyway, overwrite=args.overwrite)
    lora = lora_config(args)
    model = load(args.model, dtype=args.dtype, quantize=args.quantize)
    result = train.finetune(
        model, args.data, args.out, lora=lora, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
        lr=args.lr, warmup=args.warmup, accum_steps=args.accum_steps, save_every=args.save_every, keep=args.keep,
        resume=args.resume, resume_anyway=args.resume_anyway, overwrite=args.overwrite, seed=args.seed,
        packing=not args.no_packing, truncate=args.truncate, remat=args.remat, compute_dtype=args.compute_dtype,
        method=args.method, beta=0.1 if args.beta is None else args.beta, reference_free=args.reference_free,
        eval_tasks=args.eval_tasks, eval_every=args.eval_every, eval_include_path=args.eval_include_path,
        eval_limit=args.eval_limit)
    out = Path(args.out)
    model_dir = export.hf(result.model, out / "model", overwrite=True, progress=False)
    adapter_dir = None if lora is None else export.peft(model, result.state.lora, out / "adapter",
                                                       base=args.model or DEFAULT_MODEL, overwrite=True)
    if result.metrics:  # none when a resumed run had no step left and its metrics.jsonl is gone
        first, last = result.metrics[0], result.metrics[-1]
        print(f"loss {first['loss']:.4f} at step {first['step']} -> {last['loss']:.4f} at step {last['step']}")
        if "rewards/margins" in last:
            print(f"reward margin {first['rewards/margins']:.4f} -> {last['rewards/margins']:.4f}, accuracy "
                  f"{first['rewards/accuracies']:.2f} -> {last['rewards/accuracies']:.2f}")
    print(f"model: {model_dir}")
    if adapter_dir:
        print(f"PEFT adapter: {adapter_dir}")


def run_eval(args) -> None:
    """Load the model, run lm-eval's tasks on it in process (`linnet_jax.eval.evaluate`), print lm-eval's table
    and write its results to --output when given."""
    from lm_eval.utils import handle_non_serializable, make_table

    from linnet_jax import load
    from linnet_jax.eval import evaluate, tasks_to_run
    from linnet_jax.files import prepare_target, staged

    tasks_to_run(args.tasks, args.include_path)  # an unknown task is refused before the model loads
    output = prepare_target(args.output, overwrite=args.overwrite) if args.output else None
    model = load(args.model, dtype=args.dtype, quantize=args.quantize)
    results = evaluate(model, args.tasks, include_path=args.include_path, limit=args.limit,
                       num_fewshot=args.num_fewshot, batch_size=args.batch_size, max_length=args.max_length,
                       log_samples=args.log_samples)
    print(make_table(results))
    if output is not None:
        with staged(output) as written:
            written.write_text(json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False),
                               encoding="utf-8")
        print(f"results: {output}")


def export_model(args) -> Path:
    """Load the model and run linnet_jax.export.<format> on it; returns what it wrote."""
    from linnet_jax import export, load

    if args.format == "gguf":  # q8_0 from a model whose weights are Q8_0 already: its blocks as stored, not requantized
        model = load(args.model, quantize="int8" if args.dtype == "q8_0" else None)
        return export.gguf(model, args.out, dtype=args.dtype or GGUF_DEFAULT, overwrite=args.overwrite)
    if args.format == "onnx":  # the graphs' dtype: the weights are read in float32 and cast once, at export
        model = load(args.model, dtype="float32")
        return export.onnx(model, args.out, dtype=args.dtype or ONNX_DTYPES[0], max_len=export_max_len(model, args),
                           overwrite=args.overwrite)
    model = load(args.model, dtype=args.dtype)
    sized = {"max_len": export_max_len(model, args)} if args.format in EXPORT_MAX_LEN_FORMATS else {}
    return getattr(export, args.format.replace("-", "_"))(model, args.out, overwrite=args.overwrite, **sized)


def export_max_len(model, args) -> int:
    """The cache positions an export is built for: --max-len, else EXPORT_MAX_LEN or the model's context if
    shorter."""
    return args.max_len or min(EXPORT_MAX_LEN, model.config.max_position_embeddings)


def conversation_start(args) -> list[dict]:
    return [{"role": "system", "content": args.system}] if args.system else []


def stream_reply(model, prompt, args) -> str:
    """Stream one reply to stdout; return its text."""
    from linnet_jax import generate

    pieces = []
    for piece in generate(model, prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, min_p=args.min_p, seed=args.seed, ignore_eos=args.ignore_eos,
                          chat=not args.raw, stream=True):
        print(piece, end="", flush=True)
        pieces.append(piece)
    print(flush=True)
    return "".join(pieces)


def main(argv: list[str] | None = None) -> int:
    arguments = parser()
    args = arguments.parse_args(argv)
    check_flags(arguments, args)
    try:
        return run(args)
    except USER_ERRORS as error:
        if args.debug:
            raise
        message = " ".join(str(error).split())
        raise SystemExit(f"linnet-jax {args.command}: error: {message} (--debug shows the traceback)") from None


def run(args) -> int:
    """Run the parsed command; returns the exit status."""
    if not args.no_compilation_cache:
        enable_compilation_cache()
    if args.command == "finetune":
        run_finetune(args)
        return 0
    if args.command == "export":
        print(export_model(args))
        return 0
    if args.command == "serve" and args.replicas:
        return serve_replicas(args)
    if args.command == "eval":
        run_eval(args)
        return 0
    from linnet_jax import load

    if getattr(args, "coordinator", None):
        join_processes(args)
    start = time.perf_counter()
    model = load(args.model, dtype=args.dtype, quantize=args.quantize, **serve_mesh(args))
    print(f"{model} loaded in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    if args.command == "serve":
        return serve(model, args)
    if args.command == "generate":
        prompt = args.prompt if args.raw else conversation_start(args) + [{"role": "user", "content": args.prompt}]
        stream_reply(model, prompt, args)
        return 0
    return chat(model, args)


def join_processes(args) -> None:
    """Join the jax.distributed job of `serve --coordinator` (CPU devices talk through gloo)."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.num_processes,
                               process_id=args.process_id)


def serve_mesh(args) -> dict:
    """load's mesh and rules from serve's --mesh and --rules ({} on one device): with --coordinator and no --mesh,
    fsdp over every process's devices."""
    from linnet_jax.sharding import mesh

    sizes = getattr(args, "mesh", None)
    if sizes is None and getattr(args, "coordinator", None):
        import jax

        sizes = {"fsdp": jax.device_count()}
    return {} if sizes is None else {"mesh": mesh(**sizes), "rules": args.rules}


def engine_options(args) -> dict:
    """`Engine` keywords from serve's flags."""
    from linnet_jax.adapters import DEFAULT_MAX_LORAS
    from linnet_jax.serve.engine import DEFAULT_PAGE_SIZE

    return {"slots": args.slots, "max_len": args.max_len, "max_queue": args.max_queue,
            "page_size": args.page_size or DEFAULT_PAGE_SIZE, "kv_cache_gb": args.kv_cache_gb,
            "prefill_chunk": args.prefill_chunk, "max_step_tokens": args.max_step_tokens,
            "prefix_cache": not args.no_prefix_cache, "speculative": args.speculative_config,
            "loras": None if args.lora is None and args.max_loras is None and not args.allow_runtime_lora_updating
            else dict(args.lora or ()),
            "max_loras": args.max_loras or DEFAULT_MAX_LORAS, "max_lora_rank": args.max_lora_rank}


def serve_replicas(args) -> int:
    """`serve --replicas N`: N replicas on Ray Serve (`linnet_jax.serve.ray`), each loading the model and warming
    its engine up, behind Ray's proxy on --host:--port, until SIGTERM or SIGINT."""
    import jax

    from linnet_jax.serve.errors import MAX_REQUEST_BYTES
    from linnet_jax.serve.ray import app, run

    if jax.config.jax_compilation_cache_dir:  # the replicas of a local Ray instance compile into the same cache
        os.environ["JAX_COMPILATION_CACHE_DIR"] = jax.config.jax_compilation_cache_dir
    cpus = {} if args.replica_cpus is None else {"cpus": args.replica_cpus}
    application = app(args.model, replicas=args.replicas, api_key=args.api_key, dtype=args.dtype,
                      quantize=args.quantize, max_request_bytes=args.max_request_bytes or MAX_REQUEST_BYTES, **cpus,
                      **engine_options(args))
    run(application, address=args.ray_address, host=args.host, port=args.port)
    return 0


def serve(model, args) -> int:
    """Warm an Engine up and serve it over HTTP until SIGTERM or SIGINT (then drain; exit status 0). Settings the
    engine refuses exit 2; an engine that fails (out of memory, say), at warm-up or later, exits 1: one line each."""
    from linnet_jax.load import DEFAULT_MODEL
    from linnet_jax.serve import Engine
    from linnet_jax.serve.app import create_app
    from linnet_jax.serve.app import serve as run_server
    from linnet_jax.serve.errors import MAX_REQUEST_BYTES

    lockstep = None
    if args.coordinator:
        from linnet_jax.serve.lockstep import Lockstep

        lockstep = Lockstep()
    try:
        engine = Engine(model, **engine_options(args), lockstep=lockstep)
        if lockstep and not lockstep.leader:
            print(f"following process 0's engine ({engine.slots} slots of {engine.max_len} positions)", file=sys.stderr)
            engine.follow()
        else:
            start = time.perf_counter()
            engine.warmup()
            print(f"engine warmed up in {time.perf_counter() - start:.1f} s ({engine.slots} slots of "
                  f"{engine.max_len} positions)", file=sys.stderr)
            app = create_app(engine, model_name=args.model or DEFAULT_MODEL, api_key=args.api_key,
                             max_request_bytes=args.max_request_bytes or MAX_REQUEST_BYTES,
                             allow_runtime_lora_updating=args.allow_runtime_lora_updating, lora_dir=args.lora_dir)
            run_server(app, engine, host=args.host, port=args.port, deadline=args.shutdown_deadline)
    except (ValueError, RuntimeError, MemoryError) as error:
        if args.debug:
            raise
        print(f"linnet-jax serve: error: {' '.join(str(error).split())}", file=sys.stderr)
        return 2 if isinstance(error, ValueError) else 1
    finally:
        if lockstep and lockstep.leader:
            lockstep.stop()
    if lockstep:  # every process meets at the shutdown barrier; one that failed left without it, and
        import jax  # jax.distributed then ends the others

        jax.distributed.shutdown()
    return 0


def chat(model, args) -> int:
    """The interactive loop: each line of stdin is a user turn; an empty line or the end of input ends it.
    A line that is not valid UTF-8 is named and skipped."""
    if isinstance(sys.stdin, io.TextIOWrapper):
        sys.stdin.reconfigure(errors="surrogateescape")
    messages = conversation_start(args)
    print("Chat with the model; an empty line or Ctrl-D ends.", file=sys.stderr)
    while True:
        try:
            text = input("> ")
        except EOFError:
            return 0
        if bad := INVALID_BYTE.search(text):
            print(f"linnet-jax chat: that line is not valid UTF-8 (byte 0x{ord(bad.group()) - 0xDC00:02X} at "
                  f"position {bad.start()}); type it again", file=sys.stderr)
            continue
        if not text.strip():
            return 0
        if args.raw:
            stream_reply(model, text, args)
            continue
        messages.append({"role": "user", "content": text})
        messages.append({"role": "assistant", "content": stream_reply(model, messages, args)})
