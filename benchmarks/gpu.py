"""The GPU protocol in one script: linnet_jax against transformers on Mistral-7B-v0.3 shapes (BENCHMARKS.md).

    python benchmarks/gpu.py --out DIR                         # the full protocol on a GPU (about 8 minutes)
    python benchmarks/gpu.py --sections batch1,transformers    # some sections only
    python benchmarks/gpu.py --tiny --no-torch-compile         # a tiny config on the CPU (the suite's check)

On a machine without network (token ids only: no tokenizer, no weights to fetch), install linnet_jax from the
working tree first: `python3 -m pip install -q --no-deps --no-build-isolation -e .`.

The model: Mistral-7B-v0.3's shapes (hidden 4096, 32 layers, 32 query heads over 8 KV heads, head_dim 128, MLP
14336, vocab 32768, rope theta 1e6, untied head) with random bfloat16 weights (normal(0, 0.02), norms 1), made
on the device (linnet_jax: one jitted program per weight, drawn a slab at a time; transformers: its own init
under `torch.device("cuda")`), so nothing crosses the host. Decode speed is a property of the shapes.

Sections, each in its own process (its peak device memory is its own, and a crash or a hang ends only that
section), run in the order given, their rows printed as each ends:
- batch1: `linnet_jax.generate(model, tokens=ids, max_new_tokens=n, ignore_eos=True)`, as a user calls it,
  on a `linnet_jax.Model(config, params)` (decode params as linnet_jax's platform switch chooses).
  512 random prompt ids (numpy default_rng(0), in [100, vocab)), 128 new tokens, greedy, batch 1.
- serve: `linnet_jax.serve.Engine(model, slots=64, max_len=640)` in-process: 256 requests of 128-512 random
  ids (lengths and ids from default_rng(0)), 128 new tokens each, eos ignored, at most 64 unfinished at a
  time (a new one submitted as one finishes). Warm-up first (untimed): `engine.warmup()`, which compiles
  every program the engine runs; the row says how many compilations the timed run had (0 expected; JAX's backend-compile events). Generated tok/s = all generated tokens / (first
  submission to last completion); TTFT = `Handle.submitted` to its first token; TPOT = (latency - TTFT) /
  (tokens - 1).
- transformers: `AutoModelForCausalLM.from_config` (MistralForCausalLM) in bfloat16 on cuda, sdpa attention,
  `generate` with one `StaticCache` of prompt + new positions (reset before each call) and
  `model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)`: the transformers
  docs' static-cache recipe (`--torch-compile-mode default` for no CUDA graphs; `--no-torch-compile`: eager).
- stablehlo: `linnet_jax.export.stablehlo` (batch 1, max_len 640) written by a child process from the same
  random weights, then in this one, without linnet_jax: the export's own load.py (`Export.greedy_ids`)
  deserializes the programs, reads the weights from the export's safetensors file and chooses greedy tokens on
  the device. Its greedy ids are compared with batch1's (same seed, same weights: they should agree).
- torch_source: `linnet_jax.export.torch_source` (the generated PyTorch model.py, max_len 640) written by a
  child process from the same random weights, then its `load_weights(device="cuda")` and
  `torch.compile(module, mode=--torch-compile-mode)` ("reduce-overhead": each step a CUDA graph replay) through
  the file's own greedy `generate`; its ids are compared with batch1's. (ONNX Runtime's TensorRT provider is not
  a section: a 7B ONNX export and a TensorRT engine build of it do not fit a lent device's minutes.)

Timing (batch1, stablehlo, transformers, torch_source): a first call (compilation included, reported), then
`--warmups` pairs of calls, then `--runs` pairs, each pair a full call (128 new tokens) and a one-token call,
each timed with the device synchronized before and after (`torch.cuda.synchronize`; linnet_jax's results are
host values, the stablehlo row fetches its tokens to the host). TTFT = the one-token call (prefill + first
token); decode tok/s = 127 / (full - one-token) per pair; the medians. Peak device memory: JAX's
`peak_bytes_in_use` of the section's process; torch's `max_memory_allocated` after the weights are made.

Estimated on an H200, process start and compilation included: batch1 ~1.5 min, serve ~3 min, transformers
~3 min (torch.compile), stablehlo ~2.5 min, torch_source ~4 min (14.5 GB written and read back). `--budget-s`
(default 480) bounds the whole run: each section gets at most its cap and what is left of the budget, and one
that cannot start in time is a row saying so (`--sections torch_source,transformers` for the PyTorch rows).
A failing section is a row with its error; the others still run. Exit status 1 if any row has no numbers.
`--out DIR` writes `gpu.json` and `gpu.md` (rewritten after every section, so a run cut short keeps what it
measured). The bars (issue 13): linnet_jax batch-1 decode >= 250 tok/s and >= 1.5x transformers compiled.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import json
import math
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from harness import (decode_tok_s, import_path, leading_agreement, median, percentile, ratio, reply_once,
                     run_worker, timed, versions)

MISTRAL_7B_V03 = {
    "architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": 32768, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
    "rope_theta": 1e6, "sliding_window": None, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    "dtype": "bfloat16",
}
TINY_CONFIG = MISTRAL_7B_V03 | {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 1024,
}


@dataclasses.dataclass(frozen=True)
class Protocol:
    """The model's shapes and the two workloads."""

    name: str
    hf_config: dict
    prompt_tokens: int  # batch 1: prompt ids, new tokens, warm-up pairs and timed pairs
    new_tokens: int  # also each serving request's
    warmups: int
    runs: int
    requests: int  # serving: requests, their prompt lengths (inclusive), unfinished at a time, engine slots
    prompt_range: tuple[int, int]
    in_flight: int
    slots: int
    max_len: int  # the engine's positions per slot
    budget_s: int  # default --budget-s
    cap_scale: float  # each section's cap is its H200 cap times this


