"""The app's Prometheus metrics: the engine's state read at each scrape, and the latency histograms."""

import time

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from linnet_jax.serve.engine import Engine, Handle

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class EngineCollector:
    """Prometheus gauges and counters read from `engine.stats()` at each scrape."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def collect(self):
        stats = self.engine.stats()
        for name, key, text in (("requests_running", "running", "requests holding a slot"),
                                ("requests_queued", "queued", "requests waiting for a slot"),
                                ("busy_slots", "busy_slots", "requests in flight"),
                                ("slots", "slots", "the most requests in flight"),
                                ("kv_cache_pages", "kv_cache_pages", "pages of the KV cache's pool"),
                                ("kv_cache_pages_held", "kv_cache_pages_held", "pages that requests hold"),
                                ("kv_cache_pages_cached", "kv_cache_pages_cached",
                                 "pages no request holds, kept for prompts that start the same way")):
            yield GaugeMetricFamily(f"linnet_jax_{name}", text, value=stats[key])
        yield CounterMetricFamily("linnet_jax_generated_tokens", "tokens generated", value=stats["tokens_generated"])
        yield CounterMetricFamily("linnet_jax_requests_finished", "requests finished (cancelled ones included)",
                                  value=stats["requests_finished"])
        yield CounterMetricFamily("linnet_jax_prefix_cache_hit_tokens", "prompt tokens served from the prefix cache",
                                  value=stats["prefix_cache_hit_tokens"])
        yield CounterMetricFamily("linnet_jax_prefix_cache_lookup_tokens", "prompt tokens looked up in the prefix cache",
                                  value=stats["prefix_cache_lookup_tokens"])
        compiles = self.engine.compiles_after_warmup
        if compiles is not None:
            yield GaugeMetricFamily("linnet_jax_compiles_after_warmup", "programs compiled after engine.warmup()",
                                    value=compiles)


class Metrics:
    """The app's Prometheus registry: the engine's state and the TTFT and time-per-output-token histograms
    (observed by `engine.on_finish` as each request finishes)."""

    def __init__(self, engine: Engine):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine))
        self.ttft = Histogram("linnet_jax_time_to_first_token_seconds", "from submission to the first token",
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.tpot = Histogram("linnet_jax_time_per_output_token_seconds", "decode time per token after the first",
                              buckets=TPOT_BUCKETS, registry=self.registry)
        engine.on_finish.append(self.observe)

    def observe(self, handle: Handle) -> None:
        if handle.first_token_at is None:
            return
        self.ttft.observe(handle.first_token_at - handle.submitted)
        tokens = len(handle.generation.tokens)
        if tokens > 1:
            self.tpot.observe((time.perf_counter() - handle.first_token_at) / (tokens - 1))

    def text(self) -> bytes:
        return generate_latest(self.registry)
