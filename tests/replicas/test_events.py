"""The worker's health history (WorkerEvent): discovered and changed by the registration service,
draining/undrained by the drain service, healthy/unhealthy by the health loop's transitions."""

import pytest

from apps.replicas.models import Worker, WorkerEvent
from apps.replicas.services import save_worker, worker_set_draining
from apps.routing.decision.config import RouterConfig
from apps.routing.decision.router import Router
from apps.routing.feeds.health import check_worker
from apps.routing.live import LiveFleet
from apps.routing.records import view_of
from controlplane import http
from harness.standin import StandIn

pytestmark = pytest.mark.django_db(transaction=True)

URL = "http://127.0.0.1:9"


def info(dp_size: int, model: str = "tiny") -> dict:
    return {"dp_size": dp_size, "model_id": model, "served_model_name": model}


def kinds(worker_id: int) -> list[tuple[str, str]]:
    return [
        (e.kind, e.detail)
        for e in WorkerEvent.objects.filter(worker_id=worker_id).order_by("at", "id")
    ]


def test_discovered_once_then_changed_only_when_dp_size_or_model_change():
    # recorded, not discovered yet
    worker, _ = save_worker(url=URL, api_key="", dp_aware=True, info=None)
    assert kinds(worker.id) == []
    save_worker(url=URL, api_key="", dp_aware=True, info=info(2))
    save_worker(url=URL, api_key="", dp_aware=True, info=info(2))  # a refresh that finds the same
    # dp-awareness is ours, not the engine's
    save_worker(url=URL, api_key="", dp_aware=False, info=info(2))
    save_worker(url=URL, api_key="", dp_aware=True, info=info(4))
    save_worker(url=URL, api_key="", dp_aware=True, info=info(4, "other"))
    # unreachable on refresh: nothing learned
    save_worker(url=URL, api_key="", dp_aware=True, info=None)
    assert kinds(worker.id) == [
        ("discovered", "model tiny, dp_size 2"),
        ("changed", "dp_size 2 -> 4"),
        ("changed", "model tiny -> other"),
    ]


async def test_draining_and_undrained_are_recorded_on_change_only():
    worker = await Worker.objects.acreate(url=URL)
    router = Router(RouterConfig())
    for draining in (True, True, False, False, True):
        await worker_set_draining(worker_id=worker.id, draining=draining, runtime=LiveFleet(router))
    assert [k for k, _ in await sync_kinds(worker.id)] == ["draining", "undrained", "draining"]


async def test_health_transitions_are_recorded():
    router = Router(
        RouterConfig(
            health_failure_threshold=2, health_success_threshold=1, health_check_interval_s=1.0
        )
    )
    with StandIn(dp_size=1).start() as standin:
        worker = await Worker.objects.acreate(url=standin.url, server_info=info(1), dp_size=1)
        view = view_of(worker)
        try:
            standin.healthy = False
            await check_worker(router, view)  # one failure: below the threshold
            assert view.healthy and await sync_kinds(worker.id) == []
            await check_worker(router, view)
            await check_worker(router, view)  # still down: no second event
            assert not view.healthy
            assert await sync_kinds(worker.id) == [
                ("unhealthy", '/health answered 503: {"status": "unavailable"}')
            ]
            standin.healthy = True
            await check_worker(router, view)
            assert view.healthy and [k for k, _ in await sync_kinds(worker.id)] == [
                "unhealthy",
                "healthy",
            ]
            assert (await Worker.objects.aget(id=worker.id)).health == "healthy"

            await worker.adelete()
            standin.healthy = False
            await check_worker(router, view)
            # a removed worker's transition writes nothing (and does not fail)
            await check_worker(router, view)
            assert not view.healthy and await WorkerEvent.objects.acount() == 0
        finally:
            await http.client.aclose()


async def sync_kinds(worker_id: int) -> list[tuple[str, str]]:
    from asgiref.sync import sync_to_async

    return await sync_to_async(kinds)(worker_id)