FULL = Protocol("Mistral-7B-v0.3 shapes, random bfloat16 weights", MISTRAL_7B_V03, prompt_tokens=512, new_tokens=128,
                warmups=3, runs=10, requests=256, prompt_range=(128, 512), in_flight=64, slots=64, max_len=640,
                budget_s=480, cap_scale=1.0)
TINY = Protocol("tiny config (2 layers, hidden 64, vocab 512), random bfloat16 weights", TINY_CONFIG,
                prompt_tokens=32, new_tokens=32, warmups=1, runs=3, requests=16, prompt_range=(16, 32), in_flight=4,
                slots=8, max_len=64, budget_s=300, cap_scale=0.5)

SLAB_ELEMENTS = 2**26  # the most float32 normals one weight program draws at once (256 MiB)
WEIGHT_STD = 0.02  # transformers' initializer_range, which its own init uses
DECODE_BAR = 250.0  # tok/s: the seed's H100 StableHLO 174 tok/s times the H200/H100 bandwidth, 1.43
RATIO_BAR = 1.5  # linnet_jax decode over transformers compiled
H200_OVER_H100 = 1.43
SEED_H100_DECODE = {"linnet StableHLO": 174.0, "transformers compiled": 118.0}  # tok/s, seed/linnet-benchmark-page
MIN_START_S = 20  # a section is not started with less of the budget left
DRIVE_TIMEOUT_S = 600  # serving: the longest wait for any one request to finish
VERSIONS = ("jax", "jaxlib", "torch", "transformers", "linnet_jax")  # the report's packages


def prompt_ids(protocol: Protocol) -> list[int]:
    """The batch-1 prompt: prompt_tokens ids in [100, vocab) from numpy's default_rng(0)."""
    rng = np.random.default_rng(0)
    return rng.integers(100, protocol.hf_config["vocab_size"], size=protocol.prompt_tokens).tolist()


def workload(protocol: Protocol) -> list[list[int]]:
    """The serving prompts: lengths uniform in prompt_range, ids uniform in [100, vocab), from default_rng(0)."""
    rng = np.random.default_rng(0)
    low, high = protocol.prompt_range
    lengths = rng.integers(low, high + 1, size=protocol.requests)
    return [rng.integers(100, protocol.hf_config["vocab_size"], size=int(n)).tolist() for n in lengths]


