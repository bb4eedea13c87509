"""The health loop: every interval, ask each worker's /health; a worker is taken out after
``failure_threshold`` failures in a row and put back after ``success_threshold`` successes.
Workers recorded but not yet discovered are discovered here once they answer."""

from __future__ import annotations

import asyncio
import logging

import httpx
from django.utils import timezone

from apps.replicas.discovery import auth_headers
from apps.replicas.fleet import WorkerView
from apps.replicas.models import Worker
from apps.routing.proxy import upstream
from apps.routing.router import Router, get_router

logger = logging.getLogger(__name__)


async def probe(
    client: httpx.AsyncClient, view: WorkerView, timeout: float
) -> tuple[str | None, str | None]:
    """(None when healthy, else why not; the engine's instance id when its /health says it)."""
    try:
        r = await client.get(
            view.url + "/health", headers=auth_headers(view.api_key), timeout=timeout
        )
    except httpx.HTTPError as exc:
        return f"unreachable: {exc!r}", None
    if r.status_code != 200:
        return f"/health answered {r.status_code}: {r.text[:200]}", None
    try:
        body = r.json()
    except ValueError:  # any OpenAI server's /health will do: a body is optional
        return None, None
    instance = body.get("instance_id") if isinstance(body, dict) else None
    return None, instance if isinstance(instance, str) else None


async def check_worker(router: Router, view: WorkerView) -> None:
    cfg = router.config
    problem, instance = await probe(
        upstream.get(cfg), view, timeout=min(5.0, cfg.health_check_interval_s)
    )
    if problem is None and instance and view.instance_id and instance != view.instance_id:
        await rediscover(router, view)
        view = router.fleet.workers.get(view.worker_id, view)
    if problem is None:
        view.consecutive_failures, view.consecutive_successes = 0, view.consecutive_successes + 1
        if not view.healthy and view.consecutive_successes >= cfg.health_success_threshold:
            view.healthy = True
            logger.info("worker %s is healthy again", view.url)
            await _persist(view, Worker.Health.HEALTHY, "")
    else:
        view.consecutive_successes, view.consecutive_failures = 0, view.consecutive_failures + 1
        if view.healthy and view.consecutive_failures >= cfg.health_failure_threshold:
            view.healthy = False
            logger.warning("worker %s taken out: %s", view.url, problem)
            await _persist(view, Worker.Health.UNHEALTHY, problem)


async def rediscover(router: Router, view: WorkerView) -> None:
    """Another engine instance answers at the worker's URL (a restart: its prefix caches are
    empty, maybe its dp_size changed). Discover it again now; ``install`` forgets the index."""
    from apps.replicas.services import worker_add

    logger.info("worker %s answers with another instance id: rediscovering", view.url)
    try:
        await worker_add(url=view.url, api_key=view.api_key, dp_aware=view.dp_aware, router=router)
    except Exception as exc:  # not answering /server_info yet: the next round tries again
        logger.warning("rediscovering %s failed: %s", view.url, exc)


async def _persist(view: WorkerView, health: str, detail: str) -> None:
    """Record a transition: the worker's health, and a ``healthy``/``unhealthy`` WorkerEvent."""
    from apps.replicas.models import WorkerEvent

    updated = await Worker.objects.filter(id=view.worker_id).aupdate(
        health=health, health_detail=detail, last_checked_at=timezone.now()
    )
    if updated:  # not removed meanwhile
        await WorkerEvent.objects.acreate(worker_id=view.worker_id, kind=health, detail=detail)


async def discover_pending(router: Router) -> None:
    from apps.replicas.services import worker_add

    async for worker in Worker.objects.filter(server_info={}):
        try:
            await worker_add(
                url=worker.url, api_key=worker.api_key, dp_aware=worker.dp_aware, router=router
            )
        except Exception as exc:  # still not up: try again next round
            logger.debug("worker %s still not discoverable: %s", worker.url, exc)


async def health_loop(router: Router | None = None) -> None:
    router = router or get_router()
    while True:
        try:
            await discover_pending(router)
            await asyncio.gather(
                *(check_worker(router, v) for v in list(router.fleet.workers.values()))
            )
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("health round failed")
        # undiscovered workers (an engine still starting) are retried sooner than the interval
        pending = await Worker.objects.filter(server_info={}).aexists()
        await asyncio.sleep(
            min(0.5, router.config.health_check_interval_s)
            if pending
            else router.config.health_check_interval_s
        )
