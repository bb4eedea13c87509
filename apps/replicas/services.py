"""Services that change who serves: register, refresh, drain and remove workers.

Each writes the database (the durable record) and then the router's in-memory fleet (what the
hot path reads). Selectors at the bottom read.
"""

from __future__ import annotations

import logging

from asgiref.sync import sync_to_async
from django.db import transaction
from django.utils import timezone

from apps.replicas.discovery import DiscoveryError, dp_size_of, fetch_server_info, view_of
from apps.replicas.models import Rank, Worker, WorkerEvent
from apps.routing.proxy import upstream
from apps.routing.router import Router, get_router

logger = logging.getLogger(__name__)


def normalize_url(url: str) -> str:
    url = (url or "").strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"worker url must start with http:// or https://, got {url!r}")
    return url


@transaction.atomic
def save_worker(
    *, url: str, api_key: str, dp_aware: bool, info: dict | None
) -> tuple[Worker, dict]:
    worker, _ = Worker.objects.select_for_update().get_or_create(
        url=url, defaults={"api_key": api_key, "dp_aware": dp_aware}
    )
    worker.api_key, worker.dp_aware = api_key or worker.api_key, dp_aware
    before = (
        bool(worker.server_info),
        worker.dp_size,
        worker.model_name,
        worker.server_info.get("instance_id"),
    )
    if info is not None:
        worker.server_info = info
        worker.dp_size = dp_size_of(info)
        worker.model_id = str(info.get("model_id") or info.get("model_path") or "")
        worker.served_model_name = str(info.get("served_model_name") or worker.model_id)
        worker.health = Worker.Health.HEALTHY
        worker.health_detail = ""
        worker.last_checked_at = timezone.now()
    worker.save()
    if info is not None:
        _record_discovery(worker, *before)
    ranks = list(range(worker.dp_size)) if worker.dp_aware else [None]
    for row in worker.ranks.all():
        if row.rank not in ranks:  # dp_size shrank, or dp-awareness changed
            row.delete()
    rank_ids = {}
    for rank in ranks:
        row, _ = Rank.objects.get_or_create(worker=worker, rank=rank)
        rank_ids[rank] = row.id
    return worker, rank_ids


def _record_discovery(
    worker: Worker, was_discovered: bool, dp_size: int, model: str, instance: str | None
) -> None:
    """A ``discovered`` event the first time /server_info is read, ``restarted`` when the engine's
    instance id changed, ``changed`` when a refresh finds another dp_size or model."""
    if not was_discovered:
        WorkerEvent.objects.create(
            worker=worker,
            kind=WorkerEvent.Kind.DISCOVERED,
            detail=f"model {worker.model_name}, dp_size {worker.dp_size}",
        )
        return
    if instance and worker.server_info.get("instance_id") not in (None, instance):
        WorkerEvent.objects.create(
            worker=worker,
            kind=WorkerEvent.Kind.RESTARTED,
            detail="the engine restarted: its prefix caches start empty",
        )
    changes = [
        f"{what} {old} -> {new}"
        for what, old, new in (
            ("dp_size", dp_size, worker.dp_size),
            ("model", model, worker.model_name),
        )
        if old != new
    ]
    if changes:
        WorkerEvent.objects.create(
            worker=worker, kind=WorkerEvent.Kind.CHANGED, detail="; ".join(changes)
        )


def install(router: Router, worker: Worker, rank_ids: dict) -> None:
    """Put a discovered worker's targets into the router."""
    if not worker.server_info:
        return  # not discovered yet: the health loop keeps trying
    old = router.fleet.workers.get(worker.id)
    before = {t.key for t in router.fleet.targets.get(worker.id, [])}
    view = view_of(worker, router.config.tokenizer_path)
    # a restarted engine has empty prefix caches: what the index believes about it is wrong now
    restarted = (
        old is not None and old.instance_id is not None and view.instance_id != old.instance_id
    )
    targets = router.fleet.put(view, rank_ids)
    stale = (
        before if restarted else before - {t.key for t in targets}
    )  # emptied, or gone (dp_size changed)
    for key in stale:
        router.index.remove_rank(key)
    if restarted:
        logger.info("worker %s restarted: forgetting what its ranks had cached", worker.url)
    for target in targets:
        router.index.set_capacity(target.key, target.worker.capacity_blocks)


async def worker_add(
    *,
    url: str,
    api_key: str = "",
    dp_aware: bool | None = None,
    strict: bool = True,
    router: Router | None = None,
) -> Worker:
    """Register (or refresh) a worker: discover it through /server_info and add its targets.
    With ``strict=False`` an unreachable worker is recorded anyway and discovered later."""
    router = router or get_router()
    url = normalize_url(url)
    dp_aware = router.config.dp_aware if dp_aware is None else dp_aware
    try:
        info = await fetch_server_info(upstream.get(router.config), url, api_key)
        dp_size_of(info)
    except DiscoveryError as exc:
        if strict:
            raise
        logger.warning("worker %s not discoverable yet: %s", url, exc)
        info = None
    worker, rank_ids = await sync_to_async(save_worker)(
        url=url, api_key=api_key, dp_aware=dp_aware, info=info
    )
    install(router, worker, rank_ids)
    logger.info(
        "worker %s: dp_size %d, %s", url, worker.dp_size, "dp-aware" if dp_aware else "one target"
    )
    return worker


async def worker_remove(*, worker_id: int, router: Router | None = None) -> bool:
    router = router or get_router()
    for target in router.fleet.targets.get(worker_id, []):
        router.index.remove_rank(target.key)
    router.fleet.remove(worker_id)
    deleted, _ = await Worker.objects.filter(id=worker_id).adelete()
    return bool(deleted)


async def worker_set_draining(
    *, worker_id: int, draining: bool, router: Router | None = None
) -> None:
    router = router or get_router()
    changed = (
        await Worker.objects.filter(id=worker_id)
        .exclude(draining=draining)
        .aupdate(draining=draining)
    )
    if changed:
        await WorkerEvent.objects.acreate(
            worker_id=worker_id,
            kind=WorkerEvent.Kind.DRAINING if draining else WorkerEvent.Kind.UNDRAINED,
        )
    view = router.fleet.workers.get(worker_id)
    if view is not None:
        view.draining = draining


async def fleet_restore(*, router: Router | None = None) -> int:
    """Load every worker recorded in the database into the router (after a restart)."""
    router = router or get_router()
    count = 0
    async for worker in Worker.objects.all():
        rank_ids = {r.rank: r.id async for r in worker.ranks.all()}
        install(router, worker, rank_ids)
        count += 1
    return count


# ----- selectors ----------------------------------------------------------------------------------
def worker_as_dict(worker: Worker, router: Router | None = None) -> dict:
    router = router or get_router()
    view = router.fleet.workers.get(worker.id)
    targets = router.fleet.targets.get(worker.id, [])
    return {
        "id": worker.id,
        "url": worker.url,
        "model": worker.model_name,
        "dp_size": worker.dp_size,
        "dp_aware": worker.dp_aware,
        "health": ("healthy" if view.healthy else "unhealthy") if view else worker.health,
        "draining": worker.draining,
        "server_info": worker.server_info,
        "targets": [
            {
                "key": t.key,
                "rank": t.rank,
                "circuit": t.breaker.state,
                "inflight_requests": t.load.requests,
                "inflight_prompt_tokens": t.load.prompt_tokens,
            }
            for t in targets
        ],
    }