def measure_generate(generate: Callable[[int], list[int]], protocol: Protocol, sync: Callable[[], None],
                     compiles: Callable[[], int] | None = None) -> dict:
    """TTFT and decode speed of generate(n) -> n new greedy ids after the protocol's prompt.

    A first call (compilation included), `warmups` untimed pairs, then `runs` timed pairs of a full call and a
    one-token call: TTFT = the one-token call, decode = (new - 1) / (full - one-token); medians of the pairs.
    compiles: a count of the process's compilations (`compile_counter`), to report those in the timed runs."""
    new = protocol.new_tokens
    first_call_s, tokens = timed(generate, new, sync=sync)
    if len(tokens) != new:
        raise RuntimeError(f"generate returned {len(tokens)} tokens, expected {new}")
    for _ in range(protocol.warmups):
        generate(new)
        generate(1)
    compiled = compiles and compiles()
    full_s, ttft_s = [], []
    for _ in range(protocol.runs):
        full_s.append(timed(generate, new, sync=sync)[0])
        ttft_s.append(timed(generate, 1, sync=sync)[0])
    decode = [decode_tok_s(new, full, ttft) for full, ttft in zip(full_s, ttft_s) if full > ttft]
    notes = [] if compiles is None else [f"compilations during the timed runs: {compiles() - compiled}"]
    return {"ttft_ms": 1e3 * median(ttft_s), "decode_tok_s": median(decode),
            "first_call_s": first_call_s, "tokens": tokens, "notes": notes,
            "per_run": {"ttft_ms": [round(1e3 * t, 2) for t in ttft_s], "decode_tok_s": [round(d, 1) for d in decode]}}


# --------------------------------------------------------------------------------------------
# Inside a section's process: JAX and torch are imported here only, never by the parent.


def jax_device_report() -> dict:
    """The default JAX device and this process's peak bytes on it (None where the platform keeps no stats)."""
    import jax

    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return {"device": f"{device.platform}: {device.device_kind}", "peak_gib": None if peak is None else peak / 2**30}


def compile_counter() -> Callable[[], int]:
    """A function giving how many XLA compilations this process has run since the counter was made (JAX's
    backend-compile events: unlike counting traces, this also sees a program compiled again for new input
    placements)."""
    import jax

    count = [0]

    def listen(event: str, duration: float, **kwargs) -> None:
        count[0] += event == "/jax/core/compile/backend_compile_duration"

    jax.monitoring.register_event_duration_secs_listener(listen)
    return lambda: count[0]


