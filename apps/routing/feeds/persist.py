"""Persisting the router's in-memory stats to the Rank rows, so they survive restarts and the
dashboard (and other processes) can read them from the database.

Several router processes may share one database (with ``REDIS_URL``, docs/operations.md), so
each persists what it counted *since its last write* as an increment (``F(field) + delta``),
never an absolute value that would overwrite the others'. A process starts its counters from the
rows (``restore_stats``), and that starting point is its first baseline.
"""

from __future__ import annotations

import asyncio
import logging

from asgiref.sync import sync_to_async
from django.db import transaction
from django.db.models import F

from apps.replicas.models import Rank
from apps.routing.decision.router_stats import PERSISTED_FIELDS, TargetStats

logger = logging.getLogger(__name__)


def _targets_by_rank_id(router) -> dict[int, str]:
    return {t.rank_id: t.key for t in router.fleet.all_targets() if t.rank_id is not None}


async def restore_stats(router) -> None:
    """Start each target's counters from what the database recorded before a restart."""
    keys = _targets_by_rank_id(router)
    async for row in Rank.objects.filter(id__in=list(keys)):
        stats = router.stats.targets.setdefault(keys[row.id], TargetStats())
        for name in PERSISTED_FIELDS:
            setattr(stats, name, getattr(stats, name) + getattr(row, name))
        router.stats.persisted[keys[row.id]] = {
            name: getattr(row, name) for name in PERSISTED_FIELDS
        }


def _write(rows: dict[int, tuple[dict, str]]) -> None:
    with transaction.atomic():
        for rank_id, (delta, circuit) in rows.items():
            Rank.objects.filter(id=rank_id).update(
                circuit_state=circuit,
                **{name: F(name) + value for name, value in delta.items() if value},
            )


async def persist_stats(router) -> None:
    """Write what changed since the last write: a rank whose counters and circuit are as this
    process last wrote them is left alone (an idle router writes nothing)."""
    stats = router.stats
    rows, snapshots, circuits = {}, {}, {}
    for target in router.fleet.all_targets():
        if target.rank_id is None:
            continue
        delta, circuit = stats.unwritten(target.key), target.breaker.state
        if not any(delta.values()) and stats.persisted_circuits.get(target.key) == circuit:
            continue
        rows[target.rank_id] = (delta, circuit)
        snapshots[target.key], circuits[target.key] = stats.counters(target.key), circuit
    if rows:
        await sync_to_async(_write)(rows)
        # only once written: a failed write is retried next round
        stats.persisted.update(snapshots)
        stats.persisted_circuits.update(circuits)


async def stats_loop(router, restore: bool = True) -> None:
    """Persist ``router``'s counts every interval, having started them from the rows (unless
    ``restore`` is False: a worker of ``--workers N`` other than the first start of worker 0,
    apps/routing/worker_metrics.py, so that the history is counted once)."""
    if restore:
        await restore_stats(router)
    while True:
        await asyncio.sleep(router.config.stats_persist_interval_s)
        try:
            await persist_stats(router)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("persisting routing stats failed")
