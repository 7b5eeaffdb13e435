"""Launching and reporting on the processes of a `jax.distributed` job on loopback (tests/test_distributed.py,
tests/test_serve_multiprocess.py): each in its own process group, its stdout and stderr in files, every group
killed when the test is done, and a failure that shows each process's stderr tail."""

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stderr_tail(path: Path, chars: int = 4000) -> str:
    """The end of a process's stderr without gloo's connection chatter."""
    lines = [line for line in path.read_text(errors="replace").splitlines() if not line.startswith("[Gloo]")]
    return "\n".join(lines)[-chars:]


def cpu_env(local_devices: int | None = None) -> dict[str, str]:
    """This environment for a process of a CPU job: JAX on the CPU (with `local_devices` fake devices when given),
    one thread per BLAS and tokenizer."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env |= {"JAX_PLATFORMS": "cpu", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    if local_devices is not None:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={local_devices}"
    return env


class Group:
    """Processes started in their own process groups, logging to log_dir/NAME.out and NAME.err; leaving the `with`
    block kills every group (SIGKILL: each process and anything it started).

    with Group(tmp_path) as group:
        group.start("worker0", [sys.executable, ...], env)
        group.wait(lambda: ..., timeout=60, what="the server answers")
    """

    def __init__(self, log_dir: Path, started: list | None = None):
        self.log_dir = log_dir
        self.names: list[str] = []
        self.started = [] if started is None else started  # the Popens, in start order

    def start(self, name: str, argv: Sequence[str], env: dict[str, str]) -> subprocess.Popen:
        with open(self.log_dir / f"{name}.out", "w") as stdout, open(self.log_dir / f"{name}.err", "w") as stderr:
            process = subprocess.Popen(list(argv), stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL, cwd=ROOT,
                                       env=env, start_new_session=True)
        self.names.append(name)
        self.started.append(process)
        return process

    def stdout(self, name: str) -> str:
        return (self.log_dir / f"{name}.out").read_text()

    def report(self) -> str:
        """Each process's exit status (None: running) and stderr tail."""
        return "\n".join(f"--- {name} (exit {process.poll()}) stderr tail:\n{stderr_tail(self.log_dir / f'{name}.err')}"
                         for name, process in zip(self.names, self.started))

    def wait(self, done: Callable[[], bool], timeout: float, what: str, failed: Callable[[int], bool] = bool) -> None:
        """Until done() (polled every 0.2 s); pytest.fail with the report when a process exits with a status that
        `failed` (default: non-zero) or after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            if any(process.poll() is not None and failed(process.returncode) for process in self.started):
                pytest.fail(f"a process failed while waiting for {what}\n{self.report()}")
            if done():
                return
            if time.monotonic() > deadline:
                pytest.fail(f"{what}: timed out after {timeout} s\n{self.report()}")
            time.sleep(0.2)

    def __enter__(self) -> "Group":
        return self

    def __exit__(self, *exc) -> None:
        for process in self.started:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()