def random_params(config, seed: int = 0):
    """Params of the config's shapes, made on the default device (no host copy), placed as `linnet_jax.load`
    places them on one device. Vectors (the norms) are ones; every other weight is normal(0, WEIGHT_STD) in the
    config's dtype, drawn by one jitted program per weight a slab of leading rows at a time (at most
    SLAB_ELEMENTS float32 values), so that making them needs little memory beyond the weights themselves."""
    import jax
    import jax.numpy as jnp
    from linnet_jax.models.params import flatten_params, param_axes, param_shapes, unflatten_params

    @functools.partial(jax.jit, static_argnums=(1, 2, 3))
    def draw(key, shape: tuple[int, ...], dtype: str, vector: bool) -> jax.Array:
        if vector:
            return jnp.ones(shape, dtype)
        row = lambda k: (WEIGHT_STD * jax.random.normal(k, shape[1:], jnp.float32)).astype(dtype)  # noqa: E731
        rows_per_slab = max(1, min(shape[0], SLAB_ELEMENTS // math.prod(shape[1:])))
        return jax.lax.map(row, jax.random.split(key, shape[0]), batch_size=rows_per_slab)

    shapes, axes = flatten_params(param_shapes(config)), param_axes(config)
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    vector = {name: len([a for a in axes[name] if a != "layers"]) == 1 for name in shapes}
    return unflatten_params({name: draw(key, shape, config.dtype, vector[name])
                             for key, (name, shape) in zip(keys, shapes.items())})


def linnet_model(protocol: Protocol):
    """(seconds, linnet_jax.Model) of the protocol's shapes with `random_params`, ready on the device."""
    import jax
    import linnet_jax
    from linnet_jax.models import Config

    config = Config.from_hf(protocol.hf_config)
    seconds, params = timed(lambda: jax.block_until_ready(random_params(config)))
    return seconds, linnet_jax.Model(config, params)


def section_batch1(args: argparse.Namespace, protocol: Protocol) -> dict:
    """linnet_jax.generate, batch 1, timed by `measure_generate`."""
    import linnet_jax

    setup_s, model = linnet_model(protocol)
    ids = prompt_ids(protocol)
    generate = lambda n: linnet_jax.generate(model, tokens=ids, max_new_tokens=n, ignore_eos=True)  # noqa: E731
    layers = "per-layer views" if model.plan.unstacked_layers else "the stacked weights"
    result = measure_generate(generate, protocol, sync=lambda: None, compiles=compile_counter())
    notes = [f"the cached programs take {layers} under {model.plan} (linnet_jax.backend)"]
    return {**result, "setup_s": setup_s, **jax_device_report(), "notes": notes + result["notes"]}


def drive(engine, prompts: list[list[int]], new_tokens: int, in_flight: int) -> tuple[float, list[tuple]]:
    """Submit every prompt (new_tokens each, eos ignored), at most in_flight unfinished at a time.
    Returns (seconds from the first submission to the last completion, [(handle, finished at)])."""
    import queue

    finished = queue.Queue()
    engine.on_finish.append(lambda handle: finished.put((handle, time.perf_counter())))
    waiting = list(reversed(prompts))
    submit = lambda: engine.submit(tokens=waiting.pop(), max_tokens=new_tokens, ignore_eos=True)  # noqa: E731
    start = time.perf_counter()
    for _ in range(min(in_flight, len(prompts))):
        submit()
    done = []
    while len(done) < len(prompts):
        done.append(finished.get(timeout=DRIVE_TIMEOUT_S))
        if waiting:
            submit()
    return time.perf_counter() - start, done


def serving_stats(wall_s: float, done: list[tuple], new_tokens: int) -> dict:
    """Generated tok/s, TTFT and TPOT percentiles (ms) of the finished requests; a RuntimeError if any request
    stopped short of new_tokens."""
    short = [h.generation for h, _ in done if len(h.generation.tokens) != new_tokens]
    if short:
        raise RuntimeError(f"{len(short)} requests stopped short of {new_tokens} tokens, e.g. {len(short[0].tokens)} "
                           f"tokens, stop reason {short[0].stop_reason!r}")
    ttft = [h.first_token_at - h.submitted for h, _ in done]
    tpot = [(at - h.first_token_at) / (new_tokens - 1) for h, at in done] if new_tokens > 1 else []
    ms = lambda values, q: 1e3 * percentile(values, q) if values else None  # noqa: E731
    return {"serve_tok_s": len(done) * new_tokens / wall_s, "serve_wall_s": wall_s,
            "serve_ttft_p50_ms": ms(ttft, 50), "serve_ttft_p99_ms": ms(ttft, 99),
            "serve_tpot_p50_ms": ms(tpot, 50), "serve_tpot_p99_ms": ms(tpot, 99)}


def section_serve(args: argparse.Namespace, protocol: Protocol) -> dict:
    """linnet_jax.serve.Engine over the serving workload, in-process (see the module docstring)."""
    from linnet_jax.serve import Engine

    setup_s, model = linnet_model(protocol)
    prompts, compiles = workload(protocol), compile_counter()
    with Engine(model, slots=protocol.slots, max_len=protocol.max_len) as engine:
        warm_s, _ = timed(engine.warmup)
        compiled = compiles()
        wall_s, done = drive(engine, prompts, protocol.new_tokens, protocol.in_flight)
        compiled = compiles() - compiled
    notes = [f"{protocol.requests} requests of {protocol.prompt_range[0]}-{protocol.prompt_range[1]} ids, "
             f"{protocol.new_tokens} new each, <= {protocol.in_flight} unfinished, {protocol.slots} slots of "
             f"{protocol.max_len}; warm-up (engine.warmup(): every program) {warm_s:.1f} s; "
             f"compilations during the timed run: {compiled}"]
    return {**serving_stats(wall_s, done, protocol.new_tokens), "setup_s": setup_s, "first_call_s": warm_s,
            "notes": notes, **jax_device_report()}


def torch_device():
    """(torch.device, its synchronize, "cuda: <name>") for the torch sections: the GPU where there is one."""
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda"), torch.cuda.synchronize, f"cuda: {torch.cuda.get_device_name()}"
    return torch.device("cpu"), lambda: None, f"cpu: {platform.processor() or 'cpu'}"


def transformers_label(args: argparse.Namespace) -> str:
    if args.no_torch_compile:
        return "transformers, static cache, eager"
    return f"transformers, static cache + torch.compile ({args.torch_compile_mode})"


def section_transformers(args: argparse.Namespace, protocol: Protocol) -> dict:
    """transformers' generate with one StaticCache and (unless --no-torch-compile) a compiled forward."""
    import inspect

    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    device, sync, description = torch_device()
    hf = dict(protocol.hf_config)
    config = transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)

    def build():
        with device:
            return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()

    setup_s, model = timed(build, sync=sync)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    # transformers 5.24 names the cache argument `cache`, earlier 5.x `past_key_values`
    cache_argument = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    cache = transformers.StaticCache(config=model.config, max_cache_len=protocol.prompt_tokens + protocol.new_tokens)
    if not args.no_torch_compile:
        model.forward = torch.compile(model.forward, mode=args.torch_compile_mode, fullgraph=True)
    ids = torch.tensor([prompt_ids(protocol)], device=device)

    def generate(n: int) -> list[int]:
        cache.reset()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                             min_new_tokens=n, pad_token_id=config.eos_token_id, disable_compile=True,
                             **{cache_argument: cache})  # generate runs under torch.no_grad
        return out[0, ids.shape[1]:].tolist()

    result = measure_generate(generate, protocol, sync)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    return {**result, "setup_s": setup_s, "peak_gib": peak, "device": description,
            "notes": [f"torch {torch.__version__}, transformers {transformers.__version__}, "
                      f"attention {model.config._attn_implementation}, {cache_argument}=StaticCache"]}


