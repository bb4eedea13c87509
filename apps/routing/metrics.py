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


# per-target gauges: (name, help, read(router, target)); the load this router process sees ...
_LOAD_GAUGES = [
    (
        "inflight_requests",
        "Requests in flight from this router process",
        lambda router, t: t.load.requests,
    ),
    (
        "inflight_prompt_tokens",
        "Prompt tokens in flight from this router process",
        lambda router, t: t.load.prompt_tokens,
    ),
    (
        "peer_inflight_requests",
        "Requests in flight from the other router processes (as they last published)",
        lambda router, t: t.load.peer_requests,
    ),
    (
        "pending_prefill_tokens",
        "Predicted uncached tokens not yet prefilled",
        lambda router, t: t.load.pending_prefill_tokens,
    ),
    ("target_up", "1 while the target can be chosen", lambda router, t: int(t.available)),
    (
        "index_blocks",
        "Digests the prefix index holds for the target",
        lambda router, t: router.index.size(t.key),
    ),
]
# ... and why a target can or cannot be chosen (its worker's health and drain, its breaker)
_STATE_GAUGES = [
    (
        "worker_healthy",
        "1 while the worker passes its health checks",
        lambda router, t: int(t.worker.healthy),
    ),
    (
        "worker_draining",
        "1 while the worker is drained (no new requests)",
        lambda router, t: int(t.worker.draining),
    ),
    (
        "circuit_open",
        "1 while the target's circuit breaker refuses requests",
        lambda router, t: int(t.breaker.state == "open"),
    ),
]
_TARGET_LABELS = ["target", "worker", "rank"]


def _target_labels(t) -> list[str]:
    return [t.key, t.worker.url, "" if t.rank is None else str(t.rank)]


class RouterCollector:
    """The router's /metrics families, always in the same order (per target, the answers, the
    policy, the observers', the tokenizer's): each group is its own generator, and ``collect``
    chains them, so a new family goes into the group it belongs to."""

    def __init__(self, router):
        self.router = router

    def collect(self):
        # one fleet listing for every per-target family, so a scrape's families agree on targets
        targets = self.router.fleet.all_targets()
        yield from self._target_counters(targets)
        yield from self._miss_families(targets)
        yield from self._target_gauges(targets, _LOAD_GAUGES)
        yield from self._target_gauges(targets, _STATE_GAUGES)
        yield _role_family(targets)
        yield _pin_family(self.router)
        yield _prompt_ids_family(self.router)
        yield from self._response_families()
        yield _policy_info(self.router)
        yield from self._observer_families()
        yield from self._timing_families()
        yield CounterMetricFamily(
            f"{PREFIX}_retries",
            "Upstream attempts retried on another target",
            value=self.router.stats.retries,
        )
        yield CounterMetricFamily(
            f"{PREFIX}_time_check_overrides",
            "Requests the time check sent elsewhere than the policy chose: the time model "
            "expected a clearly sooner first token there",
            value=self.router.stats.time_checked,
        )
        yield from _tokenizer_families()
        yield CounterMetricFamily(
            f"{PREFIX}_no_target",
            "Requests refused because no target was available",
            value=self.router.stats.no_target,
        )

    def _target_counters(self, targets):
        """What the router sent each target and how it went (``_TARGET_COUNTERS``); a target
        without stats yet reads 0, so every target has every series from its first scrape."""
        stats = self.router.stats.targets
        for name, help_text, attr in _TARGET_COUNTERS:
            family = CounterMetricFamily(f"{PREFIX}_{name}", help_text, labels=_TARGET_LABELS)
            for t in targets:
                s = stats.get(t.key)
                family.add_metric(_target_labels(t), getattr(s, attr) if s else 0)
            yield family

    def _miss_families(self, targets):
        """Why prompt tokens were computed instead of read from cache, per target and reason
        (apps/routing/decision/misses.py); every target has every reason from its first scrape."""
        from apps.routing.decision.misses import REASONS

        misses = self.router.misses
        family = CounterMetricFamily(
            f"{PREFIX}_miss_tokens",
            "Prompt tokens the engine computed rather than read from its cache, by the reason "
            "the router gives (requests whose engine reported its cached tokens)",
            labels=[*_TARGET_LABELS, "reason"],
        )
        for t in targets:
            labels = _target_labels(t)
            for reason in REASONS:
                family.add_metric([*labels, reason], misses.tokens.get((t.key, reason), 0))
        yield family
        yield CounterMetricFamily(
            f"{PREFIX}_miss_explained_requests",
            "Requests whose prompt tokens were given miss reasons",
            value=misses.requests,
        )

    def _target_gauges(self, targets, gauges):
        """One gauge family per ``(name, help, read)`` of ``gauges``, a series per target."""
        for name, help_text, read in gauges:
            family = GaugeMetricFamily(f"{PREFIX}_{name}", help_text, labels=_TARGET_LABELS)
            for t in targets:
                family.add_metric(_target_labels(t), read(self.router, t))
            yield family

    def _response_families(self):
        """What the clients got: answers by endpoint and status, then the latency histograms."""
        stats = self.router.stats
        family = CounterMetricFamily(
            f"{PREFIX}_http_responses",
            "OpenAI answers sent, by endpoint and status",
            labels=["endpoint", "status"],
        )
        for (endpoint, status), count in sorted(stats.responses.items()):
            family.add_metric([endpoint, str(status)], count)
        yield family
        for name, help_text, hist in [
            (
                "request_duration_seconds",
                "Routed requests: dispatch to the end of the upstream answer",
                stats.latency,
            ),
            (
                "time_to_first_token_seconds",
                "Streamed requests: dispatch to the first token",
                stats.ttft,
            ),
            (
                "overhead_seconds",
                "The router's own time: arrival to the upstream request sent (reading, "
                "tokenizing, routing), admission waits and earlier attempts left out",
                stats.overhead,
            ),
        ]:
            family = HistogramMetricFamily(f"{PREFIX}_{name}", help_text)
            family.add_metric([], hist.cumulative(), sum_value=hist.sum)
            yield family

    def _observer_families(self):
        """The families of the parts that keep their own counts: the sessions, then each dispatch
        observer (the shared index, the KV-event feed, admission control) in attach order."""
        yield from self.router.sessions.metric_families(PREFIX)
        for observer in self.router.observers:
            yield from observer.metric_families()

    def _timing_families(self):
        """The time model's fit per worker (apps/routing/decision/timing.py), once it has one."""
        urls = {w.worker_id: w.url for w in self.router.fleet.workers.values()}
        fits = [
            (urls[worker_id], timing.fit)
            for worker_id, timing in sorted(self.router.timing.workers.items())
            if worker_id in urls
        ]
        for name, help_text, read in _TIMING_GAUGES:
            family = GaugeMetricFamily(f"{PREFIX}_{name}", help_text, labels=["worker"])
            for url, fit in fits:
                family.add_metric([url], read(fit))
            yield family


