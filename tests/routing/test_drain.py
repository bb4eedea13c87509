"""Graceful drain of the router process (apps/routing/proxy/drain.py): at the first SIGTERM/SIGINT
/health says ``draining`` (503) and new requests get a 503 while the admitted ones, streams
included, finish; then the process exits 0, with a clean log. A drain that outlasts
``--drain-timeout-secs`` cuts what is left; a second signal stops at once.

First in process (the Drain object on the test's loop, its ``stop`` recorded), then ``runrouter``
as a real process in front of a stand-in engine that streams slowly (harness/standin.py)."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from apps.replicas.services import worker_add
from apps.routing.decision.config import RouterConfig
from apps.routing.decision.router import Router
from apps.routing.live import LiveFleet
from apps.routing.proxy.admission import make_admission
from apps.routing.proxy.drain import Drain
from controlplane import http
from controlplane.asgi import build_application
from harness.procs import ServerProcess, wait_for
from harness.standin import Behaviour, StandIn
from tests.support.router_checks import sse_events, start_router, texts

BODY = {"model": "standin", "prompt": "drain me", "max_tokens": 4}
# what a clean stop never logs: leaks, tracebacks, /health's expected 503 as a server error, an
# engine's rank exit on shutdown as a death
DIRTY = (
    "Unclosed client session",
    "Task was destroyed",
    "Traceback",
    "ERROR django.request",
    "died",
)


@pytest.fixture
def standin():
    made = []

    def make(behaviour: Behaviour) -> StandIn:
        made.append(StandIn(dp_size=1, default=behaviour).start())
        return made[-1]

    yield make
    for s in made:
        s.stop()


# ----- in process ---------------------------------------------------------------------------------
@pytest.mark.django_db(transaction=True)
async def test_a_drain_refuses_new_work_lets_the_admitted_finish_then_stops(standin):
    engine = standin(Behaviour(head_delay_s=0.5))
    router = Router(RouterConfig(dp_aware=True, policy="round_robin"))
    await worker_add(url=engine.url, runtime=LiveFleet(router))
    stops: list[float] = []
    admission = make_admission(router)
    drain = Drain(router, admission, 5.0, stop=lambda: stops.append(1))
    transport = httpx.ASGITransport(app=build_application(router, admission))
    async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
        try:
            admitted = asyncio.ensure_future(client.post("/v1/completions", json=BODY))
            await asyncio.sleep(0.2)
            drain.signalled(signal.SIGTERM)
            health = await client.get("/health")
            refused = await client.post("/v1/completions", json=BODY)
            assert not stops  # the admitted request is still running
            served = await admitted
            await asyncio.wait_for(drain.task, 2)
            drain.signalled(signal.SIGTERM)  # stopping already: nothing more
        finally:
            await http.client.aclose()
    assert (health.status_code, health.json()["status"]) == (503, "draining")
    assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["type"] == "server_error"
    assert served.status_code == 200, served.text
    assert stops == [1]
    assert len(engine.received) == 1


@pytest.mark.django_db(transaction=True)
async def test_a_second_signal_stops_at_once(standin):
    engine = standin(Behaviour.hang())
    router = Router(RouterConfig(dp_aware=True, policy="round_robin"))
    await worker_add(url=engine.url, runtime=LiveFleet(router))
    admission = make_admission(router)
    stops: list[int] = []
    drain = Drain(router, admission, 60.0, stop=lambda: stops.append(1))
    transport = httpx.ASGITransport(app=build_application(router, admission))
    async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
        hanging = asyncio.ensure_future(client.post("/v1/completions", json=BODY))
        try:
            await asyncio.sleep(0.2)
            drain.signalled(signal.SIGINT)
            await asyncio.sleep(0.1)
            assert not stops and admission.in_flight == 1
            drain.signalled(signal.SIGINT)
            assert stops == [1]
            await asyncio.sleep(0)
            assert drain.task.cancelled()
        finally:
            hanging.cancel()
            await asyncio.gather(hanging, return_exceptions=True)
            await http.client.aclose()


# ----- the real process ---------------------------------------------------------------------------
class Stream:
    """A streamed request through the router, read in a thread."""

    def __init__(self, url: str, **body):
        self.text, self.status, self.error = "", None, None
        self.body = {**BODY, **body, "stream": True}
        self.first = threading.Event()
        self.thread = threading.Thread(target=self._read, args=(url,), daemon=True)
        self.thread.start()

    def _read(self, url: str) -> None:
        body = self.body
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
                self.status = r.status_code
                for chunk in r.iter_text():
                    self.text += chunk
                    self.first.set()
        except httpx.HTTPError as exc:
            self.error = exc
        finally:
            self.first.set()

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the stream did not end"


def serving_router(tmp: Path, engine: StandIn, name: str, drain_s: float) -> ServerProcess:
    router = start_router(tmp, [engine.url], name, "--drain-timeout-secs", str(drain_s))
    up = wait_for(lambda: httpx.get(router.url + "/health", timeout=5).status_code == 200, 20)
    assert up, router.log()[-2000:]
    return router


def draining(router: ServerProcess) -> bool:
    r = httpx.get(router.url + "/health", timeout=5)
    return r.status_code == 503 and r.json()["status"] == "draining"


def assert_clean_exit(router: ServerProcess, within_s: float) -> float:
    """The process exits 0 within ``within_s``; its log has no leak or traceback. Returns when."""
    started = time.monotonic()
    code = router.proc.wait(within_s)
    log = router.log()
    assert code == 0, log[-3000:]
    assert not [d for d in DIRTY if d in log], log[-3000:]
    return time.monotonic() - started


@pytest.mark.slow
def test_sigterm_drains_the_router_process_streams_finish_new_requests_get_503(tmp_path, standin):
    engine = standin(Behaviour(tokens=6, token_interval_s=0.4))  # a stream of ~3 s
    with serving_router(tmp_path, engine, "router", drain_s=10) as router:
        stream = Stream(router.url)
        assert stream.first.wait(10) and stream.error is None
        router.proc.send_signal(signal.SIGTERM)
        assert wait_for(lambda: draining(router), 3)
        refused = httpx.post(router.url + "/v1/completions", json=BODY, timeout=10)
        assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["type"] == "server_error"
        stream.join(10)
        assert stream.error is None and stream.status == 200
        events = sse_events(stream.text)
        assert events[-1] == "[DONE]" and len(texts(events)) == 6
        assert assert_clean_exit(router, 10) < 10
        log = router.log()
    assert "SIGTERM: draining (in flight: 1)" in log and "drained: stopping" in log
    assert len(engine.received) == 1  # the refused request never reached the engine


@pytest.mark.slow
def test_a_drain_that_outlasts_its_timeout_cuts_the_stream_and_exits_cleanly(tmp_path, standin):
    engine = standin(Behaviour(tokens=60, token_interval_s=0.5))  # ~30 s
    with serving_router(tmp_path, engine, "router", drain_s=1.5) as router:
        stream = Stream(router.url)
        assert stream.first.wait(10)
        router.proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        assert_clean_exit(router, 10)
        took = time.monotonic() - started
        stream.join(10)
        log = router.log()
    assert 1.4 <= took < 6, took
    assert "[DONE]" not in stream.text  # cut before its end
    assert "drain timeout (1.5 s): stopping now (in flight, cut: 1)" in log


@pytest.mark.slow
def test_a_second_sigterm_stops_the_router_process_at_once(tmp_path, standin):
    engine = standin(Behaviour(tokens=60, token_interval_s=0.5))
    with serving_router(tmp_path, engine, "router", drain_s=30) as router:
        stream = Stream(router.url)
        assert stream.first.wait(10)
        router.proc.send_signal(signal.SIGTERM)
        assert wait_for(lambda: draining(router), 3)
        router.proc.send_signal(signal.SIGTERM)
        took = assert_clean_exit(router, 10)
        stream.join(10)
        log = router.log()
    assert took < 5, took
    assert "SIGTERM again: stopping now (in flight, cut: 1)" in log
