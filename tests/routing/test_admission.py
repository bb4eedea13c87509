"""Admission control (apps/routing/proxy/admission.py): the concurrency limit, the queue (priority,
then arrival), its size and timeout, the fleet-saturation rule, and slots released exactly once.

First the ``Admission`` class alone on an event loop, then the router's ASGI app in process
(httpx over ``build_application(router)``) in front of a stand-in engine that holds requests."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from asgiref.sync import sync_to_async
from asgiref.testing import ApplicationCommunicator

from apps.replicas.services import worker_add
from apps.routing.decision.config import RouterConfig
from apps.routing.decision.fleet import Fleet, WorkerView
from apps.routing.decision.router import Router
from apps.routing.live import LiveFleet
from apps.routing.proxy.admission import Admission, Rejected, make_admission
from apps.routing.proxy.saturation import fleet_saturated
from apps.routing.selectors import build_snapshot
from controlplane import http
from controlplane.asgi import build_application
from harness.standin import Behaviour, StandIn
from tests.support.router_checks import sse_events


async def settle(turns: int = 5) -> None:
    """Let the loop run the admission's scheduled turns."""
    for _ in range(turns):
        await asyncio.sleep(0)


def waiting_task(admission: Admission, granted: list, name: str, priority: int = 0):
    async def wait():
        slot = await admission.acquire(priority)
        granted.append(name)
        return slot

    return asyncio.ensure_future(wait())


# ----- the Admission class ------------------------------------------------------------------------
async def test_the_limit_admits_that_many_and_the_next_one_when_a_slot_is_released():
    admission = Admission(max_concurrent=2, queue_size=4, queue_timeout_s=5)
    first, second = await admission.acquire(), await admission.acquire()
    granted: list = []
    third = waiting_task(admission, granted, "third")
    await settle()
    assert (admission.in_flight, admission.waiting, granted) == (2, 1, [])
    first.release()
    first.release()  # idempotent: one slot back, not two
    await settle()
    assert (admission.in_flight, admission.waiting, granted) == (2, 0, ["third"])
    second.release()
    (await third).release()
    assert (admission.in_flight, admission.waiting) == (0, 0)
    admission.check_integrity()


async def test_waiters_are_served_by_priority_lower_first_then_in_arrival_order():
    admission = Admission(max_concurrent=1, queue_size=8, queue_timeout_s=5)
    holder = await admission.acquire()
    granted: list = []
    tasks = [
        waiting_task(admission, granted, name, priority)
        for name, priority in [("a5", 5), ("b0", 0), ("c-1", -1), ("d0", 0), ("e0", 0), ("f5", 5)]
    ]
    await settle()
    assert admission.waiting == 6
    slot = holder
    for _ in tasks:
        slot.release()
        await settle()
        slot = next(t.result() for t in tasks if t.done() and not t.result().released)
    slot.release()
    assert granted == ["c-1", "b0", "d0", "e0", "a5", "f5"]
    assert (admission.in_flight, admission.waiting) == (0, 0)
    admission.check_integrity()


async def test_tenants_share_the_queue_fairly_within_a_priority():
    """A tenant that floods the queue waits behind another tenant's first request: at the same
    priority the waiter whose tenant has the fewest requests admitted goes next; priority first."""
    admission = Admission(max_concurrent=1, queue_size=20, queue_timeout_s=5)
    running = await admission.acquire(tenant="flood")
    granted: list = []

    def wait(name, tenant, priority=0):
        async def go():
            slot = await admission.acquire(priority, tenant)
            granted.append(name)
            return slot

        return asyncio.ensure_future(go())

    tasks = [wait(f"flood{i}", "flood") for i in range(3)] + [wait("quiet", "quiet")]
    tasks.append(wait("urgent", "flood", priority=-1))
    await settle()
    running.release()
    for _ in range(len(tasks)):
        await settle()
        slot = next(t for t in tasks if t.done() and not t.result().released).result()
        slot.release()
    # urgent first (priority), then quiet (no request of its tenant admitted), then the flood
    assert granted == ["urgent", "quiet", "flood0", "flood1", "flood2"]
    assert admission.admitted_by_tenant == {} and admission.in_flight == 0
    admission.check_integrity()


