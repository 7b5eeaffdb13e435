"""Replicas of the OpenAI-compatible server on Ray Serve: `app(model, replicas=2, ...)` is a Ray Serve application
(the `ray` extra); `linnet-jax serve --replicas N` runs one.

Each replica is a Ray actor that loads the model, owns one `Engine` and serves `create_app(engine, ...)`, the
FastAPI app that `linnet-jax serve` runs, as the deployment's ingress; Ray's HTTP proxy spreads requests over the
replicas. Every mechanism above one replica is Ray's:
  - admission: a replica takes at most `slots` requests at once (`max_ongoing_requests`); the proxy holds at most
    `max_queue` more (`max_queued_requests`) and answers the rest 429 with Retry-After (`BackpressureConfig`);
  - scale: a fixed number of replicas, or `replicas="auto"` with Ray's autoscaler (`autoscaling_config`);
  - restarts: a replica whose process dies, or whose engine failed (`check_health`), is replaced by Ray;
  - routing: Ray's `ConsistentHashRouter` (ray.serve.experimental.consistent_hash_router). Ray's proxy chooses
    a replica before the request's body is read (a router sees the ASGI scope, headers included, not the
    prompt), so neither Ray's `PrefixCacheAffinityRouter` (it reads a `prompt` or `messages` argument, which only a
    second deployment behind an ingress receives) nor a hash of the prompt's first block can route an HTTP
    request to this one-deployment app. What the proxy does see is Ray's session header (`X-Session-Id`, renamed
    with RAY_SERVE_SESSION_ID_HEADER_KEY): requests carrying the same session id reach the same replica, whose
    prefix cache holds their shared prefix (a conversation's earlier turns, an agent's system prompt); the next
    replica on the hash ring takes them while that one is full. Requests without it are spread evenly.
Each response names its replica in an `X-Linnet-Replica` header (Ray's replica id).

Threads: on one machine, replicas share the cores. Each replica reserves `cpus` of Ray's CPUs
(`ray_actor_options={"num_cpus": cpus}`), so Ray starts no more replicas than the machine has CPUs for, and binds
its process to ceil(cpus) cores of its own, chosen by its rank on the node (`pin_to_cores`): XLA:CPU sizes its
thread pool to the cores a process may use, so N replicas of one core each run N threads, not N × the machine's.
(`XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"` does not bound them with
jaxlib 0.10: a 2048² product ran as fast with it as without, and twice as slow under `taskset -c 0`.)
"""

import math
import os
import signal
import threading
from pathlib import Path

import ray
from ray import serve
from ray.serve.config import BackpressureConfig, RequestRouterConfig

from linnet_jax.serve.app import RETRY_AFTER_S
from linnet_jax.serve.errors import MAX_REQUEST_BYTES, check_api_key
from linnet_jax.serve.pages import check_positive

ROUTER = "ray.serve.experimental.consistent_hash_router.ConsistentHashRouter"
REPLICA_HEADER = b"x-linnet-replica"


def replica_cores(available: list[int], width: int, local_rank: int) -> list[int]:
    """The `width` cores (of `available`) of the replica of rank `local_rank` on its node: consecutive, wrapping
    round when the node has more replicas than cores."""
    width = min(width, len(available))
    return [available[(local_rank * width + i) % len(available)] for i in range(width)]


def pin_to_cores(cores: list[int]) -> None:
    """Bind every thread of this process, and the ones it starts later, to `cores`."""
    for thread in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(thread), cores)


class ReplicaHeader:
    """ASGI middleware: every response carries `X-Linnet-Replica: name`."""

    def __init__(self, app, name: str):
        self.app, self.header = app, (REPLICA_HEADER, name.encode())

    async def __call__(self, scope, receive, send):
        async def named(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), self.header]}
            await send(message)

        await self.app(scope, receive, named if scope["type"] == "http" else send)


@serve.deployment(name="linnet_jax")
@serve.ingress()
class Replica:
    """One replica: bound to its cores, the model loaded, its Engine warmed up, and `create_app` over it (built by
    Ray after __init__, in the replica)."""

    def __init__(self, model, load_options: dict, model_name: str, api_key, max_request_bytes: int, cpus: float,
                 engine_options: dict):
        import linnet_jax
        from linnet_jax.serve import Engine

        pin_to_cores(replica_cores(sorted(os.sched_getaffinity(0)), math.ceil(cpus),
                                   serve.get_replica_context().rank.local_rank))
        self.engine = Engine(linnet_jax.load(model, progress=False, **load_options), **engine_options)
        self.engine.warmup()
        self.app_options = dict(model_name=model_name, api_key=api_key, max_request_bytes=max_request_bytes)

    def __serve_build_asgi_app__(self):
        from linnet_jax.serve.app import create_app

        app = create_app(self.engine, **self.app_options)
        app.add_middleware(ReplicaHeader, name=serve.get_replica_context().replica_id.unique_id)
        return app

    def check_health(self) -> None:
        """Ray's health check: a replica whose engine failed is replaced."""
        self.engine.check_alive()

    def __del__(self) -> None:
        """Ray stops a replica once its requests have finished (or after graceful_shutdown_timeout_s)."""
        self.engine.close()


