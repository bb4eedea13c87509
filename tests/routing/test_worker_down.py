"""A worker whose process is gone: one refused connection takes the whole worker out (all its
ranks share the endpoint), so a request's retry goes to another worker instead of trying the dead
worker's other ranks; when it answers again it is discovered anew and its index starts empty (an
engine without an instance id, like vLLM, cannot say it restarted). Workers restored from the
database are probed before the fleet serves them.

In process (the router's ASGI app over httpx), with stand-in engines (harness/standin.py)
whose port is closed and reopened: the real-engine and real-vLLM versions of the kill are in
tests/routing/test_router_failures.py and tests/vllm/."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from apps.replicas.models import Worker
from apps.replicas.services import worker_add
from apps.routing.decision.config import RouterConfig
from apps.routing.decision.router import Router
from apps.routing.feeds.health import check_worker, discover_pending
from apps.routing.live import LiveFleet
from apps.routing.process import RouterProcess
from controlplane import http
from controlplane.asgi import build_application
from harness.standin import Behaviour, StandIn

pytestmark = pytest.mark.django_db(transaction=True)

BODY = {"model": "standin", "prompt": "the worker is gone", "max_tokens": 2}


@pytest.fixture
async def router():
    router = Router(
        RouterConfig(
            dp_aware=True, policy="round_robin", health_success_threshold=1, retry_backoff_s=0.0
        )
    )
    yield router
    await http.client.aclose()


@pytest.fixture
async def client(router):
    transport = httpx.ASGITransport(app=build_application(router))
    async with httpx.AsyncClient(transport=transport, base_url="http://localhost", timeout=30) as c:
        yield c


@pytest.fixture
def standins():
    made: list[StandIn] = []

    def make(dp_size: int, port: int = 0) -> StandIn:
        made.append(StandIn(dp_size=dp_size).start(port))
        return made[-1]

    yield make
    for s in made:
        s.stop()


async def recorded_health(worker_id: int, want: str) -> str:
    for _ in range(100):  # the proxy writes it in the background
        health = (await Worker.objects.aget(id=worker_id)).health
        if health == want:
            break
        await asyncio.sleep(0.05)
    return health


async def test_a_refused_connection_takes_the_whole_worker_out_at_once(router, client, standins):
    dead, alive = standins(4), standins(2)
    gone = await worker_add(url=dead.url, runtime=LiveFleet(router))
    await worker_add(url=alive.url, runtime=LiveFleet(router))
    dead_keys = [t.key for t in router.fleet.targets[gone.id]]
    for key in dead_keys:  # what the index believed the dead engine held
        router.index.insert(key, [1, 2, 3])
    port = dead.port
    dead.stop()

    answers = [await client.post("/v1/completions", json=BODY) for _ in range(8)]
    assert [r.status_code for r in answers] == [200] * 8, [r.text for r in answers]
    assert all(r.headers["x-routed-target"].startswith(alive.url) for r in answers)
    # round robin put the first request on one of the dead worker's ranks; its one refusal took
    # all four out: one retry in all, not one per dead rank
    assert router.stats.retries == 1
    view = router.fleet.workers[gone.id]
    assert not view.healthy and view.lost
    assert await recorded_health(gone.id, "unhealthy") == "unhealthy"
    workers = (await client.get("/workers")).json()["workers"]
    assert next(w["health"] for w in workers if w["id"] == gone.id) == "unhealthy"

    # a round of the health loop while it is still down changes nothing
    await check_worker(router, view)
    assert not router.fleet.workers[gone.id].healthy

    standins(4, port)  # back on the same port: maybe another process, with empty caches
    await check_worker(router, router.fleet.workers[gone.id])
    back = router.fleet.workers[gone.id]
    assert back.healthy and not back.lost
    assert all(router.index.size(key) == 0 for key in dead_keys)
    assert await recorded_health(gone.id, "healthy") == "healthy"
    targets = {
        (await client.post("/v1/completions", json=BODY)).headers["x-routed-target"]
        for _ in range(6)
    }
    assert set(dead_keys) <= targets  # round robin over all six ranks again


async def test_a_reset_connection_is_confirmed_by_a_probe_before_the_worker_is_taken_out(
    router, client, standins
):
    flaky = standins(2)
    await worker_add(url=flaky.url, runtime=LiveFleet(router))
    # the engine lives but drops this one connection before answering
    flaky.script.append(Behaviour(reset=True))
    r = await client.post("/v1/completions", json=BODY)
    assert r.status_code == 200, r.text
    assert router.stats.retries == 1  # retried: the first answer never came
    view = next(iter(router.fleet.workers.values()))
    assert view.healthy and not view.lost  # the probe answered: one dropped socket is no death


async def test_restored_workers_are_probed_before_the_fleet_serves(router, client, standins):
    alive = standins(2)
    # a worker an earlier run registered, recorded healthy, whose engine is long gone
    gone = await Worker.objects.acreate(
        url="http://127.0.0.1:9",
        health=Worker.Health.HEALTHY,
        dp_size=2,
        server_info={"dp_size": 2, "model_id": "standin", "served_model_name": "standin"},
    )
    process = RouterProcess(router, [alive.url])
    tasks = await process.start()
    try:
        assert not router.fleet.workers[gone.id].healthy
        answers = [await client.post("/v1/completions", json=BODY) for _ in range(4)]
        assert [r.status_code for r in answers] == [200] * 4
        assert router.stats.retries == 0  # nothing was sent to the gone worker
        workers = (await client.get("/workers")).json()["workers"]
        assert next(w["health"] for w in workers if w["id"] == gone.id) == "unhealthy"
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await process.stop()


async def test_a_worker_recorded_before_it_was_up_is_discovered_by_the_health_loop(
    router, standins
):
    """``serve`` names its engine before the engine answers: the health loop discovers it and
    installs its ranks in this process's fleet itself, without waiting for a database sync."""
    engine = standins(2)
    worker = await Worker.objects.acreate(url=engine.url, dp_size=1, dp_aware=True)
    assert router.fleet.workers == {}
    await discover_pending(router)
    assert [t.key for t in router.fleet.targets[worker.id]] == [
        f"{engine.url}@0",
        f"{engine.url}@1",
    ]
