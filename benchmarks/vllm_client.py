"""vLLM's own client (`vllm bench serve`) against `linnet-jax serve` or `vllm serve` on the same weights.

Starts one server as benchmarks/serve.py does (16 slots / sequences of 640 positions by default; vLLM on
linnet_jax's float32 HF export of the model, written once to --hf-dir), warms it with one short request, then
runs `vllm bench serve --backend openai --endpoint /v1/completions` from the vLLM venv with the arguments after
`--`, and prints what vLLM's client measured (its saved JSON) with the server's prefix-cache counters
(`linnet_jax_prefix_cache_{hit,lookup}_tokens_total` from /metrics, before and after).

    python benchmarks/vllm_client.py --server linnet -- --dataset-name random --random-input-len 320 \\
        --random-range-ratio 0.6 --random-output-len 128 --num-prompts 64 --max-concurrency 16 --ignore-eos
    python benchmarks/vllm_client.py --server vllm -- (the same)
    python benchmarks/vllm_client.py --server linnet --server-args "--no-prefix-cache" -- \\
        --dataset-name prefix_repetition --prefix-repetition-prefix-len 256 ... --ignore-eos

--server-args are appended to the server's command line (e.g. "--prefill-chunk 256"); --json PATH also writes
the summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import serve
from harness import run_worker

DEFAULT_HF_DIR = Path.home() / ".cache" / "linnet_jax" / "smollm2-hf"


def export_hf(args: argparse.Namespace) -> None:
    """linnet_jax's HF export of the model into --hf-dir (serve.py's `prepare` worker), unless it is there."""
    if (args.hf_dir / "config.json").exists():
        return
    reply = run_worker([sys.executable, str(Path(serve.__file__).resolve()), "--worker", "prepare", "--hf-dir",
                        str(args.hf_dir), "--requests", "1"])
    if "error" in reply:
        raise SystemExit(f"the HF export failed: {reply['error']}")


def with_extra(base: type[serve.Server], extra: list[str]) -> type[serve.Server]:
    class Extra(base):
        def command(self, port: int) -> list[str]:
            return super().command(port) + extra

    return Extra


def main(argv: list[str]) -> None:
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", choices=("linnet", "vllm"), required=True)
    parser.add_argument("--server-args", default="", help="appended to the server's command line")
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=640)
    parser.add_argument("--hf-dir", type=Path, default=DEFAULT_HF_DIR)
    parser.add_argument("--vllm-venv", type=Path, default=Path(os.environ.get("LINNET_VLLM_VENV",
                                                                              serve.DEFAULT_VLLM_VENV)))
    parser.add_argument("--json", type=Path, help="also write the summary here")
    args = parser.parse_args(argv[:split])
    bench_args = argv[split + 1:]
    args.model_path = args.replicas = args.replica_cpus = None  # serve.py's options this client does not take
    export_hf(args)
    server = with_extra(serve.LinnetServed if args.server == "linnet" else serve.VllmServed,
                        shlex.split(args.server_args))(args, args.hf_dir)
    if why := server.missing():
        raise SystemExit(why)
    vllm = args.vllm_venv / "bin" / "vllm"
    with tempfile.TemporaryDirectory(prefix="vllm-client-") as scratch, serve.Running(server, Path(scratch)) as running:
        load_s = running.wait_ready()
        model = serve.served_model(running.url)
        asyncio.run(serve.drive(running.url, model, [list(range(100, 116))], 2, 1))  # warm-up, untimed
        before = serve.prefix_counters(running.url)
        result = Path(scratch) / "result.json"
        command = [str(vllm), "bench", "serve", "--backend", "openai", "--endpoint", "/v1/completions",
                   "--base-url", running.url, "--model", model, "--tokenizer", str(args.hf_dir),
                   "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--seed", "0",
                   "--save-result", "--result-dir", scratch, "--result-filename", result.name, *bench_args]
        print("$ " + shlex.join(command), file=sys.stderr)
        environment = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                                    "PATH": f"{args.vllm_venv / 'bin'}:{os.environ.get('PATH', '')}"}
        environment.pop("VIRTUAL_ENV", None)
        done = subprocess.run(command, env=environment)
        after = serve.prefix_counters(running.url)
        rss = running.sampler.stop()
        if done.returncode or not result.exists():
            raise SystemExit(f"vllm bench serve failed ({done.returncode}); server log: {running.log_tail(12)}")
        measured = json.loads(result.read_text())
    keys = ("completed", "failed", "total_input_tokens", "total_output_tokens", "duration", "request_throughput",
            "output_throughput", "total_token_throughput", "mean_ttft_ms", "median_ttft_ms", "p50_ttft_ms",
            "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms")
    summary = {"server": args.server, "server_args": args.server_args, "bench_args": bench_args,
               "load_s": round(load_s, 1), "peak_rss_gib": round(rss, 2) if rss else None,
               **{k: measured.get(k) for k in keys}}
    if before or after:
        hit, lookup = serve.prefix_delta(before, after)
        summary |= {"prefix_hit_tokens": hit, "prefix_lookup_tokens": lookup,
                    "prefix_hit_rate": serve.hit_rate(before, after)}
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