def export_random_model(kind: str, args: argparse.Namespace, protocol: Protocol) -> dict:
    """Write `export.<kind>` ("stablehlo" or "torch_source") of the random model into args.export_dir (in a child
    process of the section that runs it)."""
    import linnet_jax

    _, model = linnet_model(protocol)
    max_len = protocol.prompt_tokens + protocol.new_tokens
    if kind == "stablehlo":
        linnet_jax.export.stablehlo(model, args.export_dir, batch=1, max_len=max_len, progress=False)
    else:
        linnet_jax.export.torch_source(model, args.export_dir, max_len=max_len)
    return {}


@contextlib.contextmanager
def exported(kind: str, args: argparse.Namespace) -> Iterator[tuple[float, Path]]:
    """(seconds, directory): `export_random_model(kind)` run by a child process into a temporary directory,
    which is removed after the block."""
    with tempfile.TemporaryDirectory(prefix=f"linnet-gpu-{kind}-") as scratch:
        directory = Path(scratch) / "export"
        command = [*worker_command(f"{kind}_export", args), "--export-dir", str(directory)]
        seconds, reply = timed(run_worker, command)
        if "error" in reply:
            raise RuntimeError(f"the export failed: {reply['error']}")
        yield seconds, directory


def section_stablehlo(args: argparse.Namespace, protocol: Protocol) -> dict:
    """export.stablehlo in a child process, then its programs reloaded by the export's own load.py and timed here
    (no linnet_jax): greedy ids with the decode steps in one loop on the device (`Export.greedy_ids`)."""
    with exported("stablehlo", args) as (export_s, directory):
        load_s, export = timed(import_path(directory / "load.py").Export, directory)
        ids = prompt_ids(protocol)
        result = measure_generate(functools.partial(export.greedy_ids, ids), protocol, sync=lambda: None,
                                  compiles=compile_counter())
    notes = [f"export (its own process, weights made and written) {export_s:.1f} s; load (file to device) "
             f"{load_s:.1f} s"]
    return {**result, "setup_s": load_s, "notes": notes + result["notes"], **jax_device_report()}


