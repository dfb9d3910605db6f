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
        # Each loaded model's engine, labelled by the model's name (one model: the stats themselves).
        engines = self.stats.get("models") or {self.stats["model"]: self.stats}
        yield _gauge(
            "kvd_queued_requests",
            "requests waiting: in the daemon's client queues and in the engines' queues",
            sum(e["num_waiting"] for e in engines.values()) + self.stats["daemon"]["num_queued"],
        )
        gauges = {
            "kvd_running_sequences": ("sequences the engine is running", lambda e: e["num_running"]),
            "kvd_kv_cache_usage_ratio": (
                "fraction of the KV pool's blocks in use",
                lambda e: _ratio(e["kv_cache"]["used_blocks"], e["kv_cache"]["total_blocks"]),
            ),
            "kvd_kv_cache_blocks": ("blocks in the KV pool", lambda e: e["kv_cache"]["total_blocks"]),
            "kvd_prefix_cache_hit_rate": (
                "prompt tokens served from the prefix cache / queried",
                lambda e: e["prefix_cache"]["hit_rate"],
            ),
        }
        counters = {
            "kvd_prefix_cache_queried_tokens": (
                "prompt tokens looked up in the prefix cache",
                lambda e: e["prefix_cache"]["queried_tokens"],
            ),
            "kvd_prefix_cache_hit_tokens": (
                "prompt tokens found in the prefix cache",
                lambda e: e["prefix_cache"]["hit_tokens"],
            ),
            "kvd_preemptions": (
                "sequences preempted for KV blocks (recomputed later)",
                lambda e: e["num_preemptions"],
            ),
            "kvd_prompt_tokens": (
                "prompt tokens the engine prefilled, all clients",
                lambda e: e["num_prefill_tokens"],
            ),
            "kvd_generation_tokens": (
                "tokens the engine generated, all clients",
                lambda e: e["num_generated_tokens"],
            ),
        }
        for families, kind in ((gauges, GaugeMetricFamily), (counters, CounterMetricFamily)):
            for name, (documentation, value) in families.items():
                family = kind(name, documentation, labels=["model"])
                for model, engine in engines.items():
                    family.add_metric([model], value(engine))
                yield family
        groups = GaugeMetricFamily(
            "kvd_kv_cache_group_used_blocks",
            "blocks each KV group's tables hold (a sliding-window group frees those behind its window)",
            labels=["model", "group", "window"],
        )
        for model, engine in engines.items():
            for i, group in enumerate(engine["kv_cache"]["groups"]):
                groups.add_metric([model, str(i), str(group["window"] or "full")], group["used_blocks"])
        yield groups
        yield from _speculative(engines)


def _speculative(engines: dict[str, dict]) -> Iterator[Metric]:
    """The drafts' counts of the models that speculate."""
    drafting = {model: e["speculative"] for model, e in engines.items() if e["speculative"] is not None}
    if not drafting:
        return
    metrics = {
        "kvd_speculative_draft_tokens": (
            CounterMetricFamily,
            "speculative draft tokens verified",
            "num_draft_tokens",
        ),
        "kvd_speculative_accepted_tokens": (
            CounterMetricFamily,
            "draft tokens the model's own tokens confirmed",
            "num_accepted_tokens",
        ),
        "kvd_speculative_rejected_tokens": (
            CounterMetricFamily,
            "draft tokens rejected",
            "num_rejected_tokens",
        ),
        "kvd_speculative_mean_accepted_length": (
            GaugeMetricFamily,
            "draft tokens accepted per verification, since start",
            "mean_accepted_length",
        ),
    }
    for name, (kind, documentation, key) in metrics.items():
        family = kind(name, documentation, labels=["model"])
        for model, spec in drafting.items():
            family.add_metric([model], spec[key])
        yield family


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
