"""The worker's Prometheus metrics under vLLM's names, in a registry of their own, served as text on /metrics.

Request metrics come from the engine as each request's outputs arrive (engine/core/request_clock.py: once per
output, never per token); the load gauges are read from the engine's stats when scraped, so serving pays nothing
for them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.outputs import FinishedRequest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # Prometheus' text exposition format
# vLLM's buckets, so that dashboards built for vLLM read these as they read its own.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)


class Metrics:
    """Counters and histograms of the requests served (the engine's RequestObserver), each labelled `model_name`."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        name = ["model_name"]
        registry = self.registry
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed.", name, registry=registry).labels(
            model_name
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Generation tokens processed.", name, registry=registry
        ).labels(model_name)
        # vLLM's prefix-cache counters, in prompt tokens: queried (every prompt token) and found in the cache
        self.prefix_cache_queries = Counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", name, registry=registry
        ).labels(model_name)
        self.prefix_cache_hits = Counter(
            "vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache.", name, registry=registry
        ).labels(model_name)
        self.success = Counter(
            "vllm:request_success",
            "Finished requests (each choice), by how they finished.",
            [*name, "finished_reason"],
            registry=registry,
        )
        self.time_to_first_token = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to the first generated token.",
            name,
            buckets=TTFT_BUCKETS,
            registry=registry,
        ).labels(model_name)
        self.inter_token_latency = Histogram(
            "vllm:inter_token_latency_seconds",
            "Time between two outputs of generated tokens of a request.",
            name,
            buckets=ITL_BUCKETS,
            registry=registry,
        ).labels(model_name)
        self.e2e_latency = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Time from a request's arrival at the engine to its end.",
            name,
            buckets=E2E_BUCKETS,
            registry=registry,
        ).labels(model_name)

    def first_token(self, seconds: float) -> None:
        self.time_to_first_token.observe(seconds)

    def next_tokens(self, seconds: float) -> None:
        self.inter_token_latency.observe(seconds)

    def finished(self, request: FinishedRequest) -> None:
        self.prompt_tokens.inc(request.prompt_tokens)
        self.prefix_cache_queries.inc(request.prompt_tokens)
        self.prefix_cache_hits.inc(request.cached_tokens)
        self.generation_tokens.inc(request.generation_tokens)
        for reason in request.finish_reasons:
            self.success.labels(self.model_name, reason).inc()
        self.e2e_latency.observe(request.seconds)

    def watch(self, stats: Callable[[], Any], kv_pages: int) -> None:
        """Report the engine's load (`stats`: AsyncEngine.stats) as gauges, read when scraped."""
        self.registry.register(EngineGauges(stats=stats, kv_pages=kv_pages, model_name=self.model_name))

    def exposition(self) -> str:
        """Every metric in Prometheus' text format."""
        return generate_latest(self.registry).decode()


class EngineGauges(Collector):
    """The engine's live load under vLLM's names: requests running and waiting, the KV cache's use (0 to 1), and the
    preemptions since start (a counter the engine keeps)."""

    def __init__(self, *, stats: Callable[[], Any], kv_pages: int, model_name: str) -> None:
        self.stats, self.kv_pages, self.model_name = stats, kv_pages, model_name

    def collect(self) -> Iterator[Metric]:
        stats = self.stats()
        used = 1.0 - stats["kv_pages_free"] / self.kv_pages if self.kv_pages else 0.0
        for name, help_text, value in (
            ("vllm:num_requests_running", "Requests running on the engine.", stats["requests_running"]),
            ("vllm:num_requests_waiting", "Requests waiting to run.", stats["requests_waiting"]),
            ("vllm:kv_cache_usage_perc", "KV cache usage (1 means every page is in use).", used),
        ):
            gauge = GaugeMetricFamily(name, help_text, labels=["model_name"])
            gauge.add_metric([self.model_name], value)
            yield gauge
        preemptions = CounterMetricFamily(
            "vllm:num_preemptions", "Requests preempted (their KV pages freed) since start.", labels=["model_name"]
        )
        preemptions.add_metric([self.model_name], stats["preemptions"])
        yield preemptions

    def describe(self) -> Iterator[Metric]:
        return iter(())
