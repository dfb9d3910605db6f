"""Prometheus metrics: the gateway's own requests, and the daemon's load read from `stats` at each scrape."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvd_client import Usage

# Seconds; from a few ms (a decode step of a small model) to a long prefill behind a queue.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class DaemonCollector:
    """The daemon's `stats` as gauges and counters; the app refreshes `stats` before each scrape."""

    def __init__(self) -> None:
        self.stats: dict | None = None

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("kvd_daemon_up", "1 when the daemon answered the last stats request")
        up.add_metric([], 0.0 if self.stats is None else 1.0)
        yield up
        if self.stats is None:
            return
        s, kv, prefix = self.stats, self.stats["kv_cache"], self.stats["prefix_cache"]
        yield _gauge(
            "kvd_queued_requests",
            "requests waiting: in the daemon's client queues and in the engine's queue",
            s["num_waiting"] + s["daemon"]["num_queued"],
        )
        yield _gauge("kvd_running_sequences", "sequences the engine is running", s["num_running"])
        yield _gauge(
            "kvd_kv_cache_usage_ratio",
            "fraction of the KV pool's blocks in use",
            _ratio(kv["used_blocks"], kv["total_blocks"]),
        )
        yield _gauge("kvd_kv_cache_blocks", "blocks in the KV pool", kv["total_blocks"])
        groups = GaugeMetricFamily(
            "kvd_kv_cache_group_used_blocks",
            "blocks each KV group's tables hold (a sliding-window group frees those behind its window)",
            labels=["group", "window"],
        )
        for i, group in enumerate(kv["groups"]):
            groups.add_metric([str(i), str(group["window"] or "full")], group["used_blocks"])
        yield groups
        yield _gauge(
            "kvd_prefix_cache_hit_rate",
            "prompt tokens served from the prefix cache / queried",
            prefix["hit_rate"],
        )
        yield _counter(
            "kvd_prefix_cache_queried_tokens",
            "prompt tokens looked up in the prefix cache",
            prefix["queried_tokens"],
        )
        yield _counter(
            "kvd_prefix_cache_hit_tokens", "prompt tokens found in the prefix cache", prefix["hit_tokens"]
        )
        yield _counter(
            "kvd_preemptions", "sequences preempted for KV blocks (recomputed later)", s["num_preemptions"]
        )
        yield _counter(
            "kvd_prompt_tokens", "prompt tokens the engine prefilled, all clients", s["num_prefill_tokens"]
        )
        yield _counter(
            "kvd_generation_tokens", "tokens the engine generated, all clients", s["num_generated_tokens"]
        )
        spec = s["speculative"]
        if spec is not None:
            yield _counter(
                "kvd_speculative_draft_tokens", "speculative draft tokens verified", spec["num_draft_tokens"]
            )
            yield _counter(
                "kvd_speculative_accepted_tokens",
                "draft tokens the model's own tokens confirmed",
                spec["num_accepted_tokens"],
            )
            yield _counter(
                "kvd_speculative_rejected_tokens", "draft tokens rejected", spec["num_rejected_tokens"]
            )
            yield _gauge(
                "kvd_speculative_mean_accepted_length",
                "draft tokens accepted per verification, since start",
                spec["mean_accepted_length"],
            )


class GatewayMetrics:
    """One registry per app, so that several gateways in one process (tests) do not collide."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.daemon = DaemonCollector()
        self.registry.register(self.daemon)
        self.requests = Counter(
            "kvd_gateway_requests",
            "HTTP requests by endpoint and outcome (success, client_error, server_error, disconnected)",
            ["endpoint", "outcome"],
            registry=self.registry,
        )
        self.http_requests = Counter(
            "kvd_gateway_http_requests",
            'HTTP requests by route and status code; paths no route serves are endpoint="unmatched"',
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "kvd_gateway_prompt_tokens", "prompt tokens of the gateway's requests", registry=self.registry
        )
        self.cached_tokens = Counter(
            "kvd_gateway_cached_prompt_tokens",
            "prompt tokens of the gateway's requests served from the prefix cache",
            registry=self.registry,
        )
        self.generation_tokens = Counter(
            "kvd_gateway_generation_tokens",
            "tokens generated for the gateway's requests",
            registry=self.registry,
        )
        self.ttft = Histogram(
            "kvd_gateway_time_to_first_token_seconds",
            "from sending a request to the daemon to its first token",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "kvd_gateway_inter_token_latency_seconds",
            "time between consecutive tokens of a request",
            buckets=ITL_BUCKETS,
            registry=self.registry,
        )

    def request_done(self, endpoint: str, outcome: str) -> None:
        """A generation request ended: its outcome, which a stream's status code (200) does not tell."""
        self.requests.labels(endpoint, outcome).inc()

    def http_request(self, endpoint: str, status: int) -> None:
        self.http_requests.labels(endpoint, str(status)).inc()

    def observe_tokens(self, since_start: float, since_last: float, count: int, first: bool) -> None:
        """A chunk of `count` tokens arrived; the gap since the previous chunk is shared among them."""
        if first:
            self.ttft.observe(since_start)  # tokens that came with the first have no gap of their own
            return
        for _ in range(count):
            self.itl.observe(since_last / count)

    def observe_usage(self, usage: Usage) -> None:
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.cached_tokens.inc(usage.cached_tokens)
        self.generation_tokens.inc(usage.completion_tokens)

    def exposition(self, stats: dict | None) -> bytes:
        self.daemon.stats = stats
        return generate_latest(self.registry)


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)