def torch_source_label(args: argparse.Namespace) -> str:
    if args.no_torch_compile:
        return "linnet_jax, generated PyTorch, eager"
    return f"linnet_jax, generated PyTorch + torch.compile ({args.torch_compile_mode})"


def section_torch_source(args: argparse.Namespace, protocol: Protocol) -> dict:
    """export.torch_source in a child process, then its model.py (torch only: no linnet_jax, no transformers) on
    the GPU: `load_weights(device=...)`, torch.compile of the module unless --no-torch-compile (mode
    --torch-compile-mode: "reduce-overhead" replays each step as a CUDA graph, the cache written in place at
    its static address), and the file's own greedy `generate`."""
    import torch

    device, sync, description = torch_device()
    with exported("torch_source", args) as (export_s, directory):
        module = import_path(directory / "model.py")
        load_s, params = timed(module.load_weights, None, device, sync=sync)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    step = params if args.no_torch_compile else torch.compile(params, mode=args.torch_compile_mode)
    ids = prompt_ids(protocol)
    result = measure_generate(lambda n: module.generate(step, ids, max_new_tokens=n, stop_ids=()), protocol, sync)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    notes = [f"export (its own process, weights made and written) {export_s:.1f} s; load (file to device) "
             f"{load_s:.1f} s; torch {torch.__version__}"]
    return {**result, "setup_s": load_s, "peak_gib": peak, "device": description, "notes": notes + result["notes"]}


@dataclasses.dataclass(frozen=True)
class Section:
    label: Callable[[argparse.Namespace], str]
    run: Callable[[argparse.Namespace, Protocol], dict]
    cap_s: int  # the longest it may run on an H200 (scaled by the protocol's cap_scale)


SECTIONS = {
    "batch1": Section(lambda args: "linnet_jax generate", section_batch1, cap_s=240),
    "serve": Section(lambda args: "linnet_jax serve.Engine", section_serve, cap_s=330),
    "transformers": Section(transformers_label, section_transformers, cap_s=330),
    "stablehlo": Section(lambda args: "linnet_jax, StableHLO reloaded", section_stablehlo, cap_s=270),
    "torch_source": Section(torch_source_label, section_torch_source, cap_s=330),
}
WORKERS = {name: section.run for name, section in SECTIONS.items()} | {
    f"{kind}_export": functools.partial(export_random_model, kind) for kind in ("stablehlo", "torch_source")}


def worker_main(args: argparse.Namespace) -> int:
    """Run one section (or the export); its result, or {"error"}, goes to the parent as a JSON line. The exit
    status, 1 on an error."""
    return reply_once(lambda: WORKERS[args.worker](args, TINY if args.tiny else FULL))


# --------------------------------------------------------------------------------------------
# The parent: one process per section, a budget, a row per section printed as it ends, one table.


def worker_command(name: str, args: argparse.Namespace) -> list[str]:
    """This file as a worker for `name`, with the options that change what it measures."""
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", name,
               "--torch-compile-mode", args.torch_compile_mode]
    return command + ["--tiny"] * args.tiny + ["--no-torch-compile"] * args.no_torch_compile


def run_section(name: str, args: argparse.Namespace, limit_s: float) -> dict:
    """One section in its own process group (its output on stderr), killed after limit_s; its row."""
    section_s, result = timed(run_worker, worker_command(name, args), limit_s)
    if result.get("error"):
        result["error"] = result["error"][:400]
    return {"section": name, "system": SECTIONS[name].label(args), "section_s": section_s} | result


def number(value, pattern: str, unit: str = "") -> str:
    return "–" if value is None else f"{format(value, pattern)}{unit}"