# the time model's figures, per worker (apps/routing/decision/timing.py)
_TIMING_GAUGES = (
    ("ttft_base_seconds", "Fitted TTFT of a request with nothing to wait for", lambda f: f.base_s),
    (
        "ttft_per_token_seconds",
        "Fitted TTFT per prompt token waited for (uncached + queued prefill)",
        lambda f: f.per_token_s,
    ),
    (
        "ttft_move_seconds",
        "Fitted extra TTFT of a request that woke an idle rank another was used after",
        lambda f: f.move_s,
    ),
    (
        "ttft_move_significant",
        "1 when that extra TTFT is significant (enough of each kind, log fit), else 0",
        lambda f: float(f.move_significant),
    ),
)


def _tokenizer_families():
    """The prefix token cache of engine.tokenize_cache: how much of the prompts' text it spared
    encoding, and how often it had to turn itself off (a chunked encode that differed)."""
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


def _pin_family(router) -> GaugeMetricFamily:
    """Per worker and path, whether the worker honours the rank pin there (apps/replicas/
    pin_check.py): 1 honoured, 0 dropped (routed without predicted hits); not checked: absent."""
    family = GaugeMetricFamily(
        f"{PREFIX}_pin_honoured",
        "1 where the worker serves a request on the DP rank the router pinned, 0 where it drops "
        "the pin on that path (its requests there are routed without predicted hits)",
        labels=["worker", "path"],
    )
    for view in router.fleet.workers.values():
        for path, honoured in view.pin_check.items():
            family.add_metric([view.url, path], float(honoured))
    return family


def _prompt_ids_family(router) -> GaugeMetricFamily:
    """Per vLLM worker, whether a completion's text prompt goes to it as the router's token ids
    (apps/routing/feeds/prompt_ids.py): 1 once its /tokenize agreed, else 0."""
    family = GaugeMetricFamily(
        f"{PREFIX}_prompt_ids",
        "1 where a completion's text prompt goes to the worker as the router's token ids (its "
        "/tokenize agreed with them), 0 where it goes as text",
        labels=["worker"],
    )
    for view in router.fleet.workers.values():
        if view.flavour == "vllm":
            family.add_metric([view.url], float(view.prompt_ids))
    return family


def _role_family(targets) -> GaugeMetricFamily:
    """Each target's prefill/decode role (apps/routing/proxy/pd.py): "prefill", "decode", or
    "both" for a worker that serves whole requests."""
    family = GaugeMetricFamily(
        f"{PREFIX}_target_role",
        "1 per target, labelled with its prefill/decode role (both: whole requests)",
        labels=[*_TARGET_LABELS, "role"],
    )
    for t in targets:
        family.add_metric([*_target_labels(t), t.worker.role or "both"], 1)
    return family


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
