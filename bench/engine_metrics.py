"""The engine's own per-rank counters, read from its Prometheus ``/metrics`` before and after a run.

This is the server's truth: it works when a router in front hides the ``X-Data-Parallel-Rank``
header, and it cross-checks the cached tokens the client summed from ``usage``. Any other
requests the engine served during the run are counted too, so run on an otherwise idle engine.
"""

from __future__ import annotations

from urllib.parse import urlsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.summary import balance

# Counter samples read per rank, by their exposed sample name.
SAMPLES = {
    "requests": "dpmesh_engine_requests_total",
    "prompt_tokens": "dpmesh_engine_prompt_tokens_total",
    "cached_tokens": "dpmesh_engine_cached_tokens_total",
}
# vLLM's names for the same, per DP rank (label ``engine``)
VLLM_SAMPLES = {
    "requests": "vllm:request_success_total",
    "prompt_tokens": "vllm:prefix_cache_queries_total",
    "cached_tokens": "vllm:prefix_cache_hits_total",
}

Snapshot = dict[str, dict[int, float]]  # quantity -> rank -> value


def metrics_url(url: str) -> str:
    """Accept the engine's base URL or its full metrics URL."""
    return url.rstrip("/") + "/metrics" if urlsplit(url).path in ("", "/") else url


def parse(text: str) -> Snapshot:
    """Per-rank values of the counters in :data:`SAMPLES` (summed over other labels)."""
    wanted = {sample: key for key, sample in (*SAMPLES.items(), *VLLM_SAMPLES.items())}
    out: Snapshot = {key: {} for key in SAMPLES}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = wanted.get(sample.name)
            label = sample.labels.get("rank", sample.labels.get("engine"))
            if key is None or label is None:
                continue
            rank = int(label)
            out[key][rank] = out[key].get(rank, 0.0) + sample.value
    return out


async def scrape(url: str, timeout_s: float = 10.0) -> Snapshot:
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        response = await client.get(metrics_url(url))
        response.raise_for_status()
        return parse(response.text)


def delta(before: Snapshot, after: Snapshot) -> Snapshot:
    """after - before per quantity and rank (a rank new in ``after`` counts from zero)."""
    return {
        key: {rank: value - before.get(key, {}).get(rank, 0.0) for rank, value in ranks.items()}
        for key, ranks in after.items()
    }


def summarize(diff: Snapshot) -> dict:
    """Per-rank deltas, totals, the engine-side hit rate and the max/mean balance."""
    ranks = sorted(set().union(*(d.keys() for d in diff.values())))
    rows = {str(r): {key: int(diff[key].get(r, 0)) for key in SAMPLES} for r in ranks}
    totals = {key: int(sum(diff[key].values())) for key in SAMPLES}
    return {
        "ranks": rows,
        "totals": totals,
        "hit_rate": totals["cached_tokens"] / totals["prompt_tokens"]
        if totals["prompt_tokens"]
        else None,
        "requests_max_over_mean": balance({r: diff["requests"].get(r, 0) for r in ranks}),
        "prompt_tokens_max_over_mean": balance({r: diff["prompt_tokens"].get(r, 0) for r in ranks}),
    }
