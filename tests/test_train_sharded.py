"""The train step on 8 fake CPU devices (tests/train_worker.py in a subprocess): FSDP and TP presets give the
losses of one device, the optimizer state is placed like the params, and a checkpoint saved on fsdp=8
restores onto data=2 × fsdp=4."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import record_parity

WORKER = Path(__file__).with_name("train_worker.py")
BOUND = 1e-5  # relative


@pytest.fixture(scope="module")
def results(shardable_dir, tmp_path_factory):
    done = subprocess.run([sys.executable, str(WORKER), str(shardable_dir), str(tmp_path_factory.mktemp("ckpt"))],
                          capture_output=True, text=True, timeout=900, cwd=WORKER.parent.parent)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def relative(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b)) / np.abs(np.asarray(b))))


@pytest.mark.parametrize("case", ["fsdp=8", "dp=2 x tp=4", "fsdp=4 x tp=2"])
def test_sharded_losses_equal_one_device(results, case):
    assert results["devices"] == 8
    got, one = results["cases"][case], results["cases"]["one device"]
    assert got["split"] == {"embed": True, "w_gate": True}  # the weights really are spread over the devices
    assert got["opt_state_placed_like_params"]
    for mode in ("full", "lora"):
        if got[mode] is None:
            continue
        diff = relative(got[mode], one[mode])
        record_parity(f"train {mode} sharded {case}: losses vs one device, relative (not transformers)", diff)
        assert diff <= BOUND, (mode, got[mode], one[mode])


def test_checkpoint_restores_onto_another_mesh(results):
    restored = results["restored"]
    assert restored["step"] == 2 and restored["position"] == {"epoch": 0, "row": 16}
    assert restored["mesh"] == {"data": 2, "fsdp": 4, "tensor": 1} and restored["opt_state_placed_like_params"]
    assert relative(restored["loss_step_3"], results["cases"]["one device"]["full"][2]) <= BOUND


def test_two_processes_train_the_steps_of_one(shardable_dir, tmp_path):
    """Two processes under jax.distributed on 127.0.0.1 (4 fake devices each) train the same steps, on meshes over
    all 8 devices, with the losses of one process on one device."""
    import linnet_jax
    from batches import train_losses
    from test_distributed import CASES, TIMEOUT_S, run_workers

    expected = train_losses(linnet_jax.load(shardable_dir, progress=False), 3)
    lines = run_workers(shardable_dir, {"prompts": [[1]], "max_new_tokens": 1, "cases": CASES, "train_steps": 3},
                        tmp_path, TIMEOUT_S)
    assert {(line["case"], line["process"]) for line in lines} == {(c["name"], p) for c in CASES for p in (0, 1)}
    for line in lines:
        diff = relative(line["losses"], expected)
        record_parity(f"train two processes {line['case']}: losses vs one device, relative (not transformers)", diff)
        assert diff <= BOUND, (line, expected)
