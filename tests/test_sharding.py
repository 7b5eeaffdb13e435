"""Sharding: the presets on 8 fake CPU devices (in subprocesses, tests/sharding_worker.py), rules errors here.

Each case must give the one-device greedy ids (up to a near tie) and logits within 1e-5 (tiny) or
3e-4 (SmolLM2, SMOLLM2_BOUND), with each weight split over the devices its rules name, asserted from the bytes
one device really holds. The one-device logits are taken both for the whole batch and row by row:
SmolLM2's batch of 8 and its rows alone differ by ~1.5e-4 on one device already (float32 sums in
another order), and a mesh that gives each device one row computes the row-by-row numbers.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

import linnet_jax
from linnet_jax import sharding
from conftest import record_parity

WORKER = Path(__file__).with_name("sharding_worker.py")
NEAR_TIE = 1e-4
# A float32 sum of n terms taken in another order (a split over devices, XLA's own choices between jaxlib
# releases) moves by ~sqrt(n)·eps·|terms|: SmolLM2's products sum n = 576 (the head, attention) to 1536 (the
# MLP) terms, with logits of magnitude ~20, so sqrt(576..1536) · 1.2e-7 · 20 ≈ 6e-5..9e-5 for one product, before
# 30 layers pass their own rounding on. Measured: 1.05e-4 on jaxlib 0.12.0.1 and 1.22e-4 on 0.11.2; 3e-4 leaves 2.5x the worst.
SMOLLM2_BOUND = 3e-4
TENSOR_AXES = {"heads", "kv_heads", "mlp", "vocab"}

# case -> (devices holding each weight split by the rules: ("all" weights | "tensor" ones), count)
TINY_SPLITS = {
    "dp=8": (None, 1), "tp=2": ("tensor", 2), "tp=4": ("tensor", 4), "fsdp=8": ("all", 8),
    "dp=2 x tp=4": ("tensor", 4), "jax.make_mesh dp=2 x tp=4": ("tensor", 4), "jax.make_mesh fsdp=8": ("all", 8),
}
# jax.make_mesh's meshes and data parallelism (dp=8): the tiny cases; `linnet_jax.shard` of a loaded model: tp=2 below
SMOLLM2_SPLITS = {"fsdp=8": ("all", 8)}


def run_worker(*args: str) -> dict:
    result = subprocess.run([sys.executable, str(WORKER), *args], capture_output=True, text=True, timeout=900,
                            cwd=WORKER.parent.parent)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def tiny_results(shardable_dir):
    return run_worker("tiny", str(shardable_dir))


@pytest.fixture(scope="module")
def smollm2_results():
    return run_worker("smollm2")


def check_case(results: dict, case: str, bound: float, splits: tuple[str | None, int], label: str) -> None:
    result = results["cases"][case]
    assert results["devices"] == 8
    assert result["equal"] or result["near_tie_gap"] < NEAR_TIE, (
        f"{case}: greedy ids differ from one device, with a top-2 gap of {result['near_tie_gap']}")
    # A device holding one row computes it as a batch of one: compare with one device doing the same too.
    closest = min(result["logit_diff"], result["logit_diff_row_by_row"])
    record_parity(f"{label} sharded {case} vs one device (not transformers)", closest)
    assert closest < bound, (result["logit_diff"], result["logit_diff_row_by_row"], results["batch_vs_rows"])
    which, count = splits
    per_device = total = 0
    for name, weight in result["params"].items():
        split = which == "all" or (which == "tensor" and TENSOR_AXES & set(weight["axes"]))
        assert weight["device"] * (count if split else 1) == weight["total"], (case, name, weight)
        per_device, total = per_device + weight["device"], total + weight["total"]
    if which == "all":
        assert per_device * count == total


@pytest.mark.parametrize("case", list(TINY_SPLITS))
def test_tiny_sharded_matches_one_device(tiny_results, case):
    check_case(tiny_results, case, 1e-5, TINY_SPLITS[case], "tiny llama 8/4 heads")
    assert not tiny_results["cases"][case]["warnings"]


@pytest.mark.parametrize("case", list(SMOLLM2_SPLITS))
def test_smollm2_sharded_matches_one_device(smollm2_results, case):
    check_case(smollm2_results, case, SMOLLM2_BOUND, SMOLLM2_SPLITS[case], "SmolLM2")


def test_meshes_of_every_case_have_the_asked_shape(tiny_results):
    sizes = {case: math.prod(result["mesh"].values()) for case, result in tiny_results["cases"].items()}
    assert sizes == {"dp=8": 8, "tp=2": 2, "tp=4": 4, "fsdp=8": 8, "dp=2 x tp=4": 8,
                     "jax.make_mesh dp=2 x tp=4": 8, "jax.make_mesh fsdp=8": 8}


def test_non_dividing_heads_are_replicated_with_one_warning_each(smollm2_results):
    """SmolLM2's 9 query heads and 3 kv heads over tensor=2: those weights stay whole, one warning per array."""
    result = smollm2_results["cases"]["tp=2 (9 heads, 3 kv heads)"]
    assert result["equal"] or result["near_tie_gap"] < NEAR_TIE
    assert min(result["logit_diff"], result["logit_diff_row_by_row"]) < SMOLLM2_BOUND
    for name in ("layers.wq", "layers.wk", "layers.wv", "layers.wo"):
        assert result["params"][name]["device"] == result["params"][name]["total"], name
        mentions = [w for w in result["warnings"] if w.startswith(f"{name}:")]
        assert len(mentions) == 1, (name, result["warnings"])
        heads = 3 if name in ("layers.wk", "layers.wv") else 9
        assert f"of size {heads} is not divisible by mesh axes tensor (2 devices)" in mentions[0], mentions
    split = result["params"]["layers.w_gate"]  # 1536 MLP columns divide
    assert split["device"] * 2 == split["total"]


