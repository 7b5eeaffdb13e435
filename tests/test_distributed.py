"""Two real processes on loopback (`jax.distributed`, gloo CPU collectives, 4 fake devices each)
load a tiny random llama onto meshes over all 8 devices and generate: both must print the ids
(and last-position logits) that one process on one device computes. The workers run in their own
process groups, are killed in a `finally`, and a hang fails with their stderr instead of hanging
the suite. The worker is tests/distributed_worker.py."""

import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from batches import right_padded
from processes import Group, cpu_env, free_port

import linnet_jax

WORKER = Path(__file__).with_name("distributed_worker.py")
PROCESSES = 2
TIMEOUT_S = 240
PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [12], [40, 41, 42, 43, 44], [100, 101],
           [7] * 10, [200, 3, 4], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 250, 17, 33]]
MAX_NEW_TOKENS = 12
CASES = [
    # batch over data (crosses the processes), heads/kv heads/mlp/vocab over tensor (within one)
    {"name": "data2_tensor4", "mesh": {"data": 2, "tensor": 4}, "rules": "tp"},
    # batch and every weight split over all 8 devices of both processes
    {"name": "fsdp8", "mesh": {"fsdp": 8}, "rules": "fsdp"},
]


@pytest.fixture(scope="module")
def reference(shardable_dir):
    """(greedy ids, last-position logits [B, V]) from one process on one device."""
    model = linnet_jax.load(shardable_dir, progress=False)
    ids = linnet_jax.generate(model, tokens=PROMPTS, max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    padded, mask = right_padded(PROMPTS)
    logits = np.asarray(linnet_jax.logits(model, padded, attention_mask=mask))
    return ids, logits[np.arange(len(PROMPTS)), [len(p) - 1 for p in PROMPTS]]


def run_workers(model_dir: Path, request: dict, log_dir: Path, timeout: float, num_processes: int = PROCESSES,
                process_ids=None, started: list | None = None) -> list[dict]:
    """Start a worker for each of process_ids (default: all of num_processes) and return their JSON lines.

    Fails, with every worker's stderr tail, when one exits non-zero or all are not done by `timeout`
    seconds; either way every worker's process group is killed before this returns.
    """
    port, env = free_port(), cpu_env()
    process_ids = range(num_processes) if process_ids is None else process_ids
    with Group(log_dir, started) as group:
        for i in process_ids:
            group.start(f"worker{i}", [sys.executable, str(WORKER), str(model_dir), str(port), str(i),
                                       str(num_processes), json.dumps(request)], env)
        group.wait(lambda: all(p.poll() is not None for p in group.started), timeout, "the distributed workers")
    return [json.loads(line) for i in process_ids for line in group.stdout(f"worker{i}").splitlines()
            if line.startswith("{")]


def test_two_processes_generate_the_ids_of_one(shardable_dir, reference, tmp_path):
    ids, logits = reference
    start = time.monotonic()
    lines = run_workers(shardable_dir, {"prompts": PROMPTS, "max_new_tokens": MAX_NEW_TOKENS, "cases": CASES},
                        tmp_path, TIMEOUT_S)
    print(f"two workers, {len(CASES)} meshes: {time.monotonic() - start:.1f} s")
    results = {(line["case"], line["process"]): line for line in lines}
    for case in CASES:
        for process in range(PROCESSES):
            got = results.get((case["name"], process))
            assert got is not None, f"no result from process {process} for {case['name']}: {lines}"
            assert got["ids"] == ids, f"{case['name']}, process {process}: ids differ from one device"
            np.testing.assert_allclose(np.asarray(got["logits_last"]), logits, atol=1e-4, rtol=1e-4,
                                       err_msg=f"{case['name']}, process {process}")


def test_a_hung_worker_times_out_and_nothing_is_left_running(shardable_dir, tmp_path):
    """Two workers of a three-process job wait for the third forever: the harness kills both and says so."""
    started = []
    with pytest.raises(pytest.fail.Exception, match="timed out") as failure:
        run_workers(shardable_dir, {"prompts": PROMPTS, "max_new_tokens": 1, "cases": []}, tmp_path, timeout=10,
                    num_processes=3, process_ids=(0, 1), started=started)
    assert "--- worker0" in str(failure.value) and "--- worker1" in str(failure.value)
    assert len(started) == 2
    for process in started:
        assert process.returncode == -signal.SIGKILL
        with pytest.raises(ProcessLookupError):
            os.killpg(process.pid, 0)
