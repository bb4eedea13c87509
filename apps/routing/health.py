"""The health loop: every interval, ask each worker's /health; a worker is taken out after
``failure_threshold`` failures in a row and put back after ``success_threshold`` successes.
Workers recorded but not yet discovered are discovered here once they answer."""

from __future__ import annotations

import asyncio
import logging

from apps.replicas.models import Worker
from apps.replicas.services import worker_add, worker_set_health
from apps.routing.fleet import WorkerView
from apps.routing.router import Router
from controlplane import http

logger = logging.getLogger(__name__)


async def probe(view: WorkerView, timeout: float) -> tuple[str | None, str | None]:
    """(None when healthy, else why not; the engine's instance id when its /health says it)."""
    try:
        status, body, text = await http.get_json(
            view.url + "/health", api_key=view.api_key, timeout_s=timeout
        )
    except http.ERRORS as exc:
        return f"unreachable: {exc!r}", None
    if status != 200:
        return f"/health answered {status}: {text[:200]}", None
    # any OpenAI server's /health will do: a body is optional
    instance = body.get("instance_id") if isinstance(body, dict) else None
    return None, instance if isinstance(instance, str) else None


async def check_worker(router: Router, view: WorkerView) -> None:
    cfg = router.config
    problem, instance = await probe(view, timeout=min(5.0, cfg.health_check_interval_s))
    if problem is None and instance and view.instance_id and instance != view.instance_id:
        await rediscover(router, view)
        view = router.fleet.workers.get(view.worker_id, view)
    if problem is None:
        view.consecutive_failures, view.consecutive_successes = 0, view.consecutive_successes + 1
        if not view.healthy and view.consecutive_successes >= cfg.health_success_threshold:
            view.healthy = True
            logger.info("worker %s is healthy again", view.url)
            await worker_set_health(
                worker_id=view.worker_id, health=Worker.Health.HEALTHY, detail=""
            )
    else:
        view.consecutive_successes, view.consecutive_failures = 0, view.consecutive_failures + 1
        if view.healthy and view.consecutive_failures >= cfg.health_failure_threshold:
            view.healthy = False
            logger.warning("worker %s taken out: %s", view.url, problem)
            await worker_set_health(
                worker_id=view.worker_id, health=Worker.Health.UNHEALTHY, detail=problem
            )


async def rediscover(router: Router, view: WorkerView) -> None:
    """Another engine instance answers at the worker's URL (a restart: its prefix caches are
    empty, maybe its dp_size changed). Discover it again now; ``Router.worker_saved`` forgets
    the index."""
    logger.info("worker %s answers with another instance id: rediscovering", view.url)
    try:
        await worker_add(url=view.url, api_key=view.api_key, dp_aware=view.dp_aware, runtime=router)
    except Exception as exc:  # not answering /server_info yet: the next round tries again
        logger.warning("rediscovering %s failed: %s", view.url, exc)


async def discover_pending(router: Router) -> None:
    async for worker in Worker.objects.filter(server_info={}):
        try:
            await worker_add(
                url=worker.url, api_key=worker.api_key, dp_aware=worker.dp_aware, runtime=router
            )
        except Exception as exc:  # still not up: try again next round
            logger.debug("worker %s still not discoverable: %s", worker.url, exc)


async def health_loop(router: Router) -> None:
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