def row_line(row: dict) -> str:
    """One row as a line, printed when its section ends."""
    if row.get("error"):
        return f"[{row['section']}] {row['system']}: FAILED: {row['error']}"
    get = row.get
    parts = [f"TTFT {number(get('ttft_ms'), ',.1f', ' ms')}", f"decode {number(get('decode_tok_s'), ',.1f')} tok/s"]
    if "serve_tok_s" in row:
        p50, p99 = number(get("serve_ttft_p50_ms"), ",.0f"), number(get("serve_ttft_p99_ms"), ",.0f")
        parts = [f"{number(get('serve_tok_s'), ',.0f')} generated tok/s", f"TTFT p50/p99 {p50}/{p99} ms"]
    parts += [f"first call {number(get('first_call_s'), '.1f', ' s')}",
              f"peak {number(get('peak_gib'), '.2f', ' GiB')}", f"section {number(get('section_s'), '.0f', ' s')}"]
    return f"[{row['section']}] {row['system']} ({row.get('device', '?')}): " + ", ".join(parts)


def find(rows: list[dict], section: str) -> dict | None:
    """The section's row if it measured something."""
    return next((row for row in rows if row["section"] == section and not row.get("error")), None)


def agreement(rows: list[dict]) -> list[str]:
    """How many leading greedy ids each export's row shares with batch1's (same weights, same prompt)."""
    native = find(rows, "batch1")
    lines = []
    for section, name in (("stablehlo", "StableHLO reloaded"), ("torch_source", "the generated PyTorch")):
        exported = find(rows, section)
        if native and exported:
            same = leading_agreement(exported["tokens"], native["tokens"])
            lines.append(f"{name}'s greedy ids agree with generate's for the first {same} of "
                         f"{len(native['tokens'])} tokens")
    return lines


def bars(rows: list[dict], tiny: bool) -> list[str]:
    """The issue's bars, met or missed, and the seed's H100 figures scaled to an H200."""
    native, torch_row = find(rows, "batch1"), find(rows, "transformers")
    decode = native and native.get("decode_tok_s")
    compiled = torch_row and "torch.compile" in torch_row["system"]
    speedup = ratio(decode, torch_row and torch_row.get("decode_tok_s"))
    verdict = lambda ok: "met" if ok else "missed"  # noqa: E731
    lines = [f"decode >= {DECODE_BAR:.0f} tok/s: " + (verdict(decode >= DECODE_BAR) + f" ({decode:,.1f} tok/s)"
                                                      if decode else "not measured")]
    if speedup and compiled:
        lines.append(f"decode >= {RATIO_BAR}x transformers compiled: {verdict(speedup >= RATIO_BAR)} ({speedup:.2f}x)")
    else:
        lines.append(f"decode >= {RATIO_BAR}x transformers compiled: not measured"
                     + (" (transformers ran without torch.compile)" if speedup else ""))
    lines.append("seed's H100 figures scaled by 1.43 (H200/H100 bandwidth): " + "; ".join(
        f"{name} {h100 * H200_OVER_H100:.0f} tok/s" for name, h100 in SEED_H100_DECODE.items()))
    if tiny:
        lines.append("(tiny config on this machine: the bars are for the full protocol on an H200)")
    return lines


