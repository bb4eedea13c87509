"""Turn request results into the numbers vLLM's ``bench serve`` prints, plus cache and rank balance.

Definitions (as vLLM's): TTFT is the time to the first content chunk; TPOT of a request is
``(latency - ttft) / (output_tokens - 1)`` over requests with more than one output token; ITL are
the gaps between successive content chunks, pooled over all requests. Throughputs divide by the
wall time of the whole run. The hit rate is cached prompt tokens over prompt tokens.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from bench.client import RequestResult


def distribution_ms(values_s: Iterable[float]) -> dict:
    """mean / median / p99 of seconds, in milliseconds (zeros when empty, like vLLM)."""
    arr = np.asarray(list(values_s), dtype=float) * 1000.0
    if arr.size == 0:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    return {
        "mean": float(arr.mean()),
        "median": float(np.median(arr)),
        "p99": float(np.percentile(arr, 99)),
    }


def tpot_s(result: RequestResult) -> float | None:
    if result.output_tokens <= 1:
        return None
    return (result.latency - result.ttft) / (result.output_tokens - 1)


def balance(counts: dict[int, float]) -> float | None:
    """max / mean over ranks: 1.0 is perfectly even, dp_size means everything on one rank."""
    if not counts:
        return None
    mean = sum(counts.values()) / len(counts)
    return max(counts.values()) / mean if mean else None


def per_rank(results: list[RequestResult], dp_size: int | None = None) -> dict[int, dict]:
    """Requests, prompt and cached tokens per serving rank (from the response header). Ranks of a
    known ``dp_size`` that served nothing are listed with zeros: they matter for the balance."""
    ranks = {r.rank for r in results if r.rank is not None}
    if not ranks:
        return {}
    ranks |= set(range(dp_size or 0))
    out = {rank: {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0} for rank in sorted(ranks)}
    for r in results:
        if r.rank is not None:
            row = out[r.rank]
            row["requests"] += 1
            row["prompt_tokens"] += r.prompt_tokens
            row["cached_tokens"] += r.cached_tokens or 0
    return out


def rank_summary(rows: dict[int, dict]) -> dict:
    """The per-rank table with its max/mean balance, or empty when no rank is known."""
    if not rows:
        return {}
    return {
        "ranks": {str(k): v for k, v in rows.items()},
        "requests_max_over_mean": balance({k: v["requests"] for k, v in rows.items()}),
        "prompt_tokens_max_over_mean": balance({k: v["prompt_tokens"] for k, v in rows.items()}),
    }


def summarize(results: list[RequestResult], duration_s: float, dp_size: int | None = None) -> dict:
    """All the client-side numbers of one run, JSON-ready."""
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    output = sum(r.output_tokens for r in ok)
    cached_known = [r for r in ok if r.cached_tokens is not None]
    cached = sum(r.cached_tokens for r in cached_known)
    cached_prompt = sum(r.prompt_tokens for r in cached_known)
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": prompt,
        "total_output_tokens": output,
        "request_throughput": len(ok) / duration_s if duration_s else 0.0,
        "output_throughput": output / duration_s if duration_s else 0.0,
        "total_token_throughput": (prompt + output) / duration_s if duration_s else 0.0,
        "ttft_ms": distribution_ms(r.ttft for r in ok),
        "tpot_ms": distribution_ms(t for t in map(tpot_s, ok) if t is not None),
        "itl_ms": distribution_ms(gap for r in ok for gap in r.itl),
        "e2el_ms": distribution_ms(r.latency for r in ok),
        "cached_tokens": cached if cached_known else None,
        "hit_rate": cached / cached_prompt if cached_prompt else None,
        "usage_reported": sum(r.usage_reported for r in ok),
        "per_rank": rank_summary(per_rank(ok, dp_size)),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }
