"""Replicas on Ray Serve (`linnet_jax.serve.ray`): one local Ray instance (2 CPUs, on 127.0.0.1) for the file,
two replicas of a tiny random llama with SmolLM2's tokenizer, every request through Ray's HTTP proxy.

The last test shuts Ray down and checks that no process it started is left. `linnet-jax serve --replicas`, its own
Ray instance in a process of its own, is tested before the file's instance starts.
"""

import asyncio
import os
import signal
import socket
import sys
import threading
from collections import Counter

import httpx
import openai
import psutil
import pytest
import ray
from processes import Group, cpu_env
from ray import serve
from test_serve import (
    MODEL,
    WORDS,
    assert_reproducible_equal_generate,
    metric,
    mixed_requests,
    refused_flags,
    stream_completion,
    wait_for,
)

import linnet_jax.serve.ray
from linnet_jax.cli import main
from linnet_jax.serve.ray import app, replica_cores

SLOTS, MAX_QUEUE = 4, 32  # per replica; requests the proxy holds while both replicas are full
STARTUP_S = 600  # a Ray instance and two replicas warmed up, on a loaded machine


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop_ray() -> None:
    if ray.is_initialized():
        serve.shutdown()
        ray.shutdown()


def ray_processes(pid: int) -> list[psutil.Process]:
    """The processes of the Ray instance that process `pid` started: its descendants, a raylet among them."""
    processes = psutil.Process(pid).children(recursive=True)
    assert any(process.name() == "raylet" for process in processes), processes
    return processes


def assert_ended(processes: list[psutil.Process]) -> None:
    """Every one of `processes` exits within a minute."""
    _, alive = psutil.wait_procs(processes, timeout=60)
    assert not alive, [(process.pid, process.name()) for process in alive]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda sig: sig.name)
def test_a_signal_ends_serve_replicas_with_status_0_and_no_ray_process_left(tiny_chat_dir, tmp_path, sig):
    """SIGTERM (what systemd and Kubernetes send) or SIGINT to `linnet-jax serve --replicas 2`: Serve shuts down, the
    command exits 0 and every process of its Ray instance exits."""
    port = free_port()
    with Group(tmp_path) as group:
        server = group.start("serve", [
            sys.executable, "-m", "linnet_jax", "serve", "--replicas", "2", "--model", str(tiny_chat_dir), "--port",
            str(port), "--slots", "1", "--max-len", "64", "--prefill-chunk", "16",
            "--no-compilation-cache"], cpu_env() | {"RAY_USAGE_STATS_ENABLED": "0"})
        group.wait(lambda: "serving on" in group.stdout("serve"), STARTUP_S, "the replicas to serve")
        started = ray_processes(server.pid)
        server.send_signal(sig)
        group.wait(lambda: server.poll() is not None, 180, "serve to exit")  # fails on a status other than 0
        assert_ended(started)


@pytest.fixture(scope="module")
def ray_url():
    """A local Ray instance and Serve's proxy on 127.0.0.1: yields the proxy's URL."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", object_store_memory=200 << 20,
             log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_ray()


@pytest.fixture(scope="module")
def served(ray_url, tiny_chat_dir):
    """Two replicas of 4 slots each, serving the tiny model as MODEL; yields the proxy's URL."""
    serve.run(app(tiny_chat_dir, replicas=2, slots=SLOTS, max_len=256, max_queue=MAX_QUEUE, model_name=MODEL,
                  prefill_chunk=64), name="linnet_jax", route_prefix="/")
    return ray_url


def replica_pids() -> dict[str, int]:
    """{replica id (X-Linnet-Replica): its process id} of the live replicas: Ray's named actors, each asked for its
    pid through Ray's `__ray_call__`."""
    names = [actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True)
             if actor["name"].startswith("SERVE_REPLICA::")]
    actors = {name.rsplit("#", 1)[1]: ray.get_actor(name, namespace="serve") for name in names}
    return {replica: ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=120)
            for replica, actor in actors.items()}


