"""Prometheus text for the router's /metrics: per target (worker@rank) counters and gauges."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from engine.tokenize_cache import counters as tokenizer_counters

PREFIX = "dpmesh_router"

_TARGET_COUNTERS = [
    ("requests", "Requests dispatched to the target", "requests"),
    ("prompt_tokens", "Prompt tokens dispatched to the target", "prompt_tokens"),
    (
        "predicted_cached_tokens",
        "Prompt tokens the router's prefix index expected to be cached",
        "predicted_tokens",
    ),
    ("reported_cached_tokens", "Prompt tokens the engine reported as cached", "cached_tokens"),
    ("errors", "Requests that failed on the target", "errors"),
    ("aborted", "Requests whose client went away before the answer ended", "aborted"),
]


class RouterCollector:
    def __init__(self, router):
        self.router = router

    def collect(self):
        targets = self.router.fleet.all_targets()
        stats = self.router.stats.targets
        labels = ["target", "worker", "rank"]

        def label_values(t):
            return [t.key, t.worker.url, "" if t.rank is None else str(t.rank)]

        for name, help_text, attr in _TARGET_COUNTERS:
            family = CounterMetricFamily(f"{PREFIX}_{name}", help_text, labels=labels)
            for t in targets:
                s = stats.get(t.key)
                family.add_metric(label_values(t), getattr(s, attr) if s else 0)
            yield family
        gauges = [
            (
                "inflight_requests",
                "Requests in flight from this router process",
                lambda t: t.load.requests,
            ),
            (
                "inflight_prompt_tokens",
                "Prompt tokens in flight from this router process",
                lambda t: t.load.prompt_tokens,
            ),
            (
                "peer_inflight_requests",
                "Requests in flight from the other router processes (as they last published)",
                lambda t: t.load.peer_requests,
            ),
            (
                "pending_prefill_tokens",
                "Predicted uncached tokens not yet prefilled",
                lambda t: t.load.pending_prefill_tokens,
            ),
            ("target_up", "1 while the target can be chosen", lambda t: int(t.available)),
            (
                "index_blocks",
                "Digests the prefix index holds for the target",
                lambda t: self.router.index.size(t.key),
            ),
        ]
        for name, help_text, read in gauges:
            family = GaugeMetricFamily(f"{PREFIX}_{name}", help_text, labels=labels)
            for t in targets:
                family.add_metric(label_values(t), read(t))
            yield family
        for name, help_text, read in [
            (
                "worker_healthy",
                "1 while the worker passes its health checks",
                lambda t: int(t.worker.healthy),
            ),
            (
                "worker_draining",
                "1 while the worker is drained (no new requests)",
                lambda t: int(t.worker.draining),
            ),
            (
                "circuit_open",
                "1 while the target's circuit breaker refuses requests",
                lambda t: int(t.breaker.state == "open"),
            ),
        ]:
            family = GaugeMetricFamily(f"{PREFIX}_{name}", help_text, labels=labels)
            for t in targets:
                family.add_metric(label_values(t), read(t))
            yield family
        stats_ = self.router.stats
        family = CounterMetricFamily(
            f"{PREFIX}_http_responses",
            "OpenAI answers sent, by endpoint and status",
            labels=["endpoint", "status"],
        )
        for (endpoint, status), count in sorted(stats_.responses.items()):
            family.add_metric([endpoint, str(status)], count)
        yield family
        for name, help_text, hist in [
            (
                "request_duration_seconds",
                "Routed requests: dispatch to the end of the upstream answer",
                stats_.latency,
            ),
            (
                "time_to_first_token_seconds",
                "Streamed requests: dispatch to the first token",
                stats_.ttft,
            ),
        ]:
            family = HistogramMetricFamily(f"{PREFIX}_{name}", help_text)
            family.add_metric([], hist.cumulative(), sum_value=hist.sum)
            yield family
        yield _policy_info(self.router)
        yield from self.router.sessions.metric_families(PREFIX)
        for observer in self.router.observers:  # the shared index, the KV-event feed
            yield from observer.metric_families()
        yield CounterMetricFamily(
            f"{PREFIX}_retries",
            "Upstream attempts retried on another target",
            value=self.router.stats.retries,
        )
        counts = tokenizer_counters()
        family = CounterMetricFamily(
            f"{PREFIX}_tokenizer_chars",
            "Prompt characters of long texts tokenized for routing: taken from the prefix token "
            "cache (cached) or encoded",
            labels=["source"],
        )
        for source in ("cached", "encoded"):
            family.add_metric([source], counts[source])
        yield family
        yield CounterMetricFamily(
            f"{PREFIX}_tokenizer_cache_mismatches",
            "Prefix token caches turned off: a chunked encode differed from the whole text's",
            value=counts["mismatches"],
        )
        yield CounterMetricFamily(
            f"{PREFIX}_no_target",
            "Requests refused because no target was available",
            value=self.router.stats.no_target,
        )


def _policy_info(router) -> GaugeMetricFamily:
    family = GaugeMetricFamily(
        f"{PREFIX}_policy_info", "The active routing policy (value 1)", labels=["policy"]
    )
    family.add_metric([router.config.policy], 1)
    return family


def render_metrics(router) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RouterCollector(router))
    return generate_latest(registry)
