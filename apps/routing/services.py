"""Services that change how requests are routed: the policy, and on-demand benchmark runs.

The policy is durable (one ``RoutingSettings`` row every router process applies) and applied at
once in the process that switched it; the others adopt it when they next sync (fleet_sync.py).
"""

from __future__ import annotations

import asyncio
import logging

from asgiref.sync import sync_to_async

from apps.routing import jobs
from apps.routing.decision.policies import POLICIES
from apps.routing.models import BenchRun, RoutingSettings

logger = logging.getLogger(__name__)


def _policy_save(name: str, by: str) -> RoutingSettings:
    row = RoutingSettings.load()
    row.policy, row.updated_by = name, by
    row.save()
    return row


async def policy_set(*, router, name: str, by: str) -> None:
    """Switch the policy now in this process and durably for every router process."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(sorted(POLICIES))}")
    await sync_to_async(_policy_save)(name, by)
    router.set_policy(name)
    await sync_to_async(jobs.notify_dashboard)("policy")


async def policy_adopt(*, router, flag: str | None) -> None:
    """At startup and on every sync: an explicit ``--policy`` wins and is recorded; otherwise the
    recorded one applies."""
    if flag:
        await sync_to_async(_policy_save)(flag, "--policy flag")
        return
    row = await sync_to_async(RoutingSettings.load)()
    if row.policy != router.config.policy:
        router.set_policy(row.policy)


def bench_run_create(*, base_url: str, params: dict, user: str) -> BenchRun:
    return BenchRun.objects.create(base_url=base_url, params=params, created_by=user)


def bench_run_enqueue(*, run_id: int) -> None:
    """Start a BenchRun: on the Celery worker, or (embedded) in a thread of this process."""
    if jobs.embedded():
        asyncio.ensure_future(_guarded_bench(run_id))
    else:
        from apps.routing.tasks import run_bench

        run_bench.delay(run_id)


async def _guarded_bench(run_id: int) -> None:
    try:
        await jobs.run_in_thread(jobs.run_bench, run_id)
    except Exception:
        logger.exception("bench run %s failed", run_id)
