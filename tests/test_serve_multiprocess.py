"""`linnet-jax serve --coordinator HOST:PORT --num-processes 2 --process-id I`: one engine over two `jax.distributed`
processes on loopback (gloo CPU collectives, 4 fake devices each), the tiny model's weights and cache split over all
8 devices (fsdp, the default mesh). Process 0 schedules and serves HTTP; process 1 runs the same programs on the
leader's schedule (`linnet_jax.serve.lockstep`). 16 concurrent greedy requests, a seeded sampled one and one with a
grammar must give what `generate` gives on one device, and SIGTERM to the leader must end both processes (exit 0).
The processes run in their own process groups, killed at the end whatever happens (tests/processes.py)."""

import os
import signal
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import jax
import numpy as np

from linnet_jax import generate
from linnet_jax.inputs import make_requests, make_sampling
from linnet_jax.serve.lockstep import decode_call, encode
from processes import Group, cpu_env, free_port, stderr_tail

LOCAL_DEVICES = 4
STARTUP_S = 240  # two processes compiling every program on a loaded 2-core machine
MAX_TOKENS = 12
WORDS = "the quiet river carries seven small boats past an old stone mill while birds sing".split()
PROMPTS = [" ".join(WORDS[i % 5:i % 5 + 1 + (3 * i) % 11]) * (1 + i % 3) for i in range(16)]
SAMPLED = dict(prompt="seven small boats", temperature=0.8, top_p=0.9, seed=1234)
CONSTRAINED = dict(prompt="an old stone mill", temperature=0.0, structured_outputs={"regex": "[a-z ]+"})


def reachable(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def complete(url: str, body: dict) -> str:
    response = httpx.post(f"{url}/v1/completions", timeout=120, json=body | {"max_tokens": MAX_TOKENS,
                                                                             "ignore_eos": True})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_a_call_travels_whole():
    """What the leader sends is what the followers run: every kind of host input, arrays bit for bit."""
    request = make_requests(make_sampling(1, 0.7, 5, 0.9, 0.1, 1.1, 42), np.array([[3, -1]], np.int32), 9)
    inputs = ([1, 2], [[5, 6], [7]], [request, request], [True, False], 16, 0.5, None, "s", b"\x00\xff",
              {"slots": 16, "prefix_cache": [64, 10]}, np.arange(6, dtype=np.uint32).reshape(2, 3), np.asarray(True))
    program, got = decode_call(encode("extend", inputs))
    assert program == "extend" and got[:2] + got[3:10] == [*inputs[:2], *inputs[3:10]]
    for sent in got[2]:
        jax.tree.map(np.testing.assert_array_equal, sent, request)
        assert jax.tree.structure(sent) == jax.tree.structure(request)
    np.testing.assert_array_equal(got[10], inputs[10])
    assert got[10].dtype == np.uint32
    assert got[11].shape == () and got[11]  # a 0-d array stays 0-d (the step's `top`)


def start_job(group: Group, model_dir, http: int, follower_flags: tuple[str, ...] = ()) -> None:
    """`linnet-jax serve` as process 0 (HTTP on port `http`) and process 1 of one job (16 slots of 64 positions)."""
    flags = ["serve", "--model", str(model_dir), "--coordinator", f"127.0.0.1:{free_port()}", "--num-processes", "2",
             "--port", str(http), "--slots", "16", "--max-len", "64", "--prefill-chunk", "16", "--no-compilation-cache"]
    for i in range(2):
        group.start(f"process{i}", [sys.executable, "-m", "linnet_jax", *flags, "--process-id", str(i),
                                    *(follower_flags if i else ())], cpu_env(LOCAL_DEVICES))


def test_two_processes_serve_one_sharded_model_as_generate_gives(tiny_chat_dir, tiny_chat, tmp_path):
    http = free_port()
    url = f"http://127.0.0.1:{http}"
    bodies = [dict(prompt=prompt, temperature=0.0) for prompt in PROMPTS] + [SAMPLED, CONSTRAINED]
    with Group(tmp_path) as group:
        start_job(group, tiny_chat_dir, http)
        group.wait(lambda: reachable(url), STARTUP_S, "the leader's /health")
        with ThreadPoolExecutor(len(bodies)) as pool:
            texts = list(pool.map(lambda body: complete(url, body), bodies))
        os.kill(group.started[0].pid, signal.SIGTERM)
        group.wait(lambda: all(p.poll() is not None for p in group.started), 60, "both processes to exit")
        assert [p.returncode for p in group.started] == [0, 0], group.report()
    assert not any(process.poll() is None for process in group.started)

    greedy = generate(tiny_chat, PROMPTS, MAX_TOKENS, chat=False, ignore_eos=True)
    sampled = generate(tiny_chat, SAMPLED["prompt"], MAX_TOKENS, chat=False, ignore_eos=True,
                       temperature=SAMPLED["temperature"], top_p=SAMPLED["top_p"], seed=SAMPLED["seed"])
    constrained = generate(tiny_chat, CONSTRAINED["prompt"], MAX_TOKENS, chat=False, ignore_eos=True,
                           structured=CONSTRAINED["structured_outputs"])
    assert texts[:16] == greedy
    assert texts[16:] == [sampled, constrained]
    assert len(set(greedy)) > 8, "the prompts give different texts"


def test_the_follower_exits_when_the_leader_dies(tiny_chat_dir, tmp_path):
    """SIGKILL to the leader (here while it warms up): jax.distributed ends the follower."""
    with Group(tmp_path) as group:
        start_job(group, tiny_chat_dir, free_port())
        leader, follower = group.started
        group.wait(lambda: "following process 0" in stderr_tail(tmp_path / "process1.err"), STARTUP_S,
                   "the follower's engine")
        leader.kill()
        group.wait(lambda: follower.poll() is not None, 60, "the follower to exit", failed=lambda status: False)
        assert follower.returncode != 0


def test_a_follower_made_with_other_flags_names_them(tiny_chat_dir, tmp_path):
    with Group(tmp_path) as group:
        start_job(group, tiny_chat_dir, free_port(), follower_flags=("--slots", "8"))
        follower = group.started[1]
        group.wait(lambda: follower.poll() is not None, STARTUP_S, "the follower to exit", failed=lambda status: False)
        assert follower.returncode == 2
        assert "differs from the leader's: slots 8 here, 16 on the leader" in stderr_tail(tmp_path / "process1.err")