async def test_a_full_queue_rejects_at_once_with_429_in_openais_rate_limit_shape():
    admission = Admission(max_concurrent=1, queue_size=1, queue_timeout_s=7)
    holder = await admission.acquire()
    queued = waiting_task(admission, [], "queued")
    await settle()
    with pytest.raises(Rejected) as caught:
        await admission.acquire()
    rejected = caught.value
    assert (rejected.reason, rejected.status) == ("queue_full", 429)
    # nothing ended yet, so there is no pace to estimate from: the queue timeout
    assert rejected.headers() == [(b"retry-after", b"7")]
    error = json.loads(rejected.body())["error"]
    assert (error["type"], error["code"]) == ("requests", "rate_limit_exceeded")
    assert error["param"] is None and "capacity" in error["message"]
    assert admission.rejected["queue_full"] == 1
    holder.release()
    (await queued).release()
    admission.check_integrity()


async def test_retry_after_is_the_queue_ahead_at_the_slots_recent_pace():
    now = [0.0]
    admission = Admission(max_concurrent=1, queue_size=2, queue_timeout_s=60, clock=lambda: now[0])
    slot = await admission.acquire()
    now[0] = 2.0
    slot.release()  # held 2 s
    holder = await admission.acquire()
    waiters = [waiting_task(admission, [], str(i)) for i in range(2)]
    await settle()
    with pytest.raises(Rejected) as caught:
        await admission.acquire()
    assert caught.value.retry_after_s == 6  # (2 waiting + this one) x 2 s / 1 slot
    for task in waiters:
        task.cancel()
    holder.release()
    await asyncio.gather(*waiters, return_exceptions=True)
    admission.check_integrity()


async def test_a_wait_past_the_timeout_is_rejected_and_leaves_the_queue():
    admission = Admission(max_concurrent=1, queue_size=4, queue_timeout_s=0.1)
    holder = await admission.acquire()
    started = time.monotonic()
    with pytest.raises(Rejected) as caught:
        await admission.acquire()
    assert 0.09 <= time.monotonic() - started < 1.0
    assert (caught.value.reason, caught.value.status) == ("timeout", 429)
    assert (admission.waiting, len(admission._heap), admission.rejected["timeout"]) == (0, 0, 1)
    holder.release()
    assert admission.in_flight == 0
    admission.check_integrity()


async def test_a_waiter_is_refused_when_its_first_token_could_not_come_within_the_timeout():
    """The timeout bounds an admitted request's TTFT: the wait plus the engines' recent time to a
    first token (the longest of the last ones, at most half the timeout) must fit in it."""
    admission = Admission(max_concurrent=1, queue_size=4, queue_timeout_s=0.6)
    assert admission.expected_first_token_s() == 0.0
    admission.first_token("w#0", 0.1)
    admission.first_token("w#0", 0.25)
    admission.first_token("w#0", 0.2)
    assert admission.expected_first_token_s() == 0.25
    holder = await admission.acquire()
    started = time.monotonic()
    with pytest.raises(Rejected) as caught:
        await admission.acquire()
    waited = time.monotonic() - started
    assert 0.3 <= waited < 0.5, waited  # 0.6 - 0.25, not the whole 0.6
    assert caught.value.reason == "timeout" and "0.25 s" in str(caught.value)
    admission.first_token("w#0", 9.0)
    assert admission.expected_first_token_s() == 0.3  # a spike counts for half the timeout at most
    holder.release()
    admission.check_integrity()


async def test_a_waiter_whose_deadline_passed_while_it_waited_is_refused_not_admitted():
    admission = Admission(max_concurrent=1, queue_size=4, queue_timeout_s=1.0)
    holder = await admission.acquire()
    late = asyncio.ensure_future(admission.acquire())  # armed for 1 s: nothing known yet
    await asyncio.sleep(0.05)
    admission.first_token("w#0", 0.5)  # now it may start until 0.5 s after its arrival
    await asyncio.sleep(0.55)
    holder.release()  # the slot frees after that: the waiter is refused, not granted
    with pytest.raises(Rejected) as caught:
        await late
    assert caught.value.reason == "timeout"
    assert (admission.in_flight, admission.waiting, admission.rejected["timeout"]) == (0, 0, 1)
    admission.check_integrity()


async def test_a_waiter_cancelled_in_the_queue_leaves_nothing_behind():
    admission = Admission(max_concurrent=1, queue_size=4, queue_timeout_s=5)
    holder = await admission.acquire()
    granted: list = []
    gone = waiting_task(admission, granted, "gone")
    stays = waiting_task(admission, granted, "stays")
    await settle()
    gone.cancel()  # its client disconnected
    await settle()
    assert gone.cancelled() and admission.waiting == 1
    admission.check_integrity()
    holder.release()
    await settle()
    assert granted == ["stays"]  # the cancelled one was skipped, not granted
    (await stays).release()
    assert (admission.in_flight, admission.waiting, len(admission._heap)) == (0, 0, 0)
    admission.check_integrity()


async def test_a_slot_granted_in_the_same_instant_as_a_cancel_is_released():
    admission = Admission(max_concurrent=1, queue_size=4, queue_timeout_s=5)
    holder = await admission.acquire()
    waiter = waiting_task(admission, [], "waiter")
    await settle()
    holder.release()  # the waiter's grant is scheduled on the loop's next turn
    await asyncio.sleep(0)
    # granted (the slot is counted) but the waiting task has not run yet: now its client leaves
    assert (admission.in_flight, admission.waiting, waiter.done()) == (1, 0, False)
    waiter.cancel()
    await settle()
    assert waiter.cancelled()
    assert (admission.in_flight, admission.waiting) == (0, 0)
    admission.check_integrity()


async def test_draining_rejects_the_waiting_and_the_new_with_503_and_keeps_the_admitted():
    admission = Admission(max_concurrent=1, queue_size=4, queue_timeout_s=5)
    holder = await admission.acquire()
    queued = waiting_task(admission, [], "queued")
    await settle()
    admission.drain()
    with pytest.raises(Rejected) as caught:
        await queued
    assert (caught.value.reason, caught.value.status) == ("draining", 503)
    assert json.loads(caught.value.body())["error"]["type"] == "server_error"
    with pytest.raises(Rejected):
        await admission.acquire()
    assert admission.rejected["draining"] == 2 and admission.in_flight == 1
    holder.release()
    assert admission.in_flight == 0
    admission.check_integrity()


def two_ranks() -> Fleet:
    fleet = Fleet()
    view = WorkerView(
        worker_id=1,
        url="http://w",
        api_key="",
        model="m",
        model_aliases={"m"},
        dp_size=2,
        dp_aware=True,
        block_size=None,
        tokenizer_path=None,
        capacity_blocks=None,
    )
    fleet.put(view)
    return fleet


def test_the_fleet_is_saturated_only_when_every_available_target_is():
    fleet = two_ranks()
    a, b = fleet.all_targets()
    assert not fleet_saturated(fleet, 100, 0.0)
    a.load.begin(500, 300)
    assert not fleet_saturated(fleet, 100, 0.0)  # b is still below
    ticket = b.load.begin(500, 100)
    assert fleet_saturated(fleet, 100, 0.0)  # at or above
    assert not fleet_saturated(fleet, 0, 0.0)  # the rule is off
    b.load.first_token(ticket)
    assert not fleet_saturated(fleet, 100, 0.0)
    # KV usage: a target whose usage is unknown is never saturated by it
    assert not fleet_saturated(fleet, 0, 0.9)
    a.kv_usage, b.kv_usage = 0.95, 0.5
    assert not fleet_saturated(fleet, 0, 0.9)
    b.kv_usage = 0.9
    assert fleet_saturated(fleet, 0, 0.9)
    b.worker.healthy = False  # no target available at all: routing answers, nobody waits
    assert not fleet_saturated(fleet, 0, 0.9)


async def test_saturation_holds_new_requests_until_queued_prefill_drops():
    fleet = two_ranks()
    a, b = fleet.all_targets()
    admission = Admission(
        queue_size=4, queue_timeout_s=5, saturated=lambda: fleet_saturated(fleet, 100, 0.0)
    )
    tickets = [a.load.begin(200, 200), b.load.begin(200, 200)]
    granted: list = []
    waiter = waiting_task(admission, granted, "waiter")
    await asyncio.sleep(0.2)  # several polls: still saturated
    assert (granted, admission.waiting) == ([], 1)
    b.load.first_token(tickets[1])  # b's prefill is done: it can take more
    admission.prefilled(b.key, [])  # the dispatch tells its observers
    await settle()
    assert granted == ["waiter"]
    (await waiter).release()
    # polling alone wakes it too (another router process's load fell: nobody tells this one)
    b.load.begin(200, 200)
    again = waiting_task(admission, granted, "again")
    await settle()
    assert admission.waiting == 1
    a.load.first_token(tickets[0])
    await asyncio.sleep(0.2)
    assert granted == ["waiter", "again"]
    (await again).release()
    assert admission.in_flight == 0
    admission.check_integrity()


# ----- the router's endpoint, in process ---------------------------------------------------------
BODY = {"model": "standin", "prompt": "admit me", "max_tokens": 2}


@pytest.fixture
def standin():
    made = []

    def make(dp_size: int = 2, behaviour: Behaviour | None = None) -> StandIn:
        made.append(StandIn(dp_size=dp_size, default=behaviour).start())
        return made[-1]

    yield make
    for s in made:
        s.stop()


async def serving(standin_url: str, **config) -> tuple[Router, httpx.AsyncClient, Admission]:
    router = Router(RouterConfig(dp_aware=True, policy="round_robin", **config))
    await worker_add(url=standin_url, runtime=LiveFleet(router))
    admission = make_admission(router)
    transport = httpx.ASGITransport(app=build_application(router, admission))
    client = httpx.AsyncClient(transport=transport, base_url="http://localhost", timeout=30)
    return router, client, admission


async def watch(admission: Admission, peaks: dict, stop: asyncio.Event) -> None:
    while not stop.is_set():
        peaks["in_flight"] = max(peaks["in_flight"], admission.in_flight)
        peaks["waiting"] = max(peaks["waiting"], admission.waiting)
        await asyncio.sleep(0.01)


@pytest.mark.django_db(transaction=True)
async def test_two_served_two_queued_then_served_two_refused_with_429(standin):
    engine = standin(behaviour=Behaviour(head_delay_s=0.5))
    router, client, admission = await serving(
        engine.url, max_concurrent_requests=2, queue_size=2, queue_timeout_s=5
    )
    peaks, stop = {"in_flight": 0, "waiting": 0}, asyncio.Event()
    watcher = asyncio.ensure_future(watch(admission, peaks, stop))
    started = time.monotonic()
    try:
        answers = await asyncio.gather(
            *[client.post("/v1/completions", json=BODY) for _ in range(6)]
        )
        elapsed = time.monotonic() - started
        metrics = (await client.get("/metrics")).text
        fleet = (await sync_to_async(build_snapshot)(router, admission))["fleet"]  # the dashboard's
    finally:
        stop.set()
        await watcher
        await client.aclose()
        await http.client.aclose()
    statuses = sorted(r.status_code for r in answers)
    assert statuses == [200, 200, 200, 200, 429, 429], [r.text for r in answers]
    assert peaks == {"in_flight": 2, "waiting": 2}
    assert elapsed >= 0.95  # two rounds of the engine's 0.5 s: the queued went second
    assert len(engine.received) == 4  # the refused never reached the engine
    for r in (r for r in answers if r.status_code == 429):
        assert int(r.headers["retry-after"]) >= 1
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert (error["type"], error["code"], error["param"]) == (
            "requests",
            "rate_limit_exceeded",
            None,
        )
    assert all(t.load.idle for t in router.fleet.all_targets())
    assert (admission.in_flight, admission.waiting) == (0, 0)
    admission.check_integrity()
    assert 'dpmesh_router_rejected_requests_total{reason="queue_full"} 2.0' in metrics
    assert "dpmesh_router_queue_wait_seconds_count 4.0" in metrics
    assert "dpmesh_router_queue_depth 0.0" in metrics
    assert (fleet["queue_depth"], fleet["rejected_requests"]) == (0, 2)
    assert fleet["rejected_by_reason"] == {"queue_full": 2, "timeout": 0, "draining": 0}


@pytest.mark.django_db(transaction=True)
async def test_x_priority_must_be_an_integer(standin):
    engine = standin()
    router, client, admission = await serving(engine.url)
    try:
        bad = await client.post("/v1/completions", json=BODY, headers={"X-Priority": "high"})
        good = await client.post("/v1/completions", json=BODY, headers={"X-Priority": "-3"})
    finally:
        await client.aclose()
        await http.client.aclose()
    assert bad.status_code == 400
    error = bad.json()["error"]
    assert error["type"] == "invalid_request_error" and "X-Priority" in error["message"]
    assert good.status_code == 200, good.text
    assert len(engine.received) == 1


@pytest.mark.django_db(transaction=True)
async def test_a_client_that_leaves_the_queue_or_the_engine_leaks_no_slot(standin):
    engine = standin(behaviour=Behaviour.hang())
    router, client, admission = await serving(engine.url, max_concurrent_requests=1, queue_size=4)
    await client.aclose()
    app = build_application(router, admission)

    def request() -> ApplicationCommunicator:
        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
        return ApplicationCommunicator(app, {**scope, "query_string": b""})

    async def until(predicate, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert predicate()

    try:
        served, queued = request(), request()
        for communicator in (served, queued):
            await communicator.send_input(
                {"type": "http.request", "body": json.dumps(BODY).encode()}
            )
        await until(lambda: admission.in_flight == 1 and admission.waiting == 1)
        await until(lambda: len(engine.received) == 1)  # the served one hangs at the engine
        await queued.send_input({"type": "http.disconnect"})  # the queued one's client leaves
        await queued.wait(5)
        assert (admission.in_flight, admission.waiting) == (1, 0)
        await served.send_input({"type": "http.disconnect"})  # and the served one's
        await served.wait(5)
        await until(lambda: admission.in_flight == 0)
    finally:
        await http.client.aclose()
    assert len(engine.received) == 1  # the one that left the queue never reached the engine
    assert all(t.load.idle for t in router.fleet.all_targets())
    admission.check_integrity()


@pytest.mark.django_db(transaction=True)
async def test_a_saturated_fleet_holds_the_next_request_until_the_first_token(standin):
    # one rank; any queued prefill saturates it: the second stream waits for the first's token
    engine = standin(dp_size=1, behaviour=Behaviour(head_delay_s=0.5, tokens=2))
    router, client, admission = await serving(
        engine.url, saturation_queued_prefill_tokens=1, queue_timeout_s=5
    )
    body = {**BODY, "stream": True}
    try:
        first, second = await asyncio.gather(
            client.post("/v1/completions", json=body),
            client.post("/v1/completions", json={**body, "prompt": "admit me too"}),
        )
    finally:
        await client.aclose()
        await http.client.aclose()
    assert [first.status_code, second.status_code] == [200, 200]
    assert sse_events(first.text)[-1] == sse_events(second.text)[-1] == "[DONE]"
    assert admission.wait_time.count == 2 and admission.wait_time.sum >= 0.4
    # each stream's 0.5 s to its first token: what a queued request must now leave for it
    assert 0.45 <= admission.expected_first_token_s() <= 2.5, admission.expected_first_token_s()
    assert all(t.load.idle for t in router.fleet.all_targets())
    admission.check_integrity()
