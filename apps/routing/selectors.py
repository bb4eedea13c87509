"""The dashboard's data: one JSON snapshot of the fleet, pushed over the websocket.

Two sources side by side, per rank:
- the routers' view: requests dispatched, prompt tokens, the tokens the prefix index predicted
  cached (the Rank rows every router process adds to, plus what this process has not written
  yet), and this process's load in flight and circuit state;
- the engine's view, from the latest scrape of the engine's /metrics (``RankSample`` rows
  written by the scrape job): requests finished, prompt and cached tokens, KV blocks.
The engine hit rate is the engine's cumulative cached / prompt tokens, exactly what its /metrics
says at the last scrape; the router-predicted hit rate is predicted / prompt tokens routed.
The series are per scrape interval (differences of the counters), so the chart shows how the
hit rate moves now, not a cumulative average that stops moving.
"""

from __future__ import annotations

import time
from datetime import timedelta

from django.conf import settings
from django.utils import timezone

from apps.replicas.models import RankSample, Worker
from apps.replicas.targets import target_key
from apps.routing import worker_metrics
from apps.routing.proxy.admission import Admission


def _rate(num, den):
    return num / den if den else None


def _latest_samples(rank_ids: list[int]) -> dict[int, RankSample]:
    """The newest sample of each rank that has one."""
    return {sample.rank_id: sample for sample in RankSample.latest_of(rank_ids)}


def series(rank_keys: dict[int, str], window_s: float, max_points: int = 300) -> dict:
    """Per-interval engine hit rate per rank and for the fleet, and fleet requests/s."""
    since = timezone.now() - timedelta(seconds=window_s)
    rows = (
        RankSample.objects.filter(rank_id__in=list(rank_keys), at__gte=since)
        .order_by("at", "id")
        .values_list("rank_id", "at", "requests", "prompt_tokens", "cached_tokens", "up")
    )
    by_time: dict = {}
    for rank_id, at, requests, prompt, cached, up in rows:
        by_time.setdefault(at, {})[rank_id] = (requests, prompt, cached, up)
    times = sorted(by_time)[-(max_points + 1) :]
    out = {
        "t": [],
        "ranks": {key: [] for key in rank_keys.values()},
        "fleet": [],
        "requests_per_s": [],
    }
    for before, after in zip(times, times[1:], strict=False):
        a, b = by_time[before], by_time[after]
        dt = (after - before).total_seconds()
        d_req = d_prompt = d_cached = 0
        out["t"].append(after.timestamp())
        for rank_id, key in rank_keys.items():
            if rank_id in a and rank_id in b and b[rank_id][3]:
                # a restarted engine counts from zero again: then the new value is the difference
                dr, dp, dc = (
                    new - old if new >= old else new
                    for old, new in zip(a[rank_id][:3], b[rank_id][:3], strict=True)
                )
                d_req, d_prompt, d_cached = d_req + dr, d_prompt + dp, d_cached + dc
                out["ranks"][key].append(_rate(dc, dp))
            else:
                out["ranks"][key].append(None)
        out["fleet"].append(_rate(d_cached, d_prompt))
        out["requests_per_s"].append(d_req / dt if dt > 0 else None)
    return out


def build_snapshot(router, admission=None) -> dict:
    """Everything the dashboard shows, as JSON-ready data. Sync: it reads the database.

    The steps: the workers with a row per rank (``_worker_rows``), the per-interval chart
    (``series``), the fleet's totals over the rank rows (``_fleet_totals``), then the policy and
    the latest bench runs."""
    from apps.routing.decision.policies import POLICIES
    from apps.routing.models import RoutingSettings

    cp = settings.CONTROL_PLANE
    worker_rows, rank_keys = _worker_rows(router)
    chart = series(rank_keys, cp["DASHBOARD_WINDOW_S"])
    fleet = _fleet_totals(worker_rows, chart, admission)
    policy = RoutingSettings.objects.filter(id=1).first()
    return {
        "type": "snapshot",
        "at": time.time(),
        "policy": router.config.policy,
        "policies": sorted(POLICIES),
        "policy_updated_by": policy.updated_by if policy else None,
        "policy_updated_at": policy.updated_at.isoformat() if policy else None,
        "scrape_interval_s": cp["SCRAPE_INTERVAL_S"],
        "fleet": fleet,
        "workers": worker_rows,
        "series": chart,
        "bench": _bench_runs(),
        # why prompts were not all cached, as this router process counted (misses.py); the
        # dashboard is for staff, who see the diverging turns' text
        "misses": router.misses.as_dict(renderings=True),
    }


def _worker_rows(router) -> tuple[list[dict], dict[int, str]]:
    """One row per worker with its ranks in order, and each Rank row's id -> target key (what
    ``series`` charts). Health is this process's live view where it has one: the database's is
    only as fresh as the last health job."""
    workers = list(Worker.objects.prefetch_related("ranks"))
    rank_rows = {(row.worker_id, row.rank): row for w in workers for row in w.ranks.all()}
    latest = _latest_samples([row.id for row in rank_rows.values()])
    targets = {t.key: t for t in router.fleet.all_targets()}
    worker_rows, rank_keys = [], {}
    for w in workers:
        view = router.fleet.workers.get(w.id)
        health = w.health if view is None else ("healthy" if view.healthy else "unhealthy")
        ranks = []
        for row in sorted(w.ranks.all(), key=lambda r: -1 if r.rank is None else r.rank):
            key = target_key(w.url, row.rank)
            rank_keys[row.id] = key
            ranks.append(_rank_row(router, key, row, targets.get(key), latest.get(row.id)))
            ranks[-1]["role"] = view.role if view is not None else None
        worker_rows.append(
            {
                "id": w.id,
                "url": w.url,
                "model": w.model_name,
                "dp_size": w.dp_size,
                "flavour": (w.server_info or {}).get("flavour")
                or ("dpmesh" if w.server_info else None),
                # prefill/decode disaggregation: "prefill", "decode" or None (both in one)
                "role": view.role if view is not None else None,
                "health": health,
                "health_detail": w.health_detail,
                "draining": w.draining,
                "ranks": ranks,
            }
        )
    return worker_rows, rank_keys


