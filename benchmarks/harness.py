"""What every benchmark script shares: worker processes, timing, peak memory, table cells, results files.

A section script (decode.py, serve.py, train.py, gpu.py, ...) describes its rows and what each measures; this
file runs the measuring parts in worker processes of their own (`run_worker` in the parent, `reply_once` or
`protocol_channel` in the worker: replies are JSON lines on the worker's stdout, whatever the libraries print
goes to stderr), times calls (`timed`, `decode_tok_s`, `median`, `percentile`), reads peak memory
(`peak_rss_gib` of this process, `RssSampler` of a process tree), formats cells (`fmt`, `ratio`, `no_figures`)
and writes results (`write_json` for benchmarks/page.py, `write_results` between markers in RESULTS.md).
Nothing here imports JAX or torch: a worker imports what it measures.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "RESULTS.md"
TORCH_THREADS = 2  # torch's intra-op threads in the CPU rows (the machine's cores)
TORCH_INSTALL = ("pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu && "
                 "pip install transformers==5.24.0")


def import_path(path: Path):
    """The Python file at path as a module (an export's load.py or model.py), under its file's stem."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def missing_modules(modules: tuple[str, ...], install: str) -> str | None:
    """"not installed: ..." with the command that installs them, when any of `modules` cannot be imported; else None."""
    absent = [m for m in modules if importlib.util.find_spec(m) is None]
    return f"not installed (no {', '.join(absent)}): {install}" if absent else None


# --------------------------------------------------------------------------------------------
# Timing.


def timed(fn: Callable, *args, sync: Callable[[], None] = lambda: None):
    """(seconds, result) of fn(*args); sync (a device synchronization) runs before the clock starts and before it
    stops."""
    sync()
    start = time.perf_counter()
    result = fn(*args)
    sync()
    return time.perf_counter() - start, result


def decode_tok_s(new_tokens: int, full_s: float, ttft_s: float) -> float:
    """Decode speed of one pair of calls: (new_tokens - 1) / (a full call - a one-token call)."""
    return (new_tokens - 1) / (full_s - ttft_s)


def median(values: list[float]) -> float | None:
    """The median, None without values."""
    return statistics.median(values) if values else None


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (linear interpolation, as numpy's default), or None without values."""
    return float(np.percentile(values, q)) if values else None


def leading_agreement(tokens: list[int], reference: list[int]) -> int:
    """How many leading tokens are identical."""
    return next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))


# --------------------------------------------------------------------------------------------
# Memory.


def peak_rss_gib() -> float:
    """This process's own peak resident set size (VmHWM), in GiB. Not ru_maxrss: Linux carries that over from
    the parent across fork and exec, so a worker started by a larger process would report the parent's peak."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 2**20


def tree_rss_bytes(root: int) -> int:
    """Resident memory of a process and all its descendants, from /proc (0 for a process already gone)."""
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            total += next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS"))
            for task in Path(f"/proc/{pid}/task").iterdir():
                stack += [int(child) for child in (task / "children").read_text().split()]
        except (OSError, StopIteration):
            continue
    return total


class RssSampler(threading.Thread):
    """The peak of tree_rss_bytes(pid), sampled every `period` seconds until stopped."""

    def __init__(self, pid: int, period: float = 0.2):
        super().__init__(daemon=True)
        self.pid, self.period, self.peak = pid, period, 0
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.period):
            self.peak = max(self.peak, tree_rss_bytes(self.pid))

    def stop(self) -> float:
        """Stop sampling; the peak in GiB."""
        self.stopped.set()
        self.join()
        return self.peak / 2**30


# --------------------------------------------------------------------------------------------
# Worker processes: a section's script run again as `--worker NAME`, replying in JSON lines on its stdout.


WORKER_ENV = {"TOKENIZERS_PARALLELISM": "false", "TQDM_DISABLE": "1"}


def protocol_channel():
    """A private copy of stdout for replies; fd 1 then points at stderr, so library prints stay off the protocol."""
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    return channel


def error_reply(error: BaseException) -> dict:
    """A failure as a reply: {"error": "Type: message"}."""
    return {"error": f"{type(error).__name__}: {error}".strip()}


def reply_once(work: Callable[[], dict]) -> int:
    """A one-shot worker's main: work()'s reply, or its failure (traceback on stderr), as one JSON line on the
    protocol channel; the exit status, 1 on a failure."""
    channel = protocol_channel()
    try:
        reply = work()
    except Exception as error:  # reported as the row's failure
        traceback.print_exc()
        reply = error_reply(error)
    print(json.dumps(reply), file=channel)
    return 1 if "error" in reply else 0


def run_worker(command: list[str], timeout_s: float | None = None) -> dict:
    """A one-shot worker in its own process group (its stderr on ours): its last JSON line, or {"error"} when it
    printed none or ran past timeout_s (then the whole group is killed)."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=os.environ | WORKER_ENV,
                               start_new_session=True)
    try:
        out, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        return {"error": f"timed out after {timeout_s:.0f} s"}
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    lines = out.strip().splitlines()
    return json.loads(lines[-1]) if lines else {"error": f"worker exited with status {process.returncode}"}


# --------------------------------------------------------------------------------------------
# Table cells.


def fmt(value, pattern: str) -> str:
    """The value in a `str.format` pattern, "–" for None."""
    return "–" if value is None else pattern.format(value)


def ratio(numerator, denominator) -> float | None:
    """numerator / denominator, None when either is missing (or zero)."""
    return numerator / denominator if numerator and denominator else None


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def no_figures(error: str | None, default: str) -> str:
    """The cell of a row without figures: "not installed: ..." as it is, anything else as a failure."""
    return error if error and error.startswith("not installed") else f"failed: {error or default}"


# --------------------------------------------------------------------------------------------
# Where and with what a run was measured; the results files.


def machine() -> str:
    """CPU model, core count and memory, from /proc."""
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor() or "unknown CPU")
    mem_kib = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                   if line.startswith("MemTotal"))
    return f"{cpu}, {os.cpu_count()} cores, {mem_kib / 2**20:.0f} GiB"


def code_version() -> str:
    """The repository's commit, and whether the working tree had changes."""
    def git(*argv: str) -> str:
        done = subprocess.run(["git", *argv], cwd=HERE, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""
    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    return commit + (" with uncommitted changes" if git("status", "--porcelain") else "")


def versions(names: tuple[str, ...] = ("jax", "jaxlib", "torch", "transformers", "llama_cpp_python")) -> str:
    """The installed versions of `names` ("not installed" for those absent) and Python's."""
    def version(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"
    return ", ".join(f"{n} {version(n)}" for n in names) + f", Python {platform.python_version()}"


def command_line(script: str, argv: list[str]) -> str:
    """How the run was started, as a shell command from the repository root."""
    return " ".join([f"python benchmarks/{script}", *map(shlex.quote, argv)])


def write_json(path: Path, section: str, rows: list[dict], args: argparse.Namespace, command: str,
               skip: tuple[str, ...] = ("json", "no_write", "worker"), **measured) -> None:
    """A run's rows and how they were measured (where, when, the protocol's parameters, the command), as JSON:
    what benchmarks/page.py renders. `skip`: the arguments that are not part of the protocol; `measured`: figures
    of the run beside its rows (decode's read bandwidth)."""
    protocol = {k: v for k, v in vars(args).items() if k not in skip}
    payload = {"section": section, "command": command, "measured": datetime.datetime.now().isoformat("T", "minutes"),
               "machine": machine(), "versions": versions(), "code_version": code_version(), "protocol": protocol,
               **measured, "rows": rows}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, ensure_ascii=False, default=str) + "\n")


def write_results(section: str, marks: tuple[str, str], heading: str = "", path: Path = RESULTS) -> None:
    """Replace the text between the markers, keeping the rest of the file; absent, add them at the end (after
    `heading`)."""
    mark_start, mark_end = marks
    block = f"{mark_start}\n{section}\n{mark_end}"
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    start, end = text.find(mark_start), text.find(mark_end)
    if start >= 0 and end > start:
        text = text[:start] + block + text[end + len(mark_end):]
    else:
        text = text.rstrip("\n") + "\n\n" + heading + block + "\n"
    path.write_text(text)
