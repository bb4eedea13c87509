"""What a router process runs besides requests (daphne has no ASGI lifespan; ``startup`` in
apps/replicas/serving.py starts these):

- ``sync_loop``: every ``SYNC_INTERVAL_S``, apply what the database says and this process does
  not know yet: the policy (switched on the dashboard, maybe served by another router process)
  and the workers (added, drained, refreshed or removed elsewhere: the admin of another process,
  the Celery discovery refresh).
- ``embedded_jobs_loop``: without a broker (no ``REDIS_URL``), the Celery jobs of
  apps/routing/jobs.py on their intervals, each in a thread so the event loop keeps serving.
  With ``REDIS_URL`` a Celery worker with beat runs them instead, and this loop is not started.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import close_old_connections

from apps.replicas.discovery import stable_info
from apps.routing import jobs

logger = logging.getLogger(__name__)

SYNC_INTERVAL_S = 2.0


def embedded() -> bool:
    """True when there is no broker: tasks would run eagerly where they are sent."""
    return bool(settings.CELERY_TASK_ALWAYS_EAGER)


# ----- policy --------------------------------------------------------------------------------------
def _policy_row():
    from apps.routing.models import RoutingSettings

    return RoutingSettings.load()


def _save_policy(name: str, by: str):
    from apps.routing.models import RoutingSettings

    row = RoutingSettings.load()
    row.policy, row.updated_by = name, by
    row.save()
    return row


async def set_policy(router, name: str, by: str) -> None:
    """Switch the policy now in this process and durably for every router process."""
    from apps.routing.policies import POLICIES

    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(sorted(POLICIES))}")
    await sync_to_async(_save_policy)(name, by)
    router.set_policy(name)
    await sync_to_async(jobs.notify_dashboard)("policy")


async def adopt_policy(router, flag: str | None) -> None:
    """At startup: an explicit ``--policy`` wins and is recorded; otherwise the recorded one applies."""
    if flag:
        await sync_to_async(_save_policy)(flag, "--policy flag")
        return
    row = await sync_to_async(_policy_row)()
    if row.policy != router.config.policy:
        router.set_policy(row.policy)


# ----- fleet ---------------------------------------------------------------------------------------
def _db_workers() -> list:
    from apps.replicas.models import Worker

    return [
        (w, {r.rank: r.id for r in w.ranks.all()}) for w in Worker.objects.prefetch_related("ranks")
    ]


def _fingerprint(worker, rank_ids: dict) -> tuple:
    return (
        worker.url,
        worker.api_key,
        worker.dp_size,
        worker.dp_aware,
        worker.draining,
        json.dumps(stable_info(worker.server_info), sort_keys=True),
        tuple(sorted(rank_ids.items(), key=str)),
    )


async def sync_fleet(router) -> None:
    """Make the router's fleet match the Worker rows (only what changed is reinstalled; a
    reinstalled worker keeps its targets' load, breakers and health)."""
    from apps.replicas.services import install

    rows = await sync_to_async(_db_workers)()
    synced = router.db_fingerprints
    seen = set()
    for worker, rank_ids in rows:
        seen.add(worker.id)
        fingerprint = _fingerprint(worker, rank_ids)
        if synced.get(worker.id) == fingerprint:
            continue
        old = router.fleet.workers.get(worker.id)
        install(router, worker, rank_ids)
        new = router.fleet.workers.get(worker.id)
        if old is not None and new is not None and new is not old:
            new.healthy, new.consecutive_failures = old.healthy, old.consecutive_failures
            new.consecutive_successes = old.consecutive_successes
        if worker.server_info:  # undiscovered workers stay pending until the health loop finds them
            synced[worker.id] = fingerprint
    for worker_id in set(router.fleet.workers) - seen:
        for target in router.fleet.targets.get(worker_id, []):
            router.index.remove_rank(target.key)
        router.fleet.remove(worker_id)
        synced.pop(worker_id, None)
        logger.info("worker %s removed elsewhere: forgotten here too", worker_id)


async def sync_loop(router) -> None:
    while True:
        try:
            await adopt_policy(router, None)
            await sync_fleet(router)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("syncing from the database failed")
        await asyncio.sleep(SYNC_INTERVAL_S)


# ----- embedded jobs -------------------------------------------------------------------------------
def _run_job(func, *args):
    try:
        return func(*args)
    finally:
        close_old_connections()  # a worker thread's connection must not outlive the job


async def run_in_thread(func, *args):
    return await sync_to_async(_run_job, thread_sensitive=False)(func, *args)


async def embedded_jobs_loop() -> None:
    """Each job on its own interval; one slow job does not delay the others' schedule."""
    cp = settings.CONTROL_PLANE
    schedule = [
        (jobs.scrape_fleet, cp["SCRAPE_INTERVAL_S"]),
        (jobs.refresh_discovery, cp["DISCOVERY_REFRESH_INTERVAL_S"]),
        (jobs.prune, cp["PRUNE_INTERVAL_S"]),
    ]
    due = {func: time.monotonic() for func, _ in schedule}
    running: dict = {}
    while True:
        now = time.monotonic()
        for func, interval in schedule:
            task = running.get(func)
            if now >= due[func] and (task is None or task.done()):
                due[func] = now + interval
                running[func] = asyncio.ensure_future(_guarded(func))
        await asyncio.sleep(max(0.05, min(due.values()) - time.monotonic()))


async def _guarded(func) -> None:
    try:
        await run_in_thread(func)
    except asyncio.CancelledError:
        raise
    except Exception:
        logger.exception("job %s failed", func.__name__)


def enqueue_bench(run_id: int) -> None:
    """Start a BenchRun: on the Celery worker, or (embedded) in a thread of this process."""
    if embedded():
        asyncio.ensure_future(_guarded_bench(run_id))
    else:
        from apps.routing.tasks import run_bench

        run_bench.delay(run_id)


async def _guarded_bench(run_id: int) -> None:
    try:
        await run_in_thread(jobs.run_bench, run_id)
    except Exception:
        logger.exception("bench run %s failed", run_id)
