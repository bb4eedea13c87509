"""The routing app's own jobs: nudge every open dashboard, run a benchmark against the fleet, and,
without a broker (no ``REDIS_URL``), run the periodic jobs (the replicas' scrape, discovery refresh
and prune: apps/replicas/jobs.py) in threads of the router process on their intervals
(``embedded_jobs_loop``). With a broker, Celery runs the same functions
(apps/replicas/tasks.py, apps/routing/tasks.py).
"""

from __future__ import annotations

import asyncio
import logging
import time

from asgiref.sync import async_to_sync, sync_to_async
from django.conf import settings
from django.db import close_old_connections
from django.utils import timezone

from apps.replicas.auth import configured_keys
from apps.replicas.jobs import prune, refresh_discovery, scrape_fleet
from apps.replicas.models import Worker

logger = logging.getLogger(__name__)

DASHBOARD_GROUP = "dashboard"

# In a router process: its event loop, where dashboard nudges are sent without waiting (a job
# thread that waited on the loop would hang the process's exit once the loop has stopped).
_router_loop: asyncio.AbstractEventLoop | None = None


def notify_on(loop: asyncio.AbstractEventLoop | None) -> None:
    global _router_loop
    _router_loop = loop


def notify_dashboard(reason: str) -> None:
    """Tell every open dashboard (in any process, through the channel layer) to refresh now."""
    from channels.layers import get_channel_layer

    layer = get_channel_layer()
    if layer is None:
        return
    message = {"type": "fleet.changed", "reason": reason}
    loop = _router_loop
    if loop is not None:  # fire and forget on the router's loop (the in-memory layer lives there)
        if not loop.is_closed():  # closed: the process is stopping, nobody is watching
            loop.call_soon_threadsafe(lambda: asyncio.ensure_future(_send(layer, message)))
        return
    try:  # a Celery worker: no loop of ours here, so wait for the send on a loop of its own
        async_to_sync(layer.group_send)(DASHBOARD_GROUP, message)
    except Exception:  # a dashboard nudge must never fail the job
        logger.debug("could not notify the dashboard", exc_info=True)


async def _send(layer, message: dict) -> None:
    try:
        await layer.group_send(DASHBOARD_GROUP, message)
    except Exception:
        logger.debug("could not notify the dashboard", exc_info=True)


def run_bench(run_id: int) -> dict:
    """Run a BenchRun's workload against its router and store the result on the row."""
    from apps.routing.benchjob import execute
    from apps.routing.models import BenchRun

    run = BenchRun.objects.get(id=run_id)
    run.status = BenchRun.Status.RUNNING
    run.save(update_fields=["status"])
    notify_dashboard("bench")
    started = time.monotonic()
    try:
        keys = configured_keys("API_KEYS")
        worker = Worker.objects.exclude(server_info={}).order_by("id").first()
        run.result = execute(
            run.base_url,
            run.params,
            api_key=keys[0] if keys else None,
            server_info=worker.server_info if worker else None,
        )
        run.status = BenchRun.Status.DONE
    except (Exception, SystemExit) as exc:  # the bench CLI exits on a bad target; a job must not
        logger.exception("bench run %s failed", run_id)
        run.status, run.error = BenchRun.Status.FAILED, f"{type(exc).__name__}: {exc}"
    run.result["wall_s"] = round(time.monotonic() - started, 3)
    run.finished_at = timezone.now()
    run.save(update_fields=["status", "result", "error", "finished_at"])
    notify_dashboard("bench")
    return {"id": run.id, "status": run.status}


# ----- without a broker: the jobs in threads of the router process --------------------------------
def embedded() -> bool:
    """True when there is no broker: tasks would run eagerly where they are sent."""
    return bool(settings.CELERY_TASK_ALWAYS_EAGER)


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
        (scrape_fleet, cp["SCRAPE_INTERVAL_S"]),
        (refresh_discovery, cp["DISCOVERY_REFRESH_INTERVAL_S"]),
        (prune, cp["PRUNE_INTERVAL_S"]),
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


def on_scraped(sender, **kwargs) -> None:
    """A scrape wrote new samples (apps/replicas/jobs.py ``fleet_scraped``): refresh the charts."""
    notify_dashboard("scraped")
