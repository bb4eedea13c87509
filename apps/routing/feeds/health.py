"""The health loop: every interval, ask each worker's /health; a worker is taken out after
``failure_threshold`` failures in a row and put back after ``success_threshold`` successes.
Workers recorded but not yet discovered are discovered here once they answer.

A refused connection does not wait for the loop: the proxy takes the whole worker out at once
(``mark_unreachable``), and the loop then probes it every ``FAST_INTERVAL_S`` until it is back
(``came_back``: discovered again, its index emptied when it cannot tell whether it restarted).
Workers restored from the database are probed before the fleet serves (``probe_all``)."""

from __future__ import annotations

import asyncio
import logging

from apps.replicas.models import Worker
from apps.replicas.services import worker_add, worker_set_health
from apps.routing.decision.fleet import WorkerView
from apps.routing.decision.router import Router
from apps.routing.live import LiveFleet
from controlplane import http

logger = logging.getLogger(__name__)

FAST_INTERVAL_S = 0.5


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
        view = await rediscover(router, view)
    if problem is None:
        view.consecutive_failures, view.consecutive_successes = 0, view.consecutive_successes + 1
        if not view.healthy and view.consecutive_successes >= cfg.health_success_threshold:
            if view.lost:
                view = await came_back(router, view)
            view.healthy, view.lost = True, False
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


async def rediscover(router: Router, view: WorkerView) -> WorkerView:
    """Another engine instance answers at the worker's URL (a restart: its prefix caches are
    empty, maybe its dp_size changed). Discover it again now; ``Router.install_worker`` forgets
    the index. Returns the worker's view now (a new one when the row was reinstalled)."""
    logger.info("worker %s answers with another instance id: rediscovering", view.url)
    await _discover_again(router, view)
    return _current(router, view)


async def came_back(router: Router, view: WorkerView) -> WorkerView:
    """A worker that refused connections answers again. It may be a new process (vLLM's /health
    carries no instance id to tell): discover it again (its DP size may differ now) and forget
    what the index believed its ranks held. An engine that names its instance was rediscovered
    already if it changed, and keeps its index if not."""
    if view.instance_id is None:
        await _discover_again(router, view)
        view = _current(router, view)
        router.forget_cache(view.worker_id)
        logger.info("worker %s is back: its ranks' index starts empty", view.url)
    return view


async def _discover_again(router: Router, view: WorkerView) -> None:
    try:
        await worker_add(
            url=view.url, api_key=view.api_key, dp_aware=view.dp_aware, runtime=LiveFleet(router)
        )
    except Exception as exc:  # not answering /server_info yet: the next round tries again
        logger.warning("rediscovering %s failed: %s", view.url, exc)


def _current(router: Router, view: WorkerView) -> WorkerView:
    new = router.fleet.workers.get(view.worker_id, view)
    if new is not view:
        new.keep_live_state(view)
    return new


def mark_unreachable(router: Router, view: WorkerView, problem: str) -> None:
    """A connection to the worker was refused (its process is gone, or its host): every rank
    of it shares that endpoint, so the whole worker is out at once, not after the health loop's
    threshold, and a retry goes to another worker. The health loop probes it at the fast pace
    until it answers again (``came_back``)."""
    view.consecutive_successes = 0
    view.consecutive_failures = max(
        view.consecutive_failures, router.config.health_failure_threshold
    )
    if not view.healthy:
        return
    view.healthy, view.lost = False, True
    logger.warning("worker %s taken out at once: %s", view.url, problem)
    _in_background(
        worker_set_health(worker_id=view.worker_id, health=Worker.Health.UNHEALTHY, detail=problem)
    )


async def confirm_reachable(router: Router, view: WorkerView) -> bool:
    """A connection to the worker was reset before it answered: one quick probe tells a dead
    process (refused now: taken out, like ``mark_unreachable``) from a dropped connection."""
    problem, _ = await probe(view, timeout=1.0)
    if problem is not None and problem.startswith("unreachable"):
        mark_unreachable(router, view, problem)
        return False
    return True


async def probe_all(router: Router) -> None:
    """Probe every worker once, now (at start, before the fleet takes traffic): workers restored
    from the database may be long gone; those that do not answer are out until they do."""
    views = list(router.fleet.workers.values())
    found = await asyncio.gather(*(probe(v, timeout=2.0) for v in views))
    for view, (problem, _) in zip(views, found, strict=True):
        if problem is not None:
            mark_unreachable(router, view, problem)


_background: set[asyncio.Task] = set()  # the loop keeps only weak references to tasks


def _in_background(coro) -> None:
    task = asyncio.ensure_future(coro)
    _background.add(task)
    task.add_done_callback(_background.discard)


async def discover_pending(router: Router) -> None:
    async for worker in Worker.objects.filter(server_info={}):
        try:
            await worker_add(
                url=worker.url,
                api_key=worker.api_key,
                dp_aware=worker.dp_aware,
                runtime=LiveFleet(router),
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
        # undiscovered workers (an engine still starting) and lost ones (refused connections:
        # restarting?) are probed sooner than the interval, to be taken back soon
        soon = any(v.lost for v in router.fleet.workers.values())
        soon = soon or await Worker.objects.filter(server_info={}).aexists()
        interval = router.config.health_check_interval_s
        await asyncio.sleep(min(FAST_INTERVAL_S, interval) if soon else interval)