@pytest.mark.parametrize("settings, words", [
    (dict(replicas=0), "replicas must be a positive int or 'auto', got 0"),
    (dict(replicas="2"), "replicas must be a positive int or 'auto', got '2'"),
    (dict(autoscaling_config={"max_replicas": 4}), "autoscaling_config needs replicas='auto'"),
    (dict(cpus=0), "cpus must be a number > 0, got 0"),
    (dict(slots=True), "slots must be a positive int, got True"),
    (dict(api_key=""), "api_key must be a non-empty string")])
def test_app_refuses_bad_settings_by_name(settings, words):
    with pytest.raises(ValueError, match=words):
        app("some/model", **settings)


def test_replicas_take_consecutive_cores_wrapping_round():
    assert [replica_cores([0, 1, 2, 3], 2, rank) for rank in range(3)] == [[0, 1], [2, 3], [0, 1]]
    assert replica_cores([4, 5], 4, 0) == [4, 5]


@pytest.mark.parametrize("flags", [["--ray-address", "127.0.0.1:6379"], ["--replica-cpus", "2"],
                                   ["--replicas", "0"], ["--replicas", "2", "--replica-cpus", "0"]])
def test_replica_flags_are_refused_before_anything_starts(monkeypatch, capsys, flags):
    monkeypatch.setattr(linnet_jax.serve.ray, "run", lambda *a, **k: pytest.fail("started Ray"))
    assert flags[-2] in refused_flags(monkeypatch, capsys, *flags)


def test_serve_replicas_runs_the_app_without_loading_the_model_itself(monkeypatch, tmp_path):
    ran = []
    monkeypatch.setattr(linnet_jax.serve.ray, "run", lambda application, **where: ran.append((application, where)))
    monkeypatch.setattr(linnet_jax, "load", lambda *a, **k: pytest.fail("the driver loaded the model"))
    assert main(["serve", "--model", str(tmp_path), "--replicas", "3", "--ray-address", "10.0.0.1:6379",
                 "--port", str(free_port())]) == 0
    (application, where), = ran
    assert isinstance(application, serve.Application) and where["address"] == "10.0.0.1:6379"


def test_32_streams_reach_both_replicas_and_equal_generate(tiny_chat, served):
    requests, replicas = mixed_requests(32), []

    async def run_all():
        async def named(response: httpx.Response) -> None:
            replicas.append(response.headers["x-linnet-replica"])

        http = httpx.AsyncClient(event_hooks={"response": [named]}, timeout=300)
        api = openai.AsyncOpenAI(base_url=f"{served}/v1", api_key="none", max_retries=0, http_client=http)
        return await asyncio.gather(*(stream_completion(api, request) for request in requests))

    results = asyncio.run(run_all())
    assert all(finish == "length" for _, finish in results)
    assert_reproducible_equal_generate(tiny_chat, requests, [text for text, _ in results])
    served_by = Counter(replicas)
    print(f"requests per replica: {dict(served_by)}")
    assert len(replicas) == 32 and set(served_by) == set(replica_pids()), served_by


def test_each_replica_is_bound_to_its_own_core(served):
    """cpus=1 each on 2 cores: one core per replica, so XLA:CPU's thread pools do not share them."""
    cores = [psutil.Process(pid).cpu_affinity() for pid in replica_pids().values()]
    assert sorted(cores) == [[0], [1]], cores


def test_a_session_stays_on_one_replica_and_hits_its_prefix_cache(served):
    """Ray's session header routes a conversation to one replica, whose prefix cache then holds its prefix."""
    session = {"X-Session-Id": "conversation-7"}
    hits = metric(served, "linnet_jax_prefix_cache_hit_tokens_total", session)
    prefix = " ".join(WORDS * 5)  # over 64 tokens: at least one cached block
    names = {httpx.post(f"{served}/v1/completions", headers=session, timeout=120, json=dict(
        model=MODEL, prompt=f"{prefix} {word}", max_tokens=2, temperature=0)).headers["x-linnet-replica"]
        for word in WORDS[:4]}
    assert len(names) == 1
    assert metric(served, "linnet_jax_prefix_cache_hit_tokens_total", session) - hits >= 3 * 64


