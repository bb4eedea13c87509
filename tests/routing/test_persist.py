"""Routing counters in the database: several router processes sharing it add up (each writes
its increments, never an absolute value), a restarted one starts from the rows, and the
dashboard shows the rows plus what this process has not written yet."""

from __future__ import annotations

import pytest

from apps.replicas.models import Rank, Worker
from apps.routing.decision.config import RouterConfig
from apps.routing.decision.router import Router
from apps.routing.feeds.persist import persist_stats, restore_stats
from apps.routing.live import LiveFleet
from apps.routing.selectors import build_snapshot

pytestmark = pytest.mark.django_db(transaction=True)
URL = "http://127.0.0.1:9"


def make_router() -> Router:
    router = Router(RouterConfig())
    worker = Worker.objects.get(url=URL)
    LiveFleet(router).worker_saved(worker, {r.rank: r.id for r in worker.ranks.all()})
    return router


@pytest.fixture
def worker():
    worker = Worker.objects.create(url=URL, dp_size=1, server_info={"dp_size": 1})
    Rank.objects.create(worker=worker, rank=0)
    return worker


def row():
    r = Rank.objects.get(worker__url=URL, rank=0)
    return r.requests, r.prompt_tokens, r.predicted_tokens, r.errors


async def test_two_processes_add_up_and_a_restart_resumes(worker):
    from asgiref.sync import sync_to_async

    key = f"{URL}@0"
    a, b = await sync_to_async(make_router)(), await sync_to_async(make_router)()
    await restore_stats(a)
    await restore_stats(b)
    a.stats.dispatched(key, 100, 60)
    a.stats.dispatched(key, 100, 0)
    b.stats.dispatched(key, 50, 48)
    b.stats.finished(key, ok=False, cached_tokens=None)
    await persist_stats(a)
    await persist_stats(b)
    await persist_stats(a)  # nothing new: nothing added twice
    assert await sync_to_async(row)() == (3, 250, 108, 1)
    assert a.stats.unwritten(key) == dict.fromkeys(a.stats.unwritten(key), 0)

    a.stats.dispatched(key, 10, 0)  # not written yet: the dashboard still counts it
    snap = await sync_to_async(build_snapshot)(a)
    assert (
        snap["workers"][0]["ranks"][0]["requests"],
        snap["workers"][0]["ranks"][0]["prompt_tokens"],
    ) == (4, 260)

    restarted = await sync_to_async(make_router)()
    await restore_stats(restarted)
    assert restarted.stats.targets[key].requests == 3  # from the rows
    restarted.stats.dispatched(key, 1, 0)
    await persist_stats(restarted)
    await persist_stats(a)
    assert await sync_to_async(row)() == (5, 261, 108, 1)


async def test_an_idle_process_writes_nothing_and_a_change_is_written(worker):
    from asgiref.sync import sync_to_async

    key = f"{URL}@0"
    router = await sync_to_async(make_router)()
    await restore_stats(router)
    await persist_stats(router)  # its circuit, written once

    def mark(state):  # another process writes the row meanwhile
        Rank.objects.filter(worker__url=URL, rank=0).update(circuit_state=state)

    def circuit():
        return Rank.objects.get(worker__url=URL, rank=0).circuit_state

    await sync_to_async(mark)("elsewhere")
    await persist_stats(router)  # nothing counted, the circuit as written: no write
    assert await sync_to_async(circuit)() == "elsewhere"
    router.stats.dispatched(key, 10, 0)
    await persist_stats(router)
    assert await sync_to_async(circuit)() == "closed"
    assert await sync_to_async(row)() == (1, 10, 0, 0)