def _rank_row(router, key: str, row, target, sample: RankSample | None) -> dict:
    """One rank, the routers' view beside the engine's. ``target``: this process's live target
    (None: not in its fleet), for the circuit and the load in flight; ``sample``: the engine's
    latest scrape (None: not scraped yet, its columns are null)."""
    # every router process's persisted counts, plus what this one has not written yet
    delta = router.stats.unwritten(key)
    requests = row.requests + delta["requests"]
    prompt = row.prompt_tokens + delta["prompt_tokens"]
    predicted = row.predicted_tokens + delta["predicted_tokens"]
    engine = (
        {
            "engine_requests": sample.requests,
            "engine_prompt_tokens": sample.prompt_tokens,
            "engine_cached_tokens": sample.cached_tokens,
        }
        if sample
        else dict.fromkeys(("engine_requests", "engine_prompt_tokens", "engine_cached_tokens"))
    )
    router_rate = _rate(predicted, prompt)
    engine_rate = _rate(sample.cached_tokens, sample.prompt_tokens) if sample else None
    return {
        "key": key,
        "rank": row.rank,
        "circuit": target.breaker.state if target else row.circuit_state,
        "available": bool(target and target.available),
        "requests": requests,
        "prompt_tokens": prompt,
        "predicted_tokens": predicted,
        "router_hit_rate": router_rate,
        **engine,
        "engine_hit_rate": engine_rate,
        "gap": engine_rate - router_rate
        if engine_rate is not None and router_rate is not None
        else None,
        "inflight_requests": target.load.inflight if target else 0,  # every router process's
        "inflight_tokens": target.load.inflight_tokens if target else 0,
        "kv_blocks_used": sample.kv_blocks_used if sample else None,
        "kv_blocks_total": sample.kv_blocks_total if sample else None,
        # prefill/decode disaggregation: the KV this rank's engine pulled (decode) or sent
        # (prefill) so far; against a decode rank's router columns (what the index predicted it
        # held before the pull) it says how much transfer the routing saved
        "kv_blocks_pulled": sample.kv_blocks_pulled if sample else None,
        "kv_bytes_pulled": sample.kv_bytes_pulled if sample else None,
        "kv_bytes_sent": sample.kv_bytes_sent if sample else None,
        "scraped_at": sample.at.timestamp() if sample else None,
        # precise (KV events followed) or not, and why not: the observers know
        "precise": False,
        **{k: v for o in router.observers for k, v in o.target_state(key).items()},
    }


# the fleet's totals: sums of the rank rows' columns of the same name (an engine column is null
# on a rank not scraped yet, and adds nothing). In a prefill/decode-disaggregated fleet a request
# is counted by its prefill leg: its decode leg's rank reports the same prompt and the prefill
# side's cached tokens again, so decode ranks are left out of the request and token sums
_FLEET_SUMS = (
    "requests",
    "prompt_tokens",
    "predicted_tokens",
    "engine_requests",
    "engine_prompt_tokens",
    "engine_cached_tokens",
)
_FLEET_SUMS_ALL_RANKS = ("inflight_requests", "kv_bytes_pulled")


def _fleet_totals(worker_rows: list[dict], chart: dict, admission) -> dict:
    """The fleet summary: the rank rows' sums, the fleet's hit rates from those sums (not a mean
    of the ranks' rates, which would weigh an idle rank like a busy one), the latest requests/s
    of the chart, and the admission queue (every worker's under ``--workers N``)."""
    ranks = [rank for w in worker_rows for rank in w["ranks"]]
    computing = [rank for rank in ranks if rank.get("role") != "decode"]
    fleet = {name: sum(rank[name] or 0 for rank in computing) for name in _FLEET_SUMS}
    fleet.update({name: sum(rank[name] or 0 for rank in ranks) for name in _FLEET_SUMS_ALL_RANKS})
    fleet["router_hit_rate"] = _rate(fleet["predicted_tokens"], fleet["prompt_tokens"])
    fleet["engine_hit_rate"] = _rate(fleet["engine_cached_tokens"], fleet["engine_prompt_tokens"])
    rps = [v for v in chart["requests_per_s"] if v is not None]
    fleet["requests_per_s"] = rps[-1] if rps else None
    # this process's admission queue: waiting, admitted, refused (429 / 503), saturated, draining
    # (None: no admission control here, an idle one reports zeros); under --workers N the
    # workers' queues, admitted and refused added up (apps/routing/worker_metrics.py)
    fleet.update(worker_metrics.fleet_admission((admission or Admission()).snapshot()))
    return fleet


def _bench_runs() -> list[dict]:
    """The ten newest bench runs (the model's ordering), for the dashboard's bench panel."""
    from apps.routing.models import BenchRun

    return [
        {
            "id": b.id,
            "created_at": b.created_at.isoformat(),
            "status": b.status,
            "error": b.error,
            "params": b.params,
            "result": b.result,
        }
        for b in BenchRun.objects.all()[:10]
    ]