@pytest.fixture(scope="module")
def tiny_model(tiny_dir):
    return linnet_jax.load(tiny_dir("llama_mha")[1], progress=False)


@pytest.mark.parametrize("rules, message", [
    ({"heads": "tensor", "head_dim": "tensor"},
     "sharding rules put logical axes 'heads' and 'head_dim' of layers.wq (axes ('layers', 'embed', 'heads', "
     "'head_dim')) on the same mesh axis 'tensor'"),
    ({"heads": "model"}, "sharding rule 'heads' -> ('model',): the mesh has no axis 'model'"),
    ({"attention_heads": "tensor"}, "sharding rule for unknown logical axis 'attention_heads'"),
    ({"batch": ("data", "data")}, "names a mesh axis twice"),
    ("zero3", "unknown sharding preset 'zero3'; expected one of ('single', 'dp', 'fsdp', 'tp', 'fsdp_tp')"),
])
def test_bad_rules_are_named(tiny_model, rules, message):
    with pytest.raises(ValueError) as error:
        linnet_jax.shard(tiny_model, sharding.mesh(), rules)
    assert message in str(error.value)


def test_bad_mesh_and_rules_without_mesh(tiny_dir):
    with pytest.raises(ValueError, match=r"mesh\(data=2, fsdp=1, tensor=1\) needs 2 devices; 1 are available"):
        sharding.mesh(data=2)
    with pytest.raises(ValueError, match="rules need a mesh"):
        linnet_jax.load(tiny_dir("llama_mha")[1], rules="tp")


def test_single_device_mesh_changes_nothing(tiny_model):
    """On a 1-device mesh every preset is the unsharded model: same ids, describe shows 100% per device."""
    ids = linnet_jax.generate(tiny_model, tokens=[[1, 2, 3]], max_new_tokens=6, ignore_eos=True)
    for preset in sharding.PRESETS:
        placed = linnet_jax.shard(tiny_model, sharding.mesh(), preset)
        assert linnet_jax.generate(placed, tokens=[[1, 2, 3]], max_new_tokens=6, ignore_eos=True) == ids
        table = sharding.describe(placed)
        assert table.splitlines()[0].startswith("mesh data=1, fsdp=1, tensor=1 (1 device)")
        assert "(100.0% of the total)" in table.splitlines()[-1]
