"""Prometheus text for /metrics: one family per quantity, one sample per DP rank."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.server.frontend import EngineClient
from engine.tokenize_cache import counters as tokenizer_counters

PREFIX = "dpmesh_engine"

# (name, help, kind, reader of a RankState)
_FAMILIES = [
    ("requests", "Requests finished by the rank", "counter", lambda s: s.counters.requests),
    (
        "prompt_tokens",
        "Prompt tokens of finished requests",
        "counter",
        lambda s: s.counters.prompt_tokens,
    ),
    (
        "cached_tokens",
        "Prompt tokens of finished requests served from the prefix cache",
        "counter",
        lambda s: s.counters.cached_tokens,
    ),
    (
        "generation_tokens",
        "Generated tokens of finished requests",
        "counter",
        lambda s: s.counters.generation_tokens,
    ),
    (
        "router_predicted_tokens",
        "Cached prompt tokens a router predicted for the requests it sent (its header)",
        "counter",
        lambda s: s.counters.predicted_tokens,
    ),
    (
        "router_predicted_cached_tokens",
        "Of the prompt tokens a router predicted cached, those the rank had",
        "counter",
        lambda s: s.counters.predicted_cached_tokens,
    ),
    (
        "router_mispredicted_tokens",
        "Prompt tokens a router predicted cached that the rank had not (it computed them)",
        "counter",
        lambda s: s.counters.mispredicted_tokens,
    ),
    ("request_errors", "Requests that failed on the rank", "counter", lambda s: s.counters.errors),
    (
        "request_aborts",
        "Requests aborted before they finished (client gone)",
        "counter",
        lambda s: s.counters.aborts,
    ),
    (
        "preemptions",
        "Sequences preempted for lack of KV blocks",
        "counter",
        lambda s: s.stats.num_preemptions if s.stats else 0,
    ),
    (
        "prefix_cache_queries_tokens",
        "Prompt tokens looked up in the prefix cache at admission",
        "counter",
        lambda s: s.stats.prefix_cache_prompt_tokens if s.stats else 0,
    ),
    (
        "prefix_cache_hits_tokens",
        "Prompt tokens found in the prefix cache at admission",
        "counter",
        lambda s: s.stats.prefix_cache_cached_tokens if s.stats else 0,
    ),
    (
        "num_requests_running",
        "Sequences the scheduler is running",
        "gauge",
        lambda s: s.stats.num_running if s.stats else 0,
    ),
    (
        "num_requests_waiting",
        "Sequences waiting for admission",
        "gauge",
        lambda s: s.stats.num_waiting if s.stats else 0,
    ),
    (
        "kv_blocks_used",
        "KV blocks held by requests",
        "gauge",
        lambda s: s.stats.kv_blocks_used if s.stats else 0,
    ),
    (
        "kv_blocks_cached",
        "Free KV blocks that still hold a cached prefix",
        "gauge",
        lambda s: s.stats.kv_blocks_cached if s.stats else 0,
    ),
    (
        "kv_blocks_total",
        "KV blocks in the rank's pool",
        "gauge",
        lambda s: s.info.num_kv_blocks if s.info else 0,
    ),
    (
        "inflight_requests",
        "Requests the front has dispatched to the rank and not yet seen end",
        "gauge",
        lambda s: s.inflight_requests,
    ),
    (
        "inflight_prompt_tokens",
        "Prompt tokens of those in-flight requests",
        "gauge",
        lambda s: s.inflight_tokens,
    ),
    ("rank_up", "1 while the rank process serves", "gauge", lambda s: int(s.alive)),
    # prefill/decode disaggregation (engine/kv_transfer.py)
    (
        "kv_transfer_held_requests",
        "Prefills whose KV blocks are held for a decode rank to pull",
        "gauge",
        lambda s: s.stats.kv_held_requests if s.stats else 0,
    ),
    (
        "kv_transfer_blocks_sent",
        "KV blocks this prefill rank sent to decode ranks",
        "counter",
        lambda s: s.stats.kv_blocks_sent if s.stats else 0,
    ),
    (
        "kv_transfer_bytes_sent",
        "Bytes of KV this prefill rank sent",
        "counter",
        lambda s: s.stats.kv_bytes_sent if s.stats else 0,
    ),
    (
        "kv_transfer_blocks_pulled",
        "KV blocks this decode rank pulled from prefill ranks",
        "counter",
        lambda s: s.stats.kv_blocks_pulled if s.stats else 0,
    ),
    (
        "kv_transfer_bytes_pulled",
        "Bytes of KV this decode rank pulled",
        "counter",
        lambda s: s.stats.kv_bytes_pulled if s.stats else 0,
    ),
    (
        "kv_transfer_pull_seconds",
        "Time this decode rank spent pulling KV, summed over pulls",
        "counter",
        lambda s: s.stats.kv_pull_seconds if s.stats else 0,
    ),
    (
        "pretokenized_requests",
        "Requests whose prompt came with its token ids (a router's): the front did not encode it",
        "counter",
        lambda s: s.counters.pretokenized,
    ),
]


class RankCollector:
    def __init__(self, client: EngineClient, model_name: str):
        self.client, self.model_name = client, model_name

    def collect(self):
        for name, help_text, kind, read in _FAMILIES:
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            family = cls(f"{PREFIX}_{name}", help_text, labels=["model_name", "rank"])
            for state in self.client.ranks:
                family.add_metric([self.model_name, str(state.rank)], read(state))
            yield family
        counts = tokenizer_counters()  # the front's: it encodes for every rank
        family = CounterMetricFamily(
            f"{PREFIX}_tokenizer_chars",
            "Prompt characters of long texts the front tokenized: taken from its prefix token "
            "cache (cached) or encoded",
            labels=["model_name", "source"],
        )
        for source in ("cached", "encoded"):
            family.add_metric([self.model_name, source], counts[source])
        yield family


def make_registry(client: EngineClient, model_name: str) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RankCollector(client, model_name))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