def test_over_capacity_is_429_with_retry_after_and_never_500(served):
    """2 replicas × 4 slots running and 32 queued in the proxy: of 72 at once, the rest are refused by Ray, each with
    a Retry-After, none with a 500. Ray counts a request against the queue until a replica has taken it, so on a loaded
    machine a few fewer than slots + queue are taken (38 of 40 seen): the test asks for most of the queue."""
    async def post(client: httpx.AsyncClient, i: int) -> httpx.Response:
        return await client.post(f"{served}/v1/completions", json=dict(
            model=MODEL, prompt=f"{WORDS[i % len(WORDS)]} hills", max_tokens=24, temperature=0, ignore_eos=True))

    async def run_all():
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=100)) as client:
            return await asyncio.gather(*(post(client, i) for i in range(72)))

    responses = asyncio.run(run_all())
    statuses = Counter(response.status_code for response in responses)
    print(f"statuses: {dict(statuses)}")
    assert set(statuses) == {200, 429} and statuses[200] >= 2 * SLOTS + MAX_QUEUE // 2, statuses
    refused = [response for response in responses if response.status_code == 429]
    assert all(response.headers["retry-after"] == "1" for response in refused)


def stream_outcome(url: str, outcomes: list, started: threading.Event) -> None:
    """One long stream; appends what it got: its status and replica, its data events, whether [DONE] came, the
    error that ended it."""
    outcome = {"status": None, "replica": None, "events": 0, "done": False, "error": None}
    outcomes.append(outcome)
    try:
        with httpx.stream("POST", f"{url}/v1/completions", timeout=120, json=dict(
                model=MODEL, prompt="seven quiet birds", max_tokens=240, temperature=0, ignore_eos=True,
                stream=True)) as response:
            outcome.update(status=response.status_code, replica=response.headers.get("x-linnet-replica"))
            for line in response.iter_lines():
                if line.startswith("data: "):
                    outcome["events"] += 1
                    outcome["done"] |= line == "data: [DONE]"
                    started.set()
    except httpx.HTTPError as exception:
        outcome["error"] = f"{type(exception).__name__}: {exception}"
    started.set()


def test_a_killed_replica_is_restarted_and_new_requests_succeed(served):
    """SIGKILL the process of the replica serving the first stream while 8 stream: the other replica's streams
    finish, the killed one's end early; Ray starts a new replica, and new requests succeed."""
    before, outcomes, started = replica_pids(), [], threading.Event()
    threads = [threading.Thread(target=stream_outcome, args=(served, outcomes, started), daemon=True)
               for _ in range(2 * SLOTS)]
    for thread in threads:
        thread.start()
    assert started.wait(120)
    first = next(outcome["replica"] for outcome in list(outcomes) if outcome["events"])
    os.kill(before[first], signal.SIGKILL)
    for thread in threads:
        thread.join(150)
    print(f"in-flight streams when replica {first} was killed: {outcomes}")
    # A stream the killed replica had begun is cut short (no [DONE]); one it had not begun answering is a 500 from
    # Ray's proxy (which names no replica); every other stream finishes.
    assert len(outcomes) == 2 * SLOTS, outcomes
    assert all(outcome["done"] or outcome["replica"] in (first, None) for outcome in outcomes), outcomes
    assert any(not outcome["done"] for outcome in outcomes if outcome["replica"] == first), outcomes
    assert wait_for(lambda: len(after := replica_pids()) == 2 and first not in after, timeout=120), replica_pids()
    answers = [httpx.post(f"{served}/v1/completions", timeout=120, json=dict(
        model=MODEL, prompt=f"{word} sea", max_tokens=4, temperature=0)) for word in WORDS[:8]]
    assert all(answer.status_code == 200 for answer in answers), [answer.text for answer in answers]


def test_shutdown_leaves_no_process_behind(ray_url):
    started = ray_processes(os.getpid())
    stop_ray()
    assert_ended(started)
