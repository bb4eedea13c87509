"""Services that change who serves: register, refresh, drain and remove workers.

Each writes the database (the durable record) and then, inside a router process, tells its live
fleet through the ``FleetRuntime`` it is given (apps/replicas/runtime.py). Selectors at the
bottom read.
"""

from __future__ import annotations

import logging

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from apps.replicas.discovery import (
    OVERRIDABLE,
    ROLES,
    DiscoveryError,
    dp_size_of,
    effective_info,
    fetch_server_info,
    role_of,
)
from apps.replicas.models import Rank, Worker, WorkerEvent
from apps.replicas.pin_check import check_pins
from apps.replicas.runtime import FleetRuntime

logger = logging.getLogger(__name__)


def normalize_url(url: str) -> str:
    url = (url or "").strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"worker url must start with http:// or https://, got {url!r}")
    return url


@transaction.atomic
def save_worker(
    *, url: str, api_key: str, dp_aware: bool, info: dict | None, overrides: dict | None = None
) -> tuple[Worker, dict]:
    """Record a worker: what discovery found (``info``; None: not discovered yet) and what its
    registration overrides (None: keep the recorded overrides)."""
    worker, _ = Worker.objects.select_for_update().get_or_create(
        url=url, defaults={"api_key": api_key, "dp_aware": dp_aware}
    )
    worker.api_key, worker.dp_aware = api_key or worker.api_key, dp_aware
    if overrides is not None:
        worker.overrides = overrides
    before = (
        bool(worker.server_info),
        worker.dp_size,
        worker.model_name,
        worker.server_info.get("instance_id"),
    )
    if info is not None:
        worker.server_info = info
        worker.dp_size = dp_size_of(effective_info(info, worker.overrides))
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


async def worker_add(
    *,
    url: str,
    api_key: str = "",
    dp_aware: bool | None = None,
    strict: bool = True,
    overrides: dict | None = None,
    runtime: FleetRuntime | None = None,
) -> Worker:
    """Register (or refresh) a worker: discover it (its flavour's endpoints) and record it; the
    runtime then serves its targets. With ``strict=False`` an unreachable worker is recorded
    anyway and discovered later (the health loop). ``dp_aware`` None: the runtime's default;
    ``overrides`` (``validate_overrides``) None: keep what its registration said before."""
    url = normalize_url(url)
    if overrides is not None:
        overrides = validate_overrides(overrides)
    if dp_aware is None:
        dp_aware = runtime.dp_aware if runtime is not None else True
    try:
        info = await fetch_server_info(url, api_key)
        dp_size_of(info)
        if dp_aware and settings.CONTROL_PLANE["PIN_CHECK"]:
            if overrides is None:  # a re-registration keeps the overrides it had
                known = await Worker.objects.filter(url=url).afirst()
                registered = known.overrides if known is not None else {}
            else:
                registered = overrides
            if role_of(effective_info(info, registered)) is None:  # a PD leg is not probed
                info["pin_check"] = await check_pins(url, info, api_key)
    except DiscoveryError as exc:
        if strict:
            raise
        logger.warning("worker %s not discoverable yet: %s", url, exc)
        info = None
    worker, rank_ids = await sync_to_async(save_worker)(
        url=url, api_key=api_key, dp_aware=dp_aware, info=info, overrides=overrides
    )
    if runtime is not None:
        runtime.worker_saved(worker, rank_ids)
    logger.info(
        "worker %s: dp_size %d, %s", url, worker.dp_size, "dp-aware" if dp_aware else "one target"
    )
    return worker


def validate_overrides(overrides: dict) -> dict:
    """The registration's overrides, checked (ValueError names the bad one); None values dropped."""
    if not isinstance(overrides, dict):
        raise ValueError("overrides must be an object")
    unknown = set(overrides) - set(OVERRIDABLE)
    if unknown:
        raise ValueError(f"unknown override(s) {sorted(unknown)}; known: {list(OVERRIDABLE)}")
    out = {k: v for k, v in overrides.items() if v is not None}
    for name in ("dp_size", "block_size"):
        value = out.get(name)
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 1
        ):
            raise ValueError(f"'{name}' must be a positive integer, got {value!r}")
    if not isinstance(out.get("tokenizer_path", ""), str):
        raise ValueError("'tokenizer_path' must be a string (a directory on the router's host)")
    if out.get("role") not in (None, *ROLES):
        raise ValueError(f"'role' must be one of {list(ROLES)}, got {out.get('role')!r}")
    port = out.get("bootstrap_port")
    if port is not None and (
        not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536
    ):
        raise ValueError(f"'bootstrap_port' must be a port number, got {port!r}")
    kv_events = out.get("kv_events")
    if kv_events is not None and not (
        isinstance(kv_events, str)
        or (isinstance(kv_events, list) and all(isinstance(e, str) for e in kv_events))
    ):
        raise ValueError("'kv_events' must be an endpoint or a list of one endpoint per rank")
    return out


async def worker_remove(*, worker_id: int, runtime: FleetRuntime | None = None) -> bool:
    if runtime is not None:
        runtime.worker_removed(worker_id)
    deleted, _ = await Worker.objects.filter(id=worker_id).adelete()
    return bool(deleted)


async def worker_set_draining(
    *, worker_id: int, draining: bool, runtime: FleetRuntime | None = None
) -> None:
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
    if runtime is not None:
        runtime.worker_draining(worker_id, draining)


async def worker_set_health(*, worker_id: int, health: str, detail: str) -> None:
    """Record a health transition the router saw: the worker's health and a WorkerEvent."""
    updated = await Worker.objects.filter(id=worker_id).aupdate(
        health=health, health_detail=detail, last_checked_at=timezone.now()
    )
    if updated:  # not removed meanwhile
        await WorkerEvent.objects.acreate(worker_id=worker_id, kind=health, detail=detail)


# ----- selectors ----------------------------------------------------------------------------------
def worker_list() -> list[tuple[Worker, dict[int | None, int]]]:
    """Every worker with its Rank ids by rank (sync: one query for the workers, one for ranks)."""
    workers = Worker.objects.prefetch_related("ranks")
    return [(w, {r.rank: r.id for r in w.ranks.all()}) for w in workers]


def worker_as_dict(worker: Worker, runtime: FleetRuntime | None = None) -> dict:
    live = runtime.worker_live(worker.id) if runtime is not None else None
    return {
        "id": worker.id,
        "url": worker.url,
        "model": worker.model_name,
        "dp_size": worker.dp_size,
        "dp_aware": worker.dp_aware,
        "health": live["health"] if live else worker.health,
        "draining": worker.draining,
        "flavour": (worker.server_info or {}).get("flavour"),
        # prefill/decode disaggregation: "prefill", "decode" or None (both in one)
        "role": role_of(effective_info(worker.server_info, worker.overrides)),
        # per path, whether it serves a pinned request on that rank (apps/replicas/pin_check.py;
        # null: not known); where not, the router does not believe its placement there
        "pins": {
            path: result.get("honoured")
            for path, result in ((worker.server_info or {}).get("pin_check") or {}).items()
        },
        "server_info": worker.server_info,
        "overrides": worker.overrides,
        "sources": effective_info(worker.server_info, worker.overrides).get("sources", {}),
        "targets": live["targets"] if live else [],
        # what a first token costs in time there, as this router learned it
        # (apps/routing/decision/timing.py); None until it has seen one
        "timing": live.get("timing") if live else None,
        # this router sends it a completion's text prompt as token ids (vLLM, once its
        # /tokenize agreed: docs/routing.md, "Prompts as token ids")
        "prompt_ids": bool(live and live.get("prompt_ids")),
    }
