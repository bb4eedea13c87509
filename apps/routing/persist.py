"""Persisting the router's in-memory stats to the Rank rows, so they survive restarts and the
dashboard (and other processes) can read them from the database."""
from __future__ import annotations

import asyncio
import logging

from asgiref.sync import sync_to_async
from django.db import transaction

from apps.replicas.models import Rank
from apps.routing.stats import TargetStats

logger = logging.getLogger(__name__)

FIELDS = ("requests", "prompt_tokens", "cached_tokens", "predicted_tokens", "errors")


def _targets_by_rank_id(router) -> dict[int, str]:
    return {t.rank_id: t.key for t in router.fleet.all_targets() if t.rank_id is not None}


async def restore_stats(router) -> None:
    """Start each target's counters from what the database recorded before a restart."""
    keys = _targets_by_rank_id(router)
    async for row in Rank.objects.filter(id__in=list(keys)):
        stats = router.stats.targets.setdefault(keys[row.id], TargetStats())
        for name in FIELDS:
            setattr(stats, name, getattr(stats, name) + getattr(row, name))


def _write(rows: dict[int, dict]) -> None:
    with transaction.atomic():
        for rank_id, values in rows.items():
            Rank.objects.filter(id=rank_id).update(**values)


async def persist_stats(router) -> None:
    keys = _targets_by_rank_id(router)
    rows = {}
    for rank_id, key in keys.items():
        stats = router.stats.targets.get(key)
        if stats is not None:
            rows[rank_id] = {name: getattr(stats, name) for name in FIELDS}
            rows[rank_id]["circuit_state"] = next(t.breaker.state for t in router.fleet.all_targets() if t.key == key)
    if rows:
        await sync_to_async(_write)(rows)


async def stats_loop(router) -> None:
    await restore_stats(router)
    while True:
        await asyncio.sleep(router.config.stats_persist_interval_s)
        try:
            await persist_stats(router)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("persisting routing stats failed")