def table(rows: list[dict]) -> str:
    """Every row in one markdown table, with linnet_jax's ratios to transformers."""
    reference = find(rows, "transformers") or {}
    head = ("| row | TTFT | decode | generated tok/s (serving) | serving TTFT p50 / p99 | serving TPOT p50 | "
            "first call (warm-up) | setup | peak device memory | decode ÷ transformers | memory ÷ transformers |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for row in rows:
        if row.get("error"):
            lines.append(f"| {row['system']} | {' '.join(row['error'].replace('|', '/').split())} |" + " – |" * 9)
            continue
        lines.append("| " + " | ".join([
            row["system"], number(row.get("ttft_ms"), ",.1f", " ms"), number(row.get("decode_tok_s"), ",.1f", " tok/s"),
            number(row.get("serve_tok_s"), ",.0f"),
            f"{number(row.get('serve_ttft_p50_ms'), ',.0f')} / {number(row.get('serve_ttft_p99_ms'), ',.0f')} ms"
            if "serve_tok_s" in row else "–",
            number(row.get("serve_tpot_p50_ms"), ",.1f", " ms"), number(row.get("first_call_s"), ".1f", " s"),
            number(row.get("setup_s"), ".1f", " s"), number(row.get("peak_gib"), ".2f", " GiB"),
            number(ratio(row.get("decode_tok_s"), reference.get("decode_tok_s")), ".2f", "×"),
            number(ratio(row.get("peak_gib"), reference.get("peak_gib")), ".2f", "×"),
        ]) + " |")
    return "\n".join(lines)


def report(rows: list[dict], args: argparse.Namespace, protocol: Protocol, elapsed_s: float) -> str:
    """The whole report: what was run, where, the table, the bars and every row's notes."""
    devices = sorted({row["device"] for row in rows if row.get("device")})
    lines = [f"## GPU protocol: {protocol.name}", "",
             f"Measured {datetime.datetime.now():%Y-%m-%d %H:%M} on {', '.join(devices) or 'no device reported'}; "
             f"{versions(VERSIONS)}. Command: `{' '.join(sys.argv)}` ({elapsed_s:.0f} s).",
             f"Batch 1: {protocol.prompt_tokens} prompt ids + {protocol.new_tokens} new, greedy, median of "
             f"{protocol.runs} after {protocol.warmups} warm-ups (and a first call). Serving: "
             f"{protocol.requests} requests of {protocol.prompt_range[0]}-{protocol.prompt_range[1]} ids, "
             f"{protocol.new_tokens} new, <= {protocol.in_flight} in flight, {protocol.slots} slots of "
             f"{protocol.max_len}.", "", table(rows), ""]
    lines += [f"- {line}" for line in bars(rows, args.tiny) + agreement(rows)]
    for row in rows:
        lines += [f"- {row['system']}: {note}" for note in row.get("notes", [])]
        if row.get("per_run"):
            lines.append(f"- {row['system']}: per run {json.dumps(row['per_run'])}")
    return "\n".join(lines) + "\n"


def write_outputs(out: Path, rows: list[dict], text: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu.json").write_text(json.dumps(rows, indent=1))
    (out / "gpu.md").write_text(text)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated, run in this order (default: all, {','.join(SECTIONS)})")
    parser.add_argument("--budget-s", type=float, default=None,
                        help=f"the whole run's seconds (default {FULL.budget_s}; --tiny {TINY.budget_s})")
    parser.add_argument("--tiny", action="store_true", help="the tiny config and workload (the suite runs this)")
    parser.add_argument("--no-torch-compile", action="store_true", help="transformers eager (static cache still)")
    parser.add_argument("--torch-compile-mode", default="reduce-overhead", help="torch.compile's mode")
    parser.add_argument("--out", type=Path, help="write gpu.json and gpu.md here (after every section)")
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--export-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = [name for name in args.sections.split(",") if name not in SECTIONS]
    if unknown:
        parser.error(f"unknown section {unknown[0]!r}; choose from {', '.join(SECTIONS)}")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    protocol = TINY if args.tiny else FULL
    budget_s = args.budget_s or protocol.budget_s
    start, rows = time.perf_counter(), []
    print(f"GPU protocol: {protocol.name}; sections {args.sections}; budget {budget_s:.0f} s", flush=True)
    for name in args.sections.split(","):
        left_s = budget_s - (time.perf_counter() - start)
        if left_s < MIN_START_S:
            row = {"section": name, "system": SECTIONS[name].label(args),
                   "error": f"not run: {left_s:.0f} s of the {budget_s:.0f} s budget left"}
        else:
            limit_s = min(SECTIONS[name].cap_s * protocol.cap_scale, left_s)
            print(f"[{name}] started, at most {limit_s:.0f} s", flush=True)
            row = run_section(name, args, limit_s)
        rows.append(row)
        print(row_line(row), flush=True)
        text = report(rows, args, protocol, time.perf_counter() - start)
        if args.out:
            write_outputs(args.out, rows, text)
    print("\n" + text, flush=True)
    return 1 if any(row.get("error") for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