def app(model=None, *, replicas: int | str = 2, slots: int = 16, max_len: int | None = 640, max_queue: int = 256,
        api_key: str | None = None, model_name: str | None = None, dtype: str | None = None,
        quantize: str | None = None, cpus: float = 1,
        autoscaling_config: dict | None = None, max_request_bytes: int = MAX_REQUEST_BYTES, **engine_options) -> serve.Application:
    """A Ray Serve application of `replicas` replicas of the OpenAI-compatible server, each with one Engine of
    `slots` slots of `max_len` positions (None: as `Engine` chooses) over `model` (what `linnet_jax.load` takes;
    None: the embedded default).

    replicas: a count, or "auto" for Ray's autoscaler (`autoscaling_config`, Ray's keys; its
    target_ongoing_requests defaults to half the slots). max_queue: requests Ray's proxy holds while every
    replica is full (beyond them: 429 with Retry-After). api_key, max_request_bytes, model_name (default: `model` as
    given, or the default's name): as `create_app` takes them; dtype, quantize: as `linnet_jax.load` takes them. cpus: Ray CPUs each replica reserves, and
    binds ceil(cpus) cores to (`pin_to_cores`). engine_options: further `Engine` keywords (page_size, prefix_cache, ...).
    Run it with `serve.run(app(...))`, or `linnet-jax serve --replicas N`.
    """
    from linnet_jax.load import DEFAULT_MODEL

    check_api_key(api_key)
    if replicas != "auto" and (isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1):
        raise ValueError(f"replicas must be a positive int or 'auto', got {replicas!r}")
    if replicas != "auto" and autoscaling_config is not None:
        raise ValueError("autoscaling_config needs replicas='auto'")
    if isinstance(cpus, bool) or not isinstance(cpus, (int, float)) or cpus <= 0:
        raise ValueError(f"cpus must be a number > 0, got {cpus!r}")
    check_positive("slots", slots)
    check_positive("max_queue", max_queue)
    autoscaling = None if replicas != "auto" else {"target_ongoing_requests": max(1, slots // 2),
                                                   **(autoscaling_config or {})}
    deployment = Replica.options(
        num_replicas=replicas, autoscaling_config=autoscaling, max_ongoing_requests=slots,
        max_queued_requests=max_queue,
        backpressure_config=BackpressureConfig(status_code=429, retry_after_s=RETRY_AFTER_S),
        request_router_config=RequestRouterConfig(request_router_class=ROUTER),
        ray_actor_options={"num_cpus": cpus})
    model_name = model_name or (DEFAULT_MODEL if model is None else str(model))
    return deployment.bind(replica_source(model), dict(dtype=dtype, quantize=quantize), model_name, api_key,
                           max_request_bytes, cpus,
                           dict(slots=slots, max_len=max_len, max_queue=max_queue, **engine_options))


def replica_source(model):
    """What a replica loads: an existing local path made absolute (a replica's working directory may differ from
    the caller's), else `model` as given (a hub id, None)."""
    if model is not None and (path := Path(model).expanduser()).exists():
        return str(path.resolve())
    return model


def run(application: serve.Application, *, address: str | None, host: str, port: int) -> None:
    """Serve `application` on host:port until SIGTERM or SIGINT, then shut Serve down (and the Ray instance
    this call started: with `address` None, a local one; else it joins the cluster at `address`)."""
    ray.init(address=address, include_dashboard=False, log_to_driver=False)
    stop = stop_on_signals()
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(application, name="linnet_jax", route_prefix="/")
        print(f"serving on http://{host}:{port} (Ray Serve)", flush=True)
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()


def stop_on_signals() -> threading.Event:
    """An event that SIGTERM and SIGINT set, for after `ray.init`: it takes SIGTERM over twice, in Python
    (`sys.exit(15)`) and in C (its core worker's absl failure signal handler: a crash report, then a 3 s alarm
    that aborts the process whatever the shutdown is doing, exit status 134). Set afterwards, these replace both."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop
