"""The replicas' periodic jobs, as plain functions: scrape each engine's /metrics into
``RankSample`` rows, prune old rows, refresh discovery.

They touch only the database and the engines (never a router's memory), so the same code runs in
a Celery worker (apps/replicas/tasks.py wraps each one in a task: Celery's convention) or, without
a broker, in threads of the router process (apps/routing/jobs.py ``embedded_jobs_loop``). Router
processes pick up what they change (a new dp_size, a draining flag) from the database, and each
rank's KV usage from the latest scraped samples (apps/routing/feeds/fleet_sync.py). Whoever wants
to know that a scrape landed (the dashboard) listens to ``fleet_scraped``.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta

from django.conf import settings
from django.dispatch import Signal
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from apps.replicas.discovery import (
    DiscoveryError,
    effective_info,
    fetch_server_info,
    role_of,
    stable_info,
    wanted_lines,
)
from apps.replicas.models import RankSample, Worker, WorkerEvent
from apps.replicas.pin_check import check_pins
from apps.replicas.services import save_worker
from controlplane import http

logger = logging.getLogger(__name__)

# sent after each scrape has written its rows (the routing app refreshes the dashboard on it)
fleet_scraped = Signal()

SAMPLE_FIELDS = (
    "requests",
    "prompt_tokens",
    "cached_tokens",
    "running",
    "waiting",
    "kv_blocks_used",
    "kv_blocks_total",
    "kv_blocks_pulled",
    "kv_bytes_pulled",
    "kv_bytes_sent",
)

# Engine metric names -> RankSample fields: ours (per-rank label "rank"), then vLLM's (label
# "engine" is its DP rank) so a vLLM worker behind the router gets a time series too. vLLM says
# no KV block counts, only the fraction in use (``kv_usage_perc``, 0..1, no RankSample field):
# ``parse_engine_metrics`` turns it into blocks with the worker's known capacity.
_METRIC_MAP = {
    "dpmesh_engine_requests": "requests",
    "dpmesh_engine_prompt_tokens": "prompt_tokens",
    "dpmesh_engine_cached_tokens": "cached_tokens",
    "dpmesh_engine_num_requests_running": "running",
    "dpmesh_engine_num_requests_waiting": "waiting",
    "dpmesh_engine_kv_blocks_used": "kv_blocks_used",
    "dpmesh_engine_kv_blocks_total": "kv_blocks_total",
    "dpmesh_engine_rank_up": "rank_up",
    "dpmesh_engine_kv_transfer_blocks_pulled": "kv_blocks_pulled",
    "dpmesh_engine_kv_transfer_bytes_pulled": "kv_bytes_pulled",
    "dpmesh_engine_kv_transfer_bytes_sent": "kv_bytes_sent",
    "vllm:request_success": "requests",
    "vllm:prefix_cache_queries": "prompt_tokens",
    "vllm:prefix_cache_hits": "cached_tokens",
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage_perc",
}


# the sample lines worth parsing: an engine's /metrics is mostly histograms the scrape never reads
# (vLLM's: ~1,000 lines, 83 kB at DP 2; prometheus_client's parser took 25 ms of the router's GIL
# for all of it, every 2 s, in a thread beside the event loop)
_WANTED_PREFIXES = tuple(_METRIC_MAP)


def parse_engine_metrics(
    text: str, capacity_blocks: int | None = None
) -> dict[int | None, dict[str, float]]:
    """{rank: {field: value}} from an engine's Prometheus text. Series without a rank label are
    filed under None; several series of one field for one rank (vLLM splits request_success by
    finish reason) are summed.

    A rank that says what fraction of its KV cache is in use but no block counts (vLLM) gets
    ``kv_blocks_total`` = ``capacity_blocks`` (the worker's KV blocks per rank, as discovery
    found them: ``num_kv_blocks_per_rank``) and ``kv_blocks_used`` = that fraction of it,
    rounded; without a known capacity it gets neither. An engine's own counts (ours) are kept."""
    out: dict[int | None, dict[str, float]] = {}
    for family in text_string_to_metric_families(wanted_lines(text, _WANTED_PREFIXES)):
        for sample in family.samples:
            # by sample name: exporters differ in whether the TYPE line carries "_total"
            field = _METRIC_MAP.get(sample.name) or _METRIC_MAP.get(
                sample.name.removesuffix("_total")
            )
            if field is None:
                continue
            label = sample.labels.get("rank", sample.labels.get("engine"))
            try:
                rank = int(label) if label is not None else None
            except ValueError:
                rank = None
            values = out.setdefault(rank, {})
            values[field] = values.get(field, 0.0) + sample.value
    for values in out.values():
        usage = values.pop("kv_usage_perc", None)
        if usage is not None and capacity_blocks and "kv_blocks_total" not in values:
            values["kv_blocks_total"] = float(capacity_blocks)
            values["kv_blocks_used"] = float(round(usage * capacity_blocks))
    return out


def _rank_values(parsed: dict, rank: int | None) -> dict[str, float] | None:
    if rank is not None and rank in parsed:
        return parsed[rank]
    if rank is None and parsed:  # a worker-level target: the whole engine
        total: dict[str, float] = {}
        for values in parsed.values():
            for name, value in values.items():
                total[name] = total.get(name, 0.0) + value
        return total
    return None


def scrape_fleet(timeout: float = 5.0) -> int:
    """One RankSample per rank of every discovered worker, all stamped with the same time (one
    point of the dashboard's series, and what every router process's ``FleetSync`` reads each
    rank's KV usage from). An engine that does not answer gets ``up=False`` rows with its last
    known counters, so the series shows the gap (and the routers take its KV usage for unknown).
    Returns the number of rows written."""
    at = timezone.now()
    rows, silent = [], []
    workers = list(Worker.objects.exclude(server_info={}).prefetch_related("ranks"))
    for worker, parsed in zip(workers, http.run(_scrape_all, workers, timeout), strict=True):
        for rank in worker.ranks.all():
            values = _rank_values(parsed, rank.rank) if parsed is not None else None
            if values is None:
                silent.append(rank)
            else:  # the engine answered; a rank process that died reports rank_up 0
                rows.append(
                    RankSample(
                        rank=rank,
                        at=at,
                        up=bool(values.get("rank_up", 1)),
                        **{k: int(values.get(k, 0)) for k in SAMPLE_FIELDS},
                    )
                )
    last = _last_values([rank.id for rank in silent])
    for rank in silent:
        values = last.get(rank.id, {})
        rows.append(RankSample(rank=rank, at=at, up=False, **values))
    RankSample.objects.bulk_create(rows)
    fleet_scraped.send(sender=scrape_fleet, rows=len(rows))
    return len(rows)


def _last_values(rank_ids: list[int]) -> dict[int, dict[str, int]]:
    """{Rank id: its latest sample's counters} of the ranks that have one, in one query however
    many ranks did not answer (a DP-16 engine that is down, scraped every 2 s)."""
    if not rank_ids:
        return {}
    rows = RankSample.latest_of(rank_ids).order_by().values_list("rank_id", *SAMPLE_FIELDS)
    return {rank_id: dict(zip(SAMPLE_FIELDS, values, strict=True)) for rank_id, *values in rows}


async def _scrape_all(workers: list[Worker], timeout: float) -> list[dict | None]:
    return await asyncio.gather(*(_scrape(w, timeout) for w in workers))


def _capacity_blocks(worker: Worker) -> int | None:
    """The worker's KV blocks per rank as discovery found them (vLLM: ``num_gpu_blocks`` of its
    ``vllm:cache_config_info``), or None."""
    blocks = effective_info(worker.server_info, worker.overrides).get("num_kv_blocks_per_rank")
    return (
        blocks if isinstance(blocks, int) and not isinstance(blocks, bool) and blocks > 0 else None
    )


async def _scrape(worker: Worker, timeout: float) -> dict | None:
    """The engine's /metrics by rank, or None when it does not answer them."""
    try:
        status, text = await http.get_text(
            worker.url + "/metrics", api_key=worker.api_key, timeout_s=timeout
        )
        return parse_engine_metrics(text, _capacity_blocks(worker)) if status == 200 else None
    except (*http.ERRORS, ValueError) as exc:
        logger.debug("scraping %s failed: %s", worker.url, exc)
        return None


def prune(now=None) -> dict[str, int]:
    """Delete samples and worker events past their retention."""
    cp = settings.CONTROL_PLANE
    now = now or timezone.now()
    samples, _ = RankSample.objects.filter(
        at__lt=now - timedelta(seconds=cp["SAMPLE_RETENTION_S"])
    ).delete()
    events, _ = WorkerEvent.objects.filter(
        at__lt=now - timedelta(seconds=cp["EVENT_RETENTION_S"])
    ).delete()
    return {"samples": samples, "events": events}


async def _fetch_all(workers: list[Worker], timeout: float) -> list:
    return await asyncio.gather(
        *(fetch_server_info(w.url, w.api_key, timeout) for w in workers), return_exceptions=True
    )


def refresh_discovery(timeout: float = 10.0) -> dict[str, int]:
    """Ask every discovered engine for its /server_info again (all at once) and record what
    changed — a restart, another dp_size or model — through the same ``save_worker`` discovery
    uses (Rank rows follow dp_size; events say what changed). Router processes reinstall the worker
    when they next sync from the database. Unreachable and undiscovered workers are the health
    loop's business."""
    workers = list(Worker.objects.exclude(server_info={}))
    checked = changed = 0
    for worker, info in zip(workers, http.run(_fetch_all, workers, timeout), strict=True):
        if not isinstance(info, dict) or info.get("flavour") == "openai":
            continue  # unreachable now, or a server without /server_info: nothing to refresh
        checked += 1
        if stable_info(info) == stable_info(worker.server_info):
            continue
        pd_leg = role_of(effective_info(info, worker.overrides)) is not None
        if worker.dp_aware and settings.CONTROL_PLANE["PIN_CHECK"] and not pd_leg:  # ask again
            info["pin_check"] = http.run(check_pins, worker.url, info, worker.api_key)
        try:
            save_worker(url=worker.url, api_key=worker.api_key, dp_aware=worker.dp_aware, info=info)
        except DiscoveryError:  # an invalid dp_size: keep what we had
            continue
        changed += 1
    return {"checked": checked, "changed": changed}
