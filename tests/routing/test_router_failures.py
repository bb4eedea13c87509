"""The router's failure paths, end to end with real processes: ``runrouter`` (uvicorn) in front of
real engines (``runengine``) and of stand-ins that misbehave on purpose
(harness/standin.py).

Every path must release the router's load (its /metrics gauges per target return to 0): normal
streams, upstream 4xx/5xx, upstream timeouts, client disconnects mid-stream and before the first
byte. Retries happen only while nothing has reached the client. A worker that dies is taken out by
the health loop and put back when it returns; a worker named before it is up is discovered.

Two routers (cache_aware, and round_robin for the worker-down test, which must know that requests
reach both engines) and two engines serve the whole module (an engine takes ~20 s to start). Each
stand-in test registers its own stand-in through ``POST /workers`` under a model name of its own,
so its requests reach only that stand-in.
"""

from __future__ import annotations

import http.client
import itertools
import json
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from harness import procs
from harness.procs import ServerProcess, free_port, wait_for
from harness.standin import Behaviour, StandIn
from tests.support.router_checks import (
    ADMIN_HEADERS,
    assert_idle,
    body_for,
    busy_targets,
    counter,
    healthy_targets,
    kill_hard,
    path_for,
    prom,
    router_load,
    sse_events,
    start_engine_on,
    start_router,
    texts,
)

pytestmark = pytest.mark.slow

HEALTH_INTERVAL_S, FAILURE_THRESHOLD = 1, 2
REQUEST_TIMEOUT_S = 6.0
HEADER_TIMEOUT_S = 3.0  # a client's request line and headers (20 s by default)


def start_test_router(
    tmp: Path, worker_urls: list[str], name: str, policy: str = "cache_aware"
) -> ServerProcess:
    return start_router(
        tmp,
        worker_urls,
        name,
        "--policy",
        policy,
        "--health-check-interval-secs",
        str(HEALTH_INTERVAL_S),
        "--health-failure-threshold",
        str(FAILURE_THRESHOLD),
        "--health-success-threshold",
        "1",
        "--request-timeout-secs",
        str(REQUEST_TIMEOUT_S),
        env={"CONTROL_PLANE_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S)},
    )


@dataclass
class Cluster:
    tmp: Path
    router: ServerProcess  # cache_aware
    # round_robin: the worker-down test needs to know requests reach both engines
    failover: ServerProcess
    engine: ServerProcess  # dp 2, stays up
    spare: ServerProcess  # dp 1, killed and restarted by the worker-down test
    spare_port: int
    health_before_engines: list[tuple[int, dict]]

    @property
    def url(self) -> str:
        return self.router.url


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The routers start naming two engines that are not up yet (as ``serve`` does); then both
    engines start, in parallel."""
    tmp = tmp_path_factory.mktemp("router_failures")
    engine_port, spare_port = free_port(), free_port()
    urls = [f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{spare_port}"]
    routers, engines, cluster = [], [], None
    try:
        with ThreadPoolExecutor(2) as pool:
            routers += _results(
                [
                    pool.submit(start_test_router, tmp, urls, "router"),
                    pool.submit(start_test_router, tmp, urls, "failover", "round_robin"),
                ]
            )
        before = []
        for server in routers:
            r = httpx.get(server.url + "/health", timeout=5)
            before.append((r.status_code, r.json()))
        with ThreadPoolExecutor(2) as pool:
            engines += _results(
                [
                    pool.submit(start_engine_on, tmp, engine_port, 2, "engine"),
                    pool.submit(start_engine_on, tmp, spare_port, 1, "spare"),
                ]
            )
        cluster = Cluster(tmp, *routers, *engines, spare_port, before)
        yield cluster
    finally:
        for server in routers:
            server.stop()
        # an engine takes seconds to shut down cleanly, and nothing here needs it to
        for server in engines + ([cluster.spare] if cluster else []):
            if server.proc.poll() is None:
                kill_hard(server)


def _results(jobs) -> list:
    """The results of ``jobs`` in order; the first failure is raised after all have finished,
    so the caller's cleanup sees every process that did start."""
    done = [job.result() for job in jobs if job.exception() is None]
    for job in jobs:
        job.result()
    return done


_models = itertools.count()


@pytest.fixture
def standin(cluster):
    """Register a fresh stand-in (``StandIn(dp_size=…)``) with the module's router under a model
    name of its own; removed and stopped after the test."""
    made = []

    def make(dp_size: int = 2, default: Behaviour | None = None) -> StandIn:
        s = StandIn(dp_size=dp_size, model=f"standin-{next(_models)}", default=default).start()
        r = httpx.post(
            cluster.url + "/workers", json={"url": s.url}, timeout=10, headers=ADMIN_HEADERS
        )
        assert r.status_code == 201, r.text
        made.append((s, r.json()["id"]))
        # the router learns the stand-in's ranks from its /server_info; until then a request for
        # its model would go elsewhere (seen once, on a loaded machine)
        assert wait_for(
            lambda: sum(t.startswith(s.url) for t in healthy_targets(cluster.url)) == dp_size,
            timeout=30,
        ), healthy_targets(cluster.url)
        return s

    yield make
    for s, worker_id in made:
        httpx.delete(f"{cluster.url}/workers/{worker_id}", timeout=10, headers=ADMIN_HEADERS)
        s.stop()


def engine_of(cluster: Cluster, target: str) -> tuple[ServerProcess, int]:
    url, rank = target.rsplit("@", 1)
    server = cluster.engine if url == cluster.engine.url else cluster.spare
    assert server.url == url, (target, cluster.engine.url, cluster.spare.url)
    return server, int(rank)


# ----- 1. load returns to zero on every path ------------------------------------------------------
def test_normal_streams_and_non_streams_release_load(cluster, standin):
    s = standin(dp_size=2)
    with httpx.Client(base_url=cluster.url, timeout=30) as client:
        for model in ("tiny", s.model):
            for chat, stream, usage in itertools.product(
                (False, True), (False, True), (None, True)
            ):
                if usage and not stream:
                    continue
                body = body_for(model, chat=chat, stream=stream, usage=usage)
                r = client.post(path_for(body), json=body)
                assert r.status_code == 200, r.text
                assert r.headers["x-routed-target"].startswith(s.url) == (model == s.model)
                if stream:
                    events = sse_events(r.text)
                    assert events[-1] == "[DONE]" and texts(events), events
                    # the router always asks for usage (to learn cached tokens); the client sees it
                    # only when it asked too
                    usage_events = [e for e in events[:-1] if json.loads(e).get("usage")]
                    assert len(usage_events) == (1 if usage else 0), events
                else:
                    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0
    assert_idle(cluster.url)


def test_upstream_4xx_is_passed_through_and_releases_load(cluster, standin):
    s = standin(dp_size=2, default=Behaviour(status=400))
    with httpx.Client(base_url=cluster.url, timeout=30) as client:
        for stream in (False, True):
            before = len(s.received)
            r = client.post("/v1/completions", json=body_for(s.model, chat=False, stream=stream))
            assert r.status_code == 400
            assert r.json() == {
                "error": {
                    "message": "stand-in says 400",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": 400,
                }
            }
            assert len(s.received) == before + 1, "a 4xx must not be retried"
        # the engine's own 400 (a rank out of range is not the router's business: it overwrites the
        # rank, so use a bad max_tokens) comes back with the engine's body
        for stream in (False, True):
            r = client.post(
                "/v1/chat/completions",
                json=body_for("tiny", chat=True, stream=stream, max_tokens=-3),
            )
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "max_tokens"
    assert_idle(cluster.url)


def test_upstream_5xx_is_retried_on_every_target_then_returned(cluster, standin):
    s = standin(dp_size=2, default=Behaviour(status=500))
    retries = counter(cluster.url, "dpmesh_router_retries_total")
    for stream in (False, True):
        before = len(s.received)
        r = httpx.post(
            cluster.url + "/v1/completions",
            json=body_for(s.model, chat=False, stream=stream),
            timeout=30,
        )
        assert r.status_code == 500, r.text
        assert r.json()["error"]["code"] == 500
        tried = s.received[before:]
        assert sorted(x.rank for x in tried) == [0, 1], "each target is tried once"
    assert counter(cluster.url, "dpmesh_router_retries_total") >= retries + 2
    assert_idle(cluster.url)


def test_upstream_timeout_answers_504_and_a_stalled_stream_ends_with_an_error(cluster, standin):
    hung = standin(dp_size=1, default=Behaviour.hang())
    stalled = standin(
        dp_size=1, default=Behaviour(tokens=3, token_interval_s=REQUEST_TIMEOUT_S + 3)
    )

    def hang():
        t0 = time.monotonic()
        r = httpx.post(
            cluster.url + "/v1/completions",
            json=body_for(hung.model, chat=False, stream=False),
            timeout=30,
        )
        return r, time.monotonic() - t0

    def stall():
        r = httpx.post(
            cluster.url + "/v1/completions",
            json=body_for(stalled.model, chat=False, stream=True),
            timeout=30,
        )
        return r

    with ThreadPoolExecutor(2) as pool:  # both wait out the router's timeout together
        hang_job, stall_job = pool.submit(hang), pool.submit(stall)
        (r, elapsed), streamed = hang_job.result(), stall_job.result()
    assert r.status_code == 504, r.text
    assert REQUEST_TIMEOUT_S - 0.5 < elapsed < REQUEST_TIMEOUT_S + 3
    assert wait_for(lambda: hung.received and hung.received[0].disconnected, timeout=3), (
        "the router must close the upstream connection it gave up on"
    )
    assert streamed.status_code == 200
    events = sse_events(streamed.text)
    assert texts(events) == ["tok0 "]
    assert json.loads(events[-2])["error"]["code"] == 502 and events[-1] == "[DONE]", events
    assert len(stalled.received) == 1, "a stream that has started is never retried"
    assert_idle(cluster.url)


def test_client_disconnect_mid_stream_aborts_the_engine_request(cluster):
    body = body_for(
        "tiny", chat=True, stream=True, max_tokens=1500, prompt="tell me a long story " * 8
    )
    with httpx.Client(base_url=cluster.url, timeout=30) as client:
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            target = r.headers["x-routed-target"]
            server, rank = engine_of(cluster, target)
            before = procs.metrics(server.url)
            errors_before = counter(cluster.url, "dpmesh_router_errors_total", target)
            aborted_before = counter(cluster.url, "dpmesh_router_aborted_total", target)
            lines = r.iter_lines()  # (closing this iterator would close the connection)
            assert sum(next(lines).startswith("data: ") for _ in range(10)) == 5
            # the ranks publish their stats every 0.25 s
            assert wait_for(
                lambda: procs.metrics(server.url)[("kv_blocks_used", rank)] > 0, timeout=2
            )
            assert busy_targets(cluster.url)
        # leaving the block closes the connection: the client is gone mid-stream

    def aborted():
        m = procs.metrics(server.url)
        return (
            m[("request_aborts", rank)] == before[("request_aborts", rank)] + 1
            and m[("kv_blocks_used", rank)] == 0
        )

    assert wait_for(aborted, timeout=5), procs.metrics(server.url)
    assert procs.metrics(server.url)[("requests", rank)] == before[("requests", rank)], (
        "it must not have finished"
    )
    assert_idle(cluster.url)
    # the client left: counted as aborted, not as the target's error
    assert counter(cluster.url, "dpmesh_router_aborted_total", target) == aborted_before + 1
    assert counter(cluster.url, "dpmesh_router_errors_total", target) == errors_before


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_before_the_first_byte_releases_load(cluster, standin, stream):
    s = standin(dp_size=1, default=Behaviour(head_delay_s=REQUEST_TIMEOUT_S - 1))
    aborted_before = counter(cluster.url, "dpmesh_router_aborted_total")
    errors_before = counter(cluster.url, "dpmesh_router_errors_total")
    t0 = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            cluster.url + "/v1/completions",
            json=body_for(s.model, chat=False, stream=stream),
            timeout=0.5,
        )
    assert_idle(cluster.url, timeout=1.5)
    assert time.monotonic() - t0 < REQUEST_TIMEOUT_S - 1, (
        "load must be released when the client leaves, not when the upstream answers"
    )
    assert wait_for(lambda: s.received[0].disconnected, timeout=2), (
        "the upstream request must be abandoned too"
    )
    assert len(s.received) == 1
    assert counter(cluster.url, "dpmesh_router_aborted_total") == aborted_before + 1
    assert counter(cluster.url, "dpmesh_router_errors_total") == errors_before


def test_a_burst_of_new_sessions_is_spread_over_idle_ranks(cluster, standin):
    s = standin(dp_size=3, default=Behaviour(tokens=20, token_interval_s=0.3))
    # two long prompts (distinct from their first block) start two sessions on two of the ranks
    for lead in "AB":
        body = body_for(s.model, chat=False, stream=False, prompt=lead + "x" * 3999)
        assert httpx.post(cluster.url + "/v1/completions", json=body, timeout=30).status_code == 200
    with httpx.Client(base_url=cluster.url, timeout=30) as client, ExitStack() as streams:
        for i in range(6):  # six short new sessions, all decoding at once
            body = body_for(
                s.model, chat=False, stream=True, prompt=f"short session {i:02d} says hi"
            )
            assert (
                streams.enter_context(
                    client.stream("POST", "/v1/completions", json=body)
                ).status_code
                == 200
            )
        inflight = [
            g["dpmesh_router_inflight_requests"]
            for t, g in router_load(cluster.url).items()
            if t.startswith(s.url)
        ]
    assert_idle(cluster.url)
    # spread, not piled: every rank takes part and none takes half (the policy also weighs the long
    # prompts the first two ranks just served, so an exact 2/2/2 is not the goal)
    assert min(inflight) >= 1 and max(inflight) <= 3, f"in flight per rank: {inflight}"


# ----- 2. retries ---------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_503_is_retried_on_another_target(cluster, standin, stream):
    s = standin(dp_size=2)
    s.script.append(Behaviour(status=503))  # the first attempt, wherever it goes
    retries = counter(cluster.url, "dpmesh_router_retries_total")
    r = httpx.post(
        cluster.url + "/v1/completions",
        json=body_for(s.model, chat=False, stream=stream),
        timeout=30,
    )
    assert r.status_code == 200, r.text
    first, second = s.received
    assert first.rank != second.rank
    assert r.headers["x-data-parallel-rank"] == str(second.rank)
    if stream:
        assert sse_events(r.text)[-1] == "[DONE]"
    assert counter(cluster.url, "dpmesh_router_retries_total") == retries + 1
    assert_idle(cluster.url)


@pytest.mark.parametrize("chat", [False, True])
def test_no_retry_after_the_first_byte(cluster, standin, chat):
    s = standin(dp_size=2, default=Behaviour(tokens=4, drop_after=2))
    retries = counter(cluster.url, "dpmesh_router_retries_total")
    body = body_for(s.model, chat=chat, stream=True)
    r = httpx.post(cluster.url + path_for(body), json=body, timeout=30)
    assert r.status_code == 200
    events = sse_events(r.text)
    assert texts(events) == ["tok0 ", "tok1 "], "the output reached the client once, and only once"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 502 and "mid-stream" in error["message"]
    assert events[-1] == "[DONE]" and len(events) == 4
    assert len(s.received) == 1
    assert counter(cluster.url, "dpmesh_router_retries_total") == retries
    assert_idle(cluster.url)


# ----- 4. a worker that is not up yet is discovered -----------------------------------------------
def test_workers_named_before_they_are_up_are_discovered(cluster):
    expected = sorted(
        [f"{cluster.engine.url}@0", f"{cluster.engine.url}@1", f"{cluster.spare.url}@0"]
    )
    for router, (status, body) in zip(
        (cluster.router, cluster.failover), cluster.health_before_engines, strict=True
    ):
        assert (status, body["targets"]) == (503, [])
        assert wait_for(
            lambda router=router: sorted(healthy_targets(router.url)) == expected, timeout=5
        ), healthy_targets(router.url)
        workers = httpx.get(router.url + "/workers", timeout=5).json()["workers"]
        assert sorted(
            (w["url"], w["dp_size"], w["health"]) for w in workers if "standin" not in w["model"]
        ) == sorted([(cluster.engine.url, 2, "healthy"), (cluster.spare.url, 1, "healthy")])


def test_a_late_worker_turns_health_to_200(tmp_path):
    port = free_port()
    with start_test_router(tmp_path, [f"http://127.0.0.1:{port}"], "late") as router:
        r = httpx.get(router.url + "/health", timeout=5)
        assert r.status_code == 503 and r.json()["targets"] == []
        with StandIn(dp_size=2, model="late").start(port=port):
            t0 = time.monotonic()
            assert wait_for(
                lambda: httpx.get(router.url + "/health", timeout=5).status_code == 200, timeout=5
            )
            assert time.monotonic() - t0 < 3, (
                "the health loop retries undiscovered workers every 0.5 s"
            )
            assert sorted(healthy_targets(router.url)) == [
                f"http://127.0.0.1:{port}@0",
                f"http://127.0.0.1:{port}@1",
            ]
            r = httpx.post(
                router.url + "/v1/completions",
                json=body_for("late", chat=False, stream=False),
                timeout=10,
            )
            assert r.status_code == 200, r.text


# ----- 5. the openai client through the router ----------------------------------------------------
def raw_exchange(url: str, head: bytes, timeout: float = 10.0) -> bytes:
    """Send ``head`` (a request line and headers, maybe a little body) on a fresh connection and
    return what the router answers before ``timeout`` (b"" if it closed without a word)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(head)
        answer = b""
        try:
            while True:  # the head, then as much body as its Content-Length says
                chunk = sock.recv(4096)
                answer += chunk
                head_end = answer.find(b"\r\n\r\n")
                if not chunk or head_end < 0:
                    if not chunk:
                        return answer
                    continue
                length = next(
                    (int(line.split(b":")[1]) for line in answer[:head_end].split(b"\r\n")
                     if line.lower().startswith(b"content-length:")), 0,
                )  # fmt: skip
                if len(answer) >= head_end + 4 + length:
                    return answer
        except TimeoutError:
            return answer or b"(no answer)"


def test_a_body_past_the_fleets_limit_is_refused_before_it_is_read(cluster):
    # the engines take max_model_len 32768 and report a 4 MiB body limit: the router holds
    # bodies to 32768 x 64 + 1 MiB (apps/routing/proxy/limits.py), and says so from the
    # Content-Length alone, with the 50 MB body never sent. The limit comes from what the router
    # has learnt of the engines: run alone, this test may come before it has
    assert wait_for(lambda: len(healthy_targets(cluster.url)) == 3, timeout=60), healthy_targets(
        cluster.url
    )
    limit = 32768 * 64 + 2**20
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 50000000\r\n\r\n{"
    )
    answer = raw_exchange(cluster.url, head)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert str(limit).encode() in answer, answer
    # one byte past the limit, sent: refused too; at the limit it is read (and is not JSON)
    for size, status in ((limit + 1, 413), (limit, 400)):
        r = httpx.post(cluster.url + "/v1/completions", content=b"x" * size, timeout=30)
        assert r.status_code == status, (size, r.text[:200])
    assert_idle(cluster.url)


def test_a_prompt_no_worker_can_take_is_refused_by_the_router(cluster):
    # ~1 MB of words is ~350 k tokens, far past the engines' 32768: the router stops tokenizing
    # once it knows, and answers in the engine's words; the engines never see it
    sent = counter(cluster.url, "dpmesh_router_requests_total")
    words = " ".join(f"w{k % 10}" for k in range(170_000))
    refusals = [
        ("/v1/completions", {"prompt": words, "max_tokens": 2}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": words}]}, "messages"),
        ("/v1/completions", {"prompt": list(range(100, 40_100)), "max_tokens": 2}, "prompt"),
    ]
    for path, body, param in refusals:
        r = httpx.post(cluster.url + path, json=body, timeout=60)
        assert r.status_code == 400, r.text[:300]
        error = r.json()["error"]
        message = error["message"]
        assert error["param"] == param and error["type"] == "invalid_request_error"
        assert "maximum context length is 32768 tokens; the prompt has at least" in message
    assert counter(cluster.url, "dpmesh_router_requests_total") == sent
    # a long prompt that fits is still served, and routed on its tokens
    r = httpx.post(
        cluster.url + "/v1/completions",
        json={"prompt": " ".join(f"w{k % 10}" for k in range(500)), "max_tokens": 2},
        timeout=60,
    )
    assert r.status_code == 200, r.text[:300]
    assert_idle(cluster.url)


def test_each_answer_says_what_the_router_itself_took(cluster):
    seen = counter(cluster.url, "dpmesh_router_overhead_seconds_count")
    for stream in (False, True):
        body = body_for("tiny", chat=stream, stream=stream, prompt=f"overhead {stream}")
        started = time.perf_counter()
        r = httpx.post(cluster.url + path_for(body), json=body, timeout=30)
        took_ms = (time.perf_counter() - started) * 1000
        assert r.status_code == 200, r.text
        overhead_ms = float(r.headers["x-dpmesh-overhead-duration-ms"])
        assert 0 < overhead_ms < took_ms, (overhead_ms, took_ms)
    assert counter(cluster.url, "dpmesh_router_overhead_seconds_count") == seen + 2


def test_the_router_does_not_count_the_clients_own_time_sending_its_body(cluster):
    """A client that sends its head, then its body half a second later: the router's own time
    (the header and the histogram) leaves that half second out; it was the client's."""
    host, port = cluster.url.removeprefix("http://").split(":")
    body = json.dumps({"model": "tiny", "prompt": "a body sent late", "max_tokens": 2}).encode()
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.putrequest("POST", "/v1/completions")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders()
        time.sleep(0.5)
        conn.send(body)
        r = conn.getresponse()
        assert r.status == 200, r.read()[:300]
        overhead_ms = float(r.getheader("x-dpmesh-overhead-duration-ms"))
        r.read()
    finally:
        conn.close()
    assert 0 < overhead_ms < 250, overhead_ms  # the half second is not in it


def test_a_client_that_never_finishes_its_headers_is_cut_off(cluster):
    # serving/uvicorn_server.py: the request line and headers within CONTROL_PLANE_HEADER_TIMEOUT_S
    host, port = cluster.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        started = time.monotonic()
        sock.sendall(b"X-Slow: 1\r\n")
        assert sock.recv(100) == b""  # closed by the router, not timed out here
        assert HEADER_TIMEOUT_S - 1 < time.monotonic() - started < 29


def test_a_client_that_reads_slowly_holds_the_engine_back_not_the_routers_memory(cluster, standin):
    # the relay writes each event straight to the client's connection (serving/uvicorn_server.py
    # DirectBody); while the client's buffer is full it stops reading from the engine, so ~50 MB
    # of events wait in the engine, not in the router
    s = standin(dp_size=1, default=Behaviour(tokens=12_000, padding=4096))
    host, port = cluster.url.removeprefix("http://").split(":")
    body = json.dumps({"model": s.model, "prompt": "slow", "max_tokens": 16, "stream": True})
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
        sock.settimeout(30)
        sock.connect((host, int(port)))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(body), body.encode()))  # fmt: skip
        assert wait_for(lambda: len(s.received) == 1, timeout=10)
        time.sleep(2.0)  # the client reads nothing
        assert not s.received[0].completed, "the router read the whole answer for a stalled client"
        data = bytearray()
        while not data.endswith(b"0\r\n\r\n"):
            piece = sock.recv(1 << 20)
            assert piece, "the router closed the stream"
            data += piece
    head, _, chunked = bytes(data).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    events = [e for e in re.findall(rb"data: (.*?)\n\n", chunked)]
    assert events[-1] == b"[DONE]" and len(events) == 12_000 + 2, len(events)
    assert s.received[0].completed
    assert_idle(cluster.url)


def test_an_answer_written_whole_keeps_http_framing(cluster, standin):
    # a non-streamed answer goes out in one write (serving/uvicorn_server.py DirectBody.respond):
    # an HTTP/1.0 client or one that says ``Connection: close`` gets that header and the close,
    # a keep-alive client its connection back for the next request
    s = standin(dp_size=1)
    host, port = cluster.url.removeprefix("http://").split(":")
    body = json.dumps({"model": s.model, "prompt": "hi", "max_tokens": 2}).encode()

    def ask(sock, version: bytes, extra: bytes = b"") -> bytes:
        head = b"POST /v1/completions HTTP/%s\r\nHost: x\r\nContent-Type: application/json\r\n"
        sock.sendall(head % version + extra + b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < int(
            re.search(rb"content-length: (\d+)", data).group(1)
        ):
            piece = sock.recv(65536)
            assert piece, data
            data += piece
        return data

    for version, extra in ((b"1.0", b""), (b"1.1", b"Connection: close\r\n")):
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            head, _, answer = ask(sock, version, extra).partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200") and b"\r\nconnection: close" in head
            assert json.loads(answer)["choices"]
            assert sock.recv(1) == b"", "closed after the answer"
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        for _ in range(2):  # kept alive: the same connection serves the next request
            head, _, answer = ask(sock, b"1.1").partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200") and b"connection: close" not in head
            assert json.loads(answer)["choices"]
    assert_idle(cluster.url)


@pytest.fixture
def oai(cluster):
    with openai.OpenAI(
        base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=60
    ) as client:
        yield client


def test_openai_client_non_streaming_usage(oai, cluster):
    # several full blocks
    prompt = "the quick brown fox jumps over the lazy dog and keeps running " * 6
    chat = [
        oai.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": prompt}],
            max_tokens=4,
            temperature=0,
        )
        for _ in range(2)
    ]
    text = [
        oai.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0)
        for _ in range(2)
    ]
    for first, repeat in (chat, text):
        for usage in (first.usage, repeat.usage):
            assert 0 <= usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens, usage
            assert usage.completion_tokens == 4
        # on an idle fleet the repeat goes where its prefix is cached, and the engine says so
        assert repeat.usage.prompt_tokens_details.cached_tokens > 0, repeat.usage
    assert_idle(cluster.url)


def _pretokenized(cluster: Cluster) -> float:
    """Requests the engines took with the router's token ids (not encoded by their front)."""
    return sum(
        value
        for server in (cluster.engine, cluster.spare)
        for (name, _rank), value in procs.metrics(server.url).items()
        if name == "pretokenized_requests"
    )


def assert_same_as_the_engine_direct(cluster: Cluster, body: dict, routed) -> None:
    """The routed completion's text and prompt tokens are what the rank that served it answers
    to the same body sent to it directly."""
    server, rank = engine_of(cluster, routed.headers["x-routed-target"])
    direct = httpx.post(
        server.url + "/v1/completions",
        json=body,
        headers={"x-data-parallel-rank": str(rank)},
        timeout=60,
    )
    assert direct.json()["choices"][0]["text"] == routed.json()["choices"][0]["text"]
    assert direct.json()["usage"]["prompt_tokens"] == routed.json()["usage"]["prompt_tokens"]


def test_a_long_completion_is_tokenized_once_by_the_router_not_again_by_the_engine(cluster):
    """The router tokenizes a text prompt to route it and sends the ids beside the text
    (serving/openai_fields.py PRETOKENIZED): the engine computes them without encoding the
    text again, and answers exactly what it answers to the text alone. A long prompt's ids come
    from the router's worker threads, a short one's from its inline encoding; not for chat, and
    a client's own ids field is dropped for the router's."""
    long_prompt = "the quick brown fox jumps over the lazy dog " * 100  # 4,400 characters
    body = {"model": "tiny", "prompt": long_prompt, "max_tokens": 6, "temperature": 0}
    before = _pretokenized(cluster)
    routed = httpx.post(cluster.url + "/v1/completions", json=body, timeout=60)
    assert routed.status_code == 200, routed.text
    assert _pretokenized(cluster) == before + 1
    assert_same_as_the_engine_direct(cluster, body, routed)
    chat = {
        "model": "tiny",
        "messages": [{"role": "user", "content": long_prompt}],
        "max_tokens": 2,
    }
    smuggled = {
        "model": "tiny",
        "prompt": "short",
        "max_tokens": 2,
        "dpmesh_prompt_token_ids": list(range(50, 90)),
    }
    for extra in (chat, smuggled):
        path = "/v1/chat/completions" if "messages" in extra else "/v1/completions"
        r = httpx.post(cluster.url + path, json=extra, timeout=60)
        assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] < 40  # "short", not the client's 40 ids
    assert _pretokenized(cluster) == before + 2  # the long prompt and "short"; not the chat
    short = {"model": "tiny", "prompt": "a short prompt, routed", "max_tokens": 4, "temperature": 0}
    routed = httpx.post(cluster.url + "/v1/completions", json=short, timeout=60)
    assert _pretokenized(cluster) == before + 3
    assert_same_as_the_engine_direct(cluster, short, routed)
    assert_idle(cluster.url)


def _tokenizer_chars(cluster: Cluster) -> dict[str, float]:
    return {
        labels["source"]: value
        for name, labels, value in prom(cluster.url)
        if name == "dpmesh_router_tokenizer_chars_total"
    }


def test_a_prompt_sharing_a_long_prefix_encodes_only_its_new_part_and_the_ids_stay_exact(cluster):
    """Two long completions with one 4.4 k-character preamble: the router takes the second's
    shared chunks from its prefix token cache (engine/tokenize_cache.py) and sends the engine the
    ids, which must be those of the whole text: the engine answers what it answers to the text
    alone, with the same prompt tokens."""
    rules = (f"rule {i}: answer plainly and cite section {i * 7 % 13}." for i in range(100))
    preamble = " ".join(rules)
    before = _tokenizer_chars(cluster)
    for question in (" First, what is rule 3?", " Then: does rule 200 apply to tabs\tand 12?"):
        body = {"model": "tiny", "prompt": preamble + question, "max_tokens": 5, "temperature": 0}
        routed = httpx.post(cluster.url + "/v1/completions", json=body, timeout=60)
        assert routed.status_code == 200, routed.text
        assert_same_as_the_engine_direct(cluster, body, routed)
    after = _tokenizer_chars(cluster)
    # the second prompt's chunks up to the last cut in the preamble (cuts every ~2,048 characters)
    assert after["cached"] - before.get("cached", 0) >= 4_000
    assert after["encoded"] - before.get("encoded", 0) < len(preamble) + 2_200
    assert_idle(cluster.url)


def test_a_chat_turn_is_encoded_by_the_engine_only_past_its_history(cluster):
    """A chat's next turn carries its history: the router and the engine's front each take the
    history's chunks from their prefix token caches, and the engine computes exactly the ids of
    the whole rendered conversation (the same answer and prompt tokens as those ids sent as a
    completion prompt, encoded here in one piece)."""
    from engine.tiny import ensure_tiny_model
    from engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(ensure_tiny_model()))
    rules = (f"Rule {i} says to answer in {i % 5 + 1} words." for i in range(130))
    messages = [{"role": "system", "content": " ".join(rules)}, {"role": "user", "content": "Hi?"}]

    def engine_cached() -> float:
        return sum(
            value
            for server in (cluster.engine, cluster.spare)
            for name, labels, value in prom(server.url)
            if name == "dpmesh_engine_tokenizer_chars_total" and labels["source"] == "cached"
        )

    before = engine_cached()
    body = {"model": "tiny", "messages": messages, "max_tokens": 4, "temperature": 0}
    first = httpx.post(cluster.url + "/v1/chat/completions", json=body, timeout=60)
    assert first.status_code == 200, first.text
    messages += [
        {"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
        {"role": "user", "content": "And rule 7, in short?"},
    ]
    second = httpx.post(cluster.url + "/v1/chat/completions", json=body, timeout=60)
    assert second.status_code == 200, second.text
    assert engine_cached() - before >= 4_000  # the system prompt's chunks, not encoded again
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    server, rank = engine_of(cluster, second.headers["x-routed-target"])
    direct = httpx.post(
        server.url + "/v1/completions",
        json={"model": "tiny", "prompt": ids, "max_tokens": 4, "temperature": 0},
        headers={"x-data-parallel-rank": str(rank)},
        timeout=60,
    )
    assert second.json()["usage"]["prompt_tokens"] == len(ids)
    assert direct.json()["choices"][0]["text"] == second.json()["choices"][0]["message"]["content"]
    assert_idle(cluster.url)


@pytest.mark.parametrize("chat", [False, True])
def test_openai_client_streaming_usage_only_when_asked(oai, cluster, chat):
    def stream(**extra):
        if chat:
            return list(
                oai.chat.completions.create(
                    model="tiny",
                    messages=[{"role": "user", "content": "hi there"}],
                    max_tokens=4,
                    temperature=0,
                    stream=True,
                    **extra,
                )
            )
        return list(
            oai.completions.create(
                model="tiny", prompt="hi there", max_tokens=4, temperature=0, stream=True, **extra
            )
        )

    with_usage = stream(stream_options={"include_usage": True})
    assert with_usage[-1].usage is not None and not with_usage[-1].choices
    assert with_usage[-1].usage.prompt_tokens_details.cached_tokens >= 0
    assert all(c.usage is None for c in with_usage[:-1])
    without = stream()
    assert without and all(c.usage is None for c in without), (
        "the router must strip the usage it asked for"
    )
    assert all(c.choices for c in without)
    assert_idle(cluster.url)


# ----- 3. a worker goes down and comes back (last: it restarts the spare engine) ------------------
class StreamReader(threading.Thread):
    """A long streamed completion read in a thread: where it went, its events, how it ended. It
    stops reading (the client leaves) once ``leave`` is set, unless it is on ``stay_on``."""

    def __init__(self, url: str, i: int, leave: threading.Event, stay_on: str):
        super().__init__(daemon=True)
        self.url, self.leave, self.stay_on = url, leave, stay_on
        self.body = body_for(
            "tiny", chat=False, stream=True, max_tokens=1500, prompt=f"stream {i} goes on and on"
        )
        # never an early end-of-text: a stream on the spare must still be running when it is
        # killed (greedy output for some prompts stops within a few hundred tokens)
        self.body["ignore_eos"] = True
        self.target, self.events, self.error = None, [], None
        self.started = threading.Event()

    def run(self):
        try:
            with httpx.stream(
                "POST", self.url + "/v1/completions", json=self.body, timeout=30
            ) as r:
                self.target, buffer = r.headers.get("x-routed-target"), ""
                for text in r.iter_text():
                    buffer += text
                    while "\n\n" in buffer:
                        event, buffer = buffer.split("\n\n", 1)
                        self.events.append(event.removeprefix("data: "))
                        self.started.set()
                    if self.leave.is_set() and self.target != self.stay_on:
                        break
        except httpx.HTTPError as exc:
            self.error = exc
        self.started.set()


def plain_request(url: str, i: int) -> httpx.Response:
    """A non-streamed completion: its answer comes whole at the end, so until then nothing has
    reached the client and the router may still retry it."""
    body = body_for(
        "tiny", chat=False, stream=False, max_tokens=160, prompt=f"plain {i} goes on and on"
    )
    return httpx.post(url + "/v1/completions", json=body, timeout=30)


def load_the_spare(url: str, spare_target: str, pool, leave: threading.Event):
    """Send streams until one is streaming from the spare, then plain requests until one is in
    flight there (the failover router is round robin: a few of each at most)."""
    streams, plains = [], []
    while not any(s.target == spare_target for s in streams):
        assert len(streams) < 6, f"no stream reached the spare: {[s.target for s in streams]}"
        streams.append(StreamReader(url, len(streams), leave, stay_on=spare_target))
        streams[-1].start()
        assert streams[-1].started.wait(20)

    def streams_on_spare():  # recounted each time: a stream may end meanwhile on a fast host
        return sum(s.target == spare_target and s.is_alive() for s in streams)

    while router_load(url)[spare_target]["dpmesh_router_inflight_requests"] <= streams_on_spare():
        assert len(plains) < 6, "no plain request reached the spare"
        before = counter(url, "dpmesh_router_requests_total")
        plains.append(pool.submit(plain_request, url, len(plains)))
        assert wait_for(
            lambda before=before: counter(url, "dpmesh_router_requests_total") > before, timeout=5
        )
    return streams, plains


def _is_error(event: str) -> bool:
    """An SSE event that is an error object (not text that says "error": the tiny model's
    greedy output may be the word itself)."""
    return event != "[DONE]" and "error" in json.loads(event)


def test_dead_worker_is_taken_out_requests_go_elsewhere_and_it_comes_back(cluster):
    url = cluster.failover.url
    spare_target, engine = f"{cluster.spare.url}@0", cluster.engine.url
    # both engines in the failover router's fleet first (run alone, this test can come before
    # its discovery of the DP-2 engine: then the spare is the only target and nothing can retry)
    everyone = {spare_target, f"{engine}@0", f"{engine}@1"}
    assert wait_for(lambda: everyone <= set(healthy_targets(url)), timeout=30)
    retries, leave = counter(url, "dpmesh_router_retries_total"), threading.Event()
    with ThreadPoolExecutor(6) as pool:
        streams, plains = load_the_spare(url, spare_target, pool, leave)
        killed_at = time.monotonic()
        kill_hard(cluster.spare)
        limit = HEALTH_INTERVAL_S * FAILURE_THRESHOLD + 1  # (plus a probe round's slack)
        assert wait_for(lambda: spare_target not in healthy_targets(url), timeout=limit + 2)
        taken_out_after = time.monotonic() - killed_at
        plain_answers = [job.result() for job in plains]
    leave.set()
    for s in streams:
        s.join(30)
    assert taken_out_after < limit, f"taken out after {taken_out_after:.1f} s"
    assert wait_for(lambda: spare_target not in healthy_targets(cluster.url), timeout=2), (
        "the other router too"
    )
    # the plain requests had sent nothing to the client: retried on the engine that lives
    for r in plain_answers:
        assert r.status_code == 200 and r.headers["x-routed-target"].startswith(engine), r.text
    assert counter(url, "dpmesh_router_retries_total") >= retries + 1
    # the streams on the spare had: an error event and [DONE], never a second answer
    for s in streams:
        assert s.error is None, s.error
        if s.target == spare_target:
            last = json.loads(s.events[-2])
            assert s.events[-1] == "[DONE]" and last["error"]["code"] == 502, s.events[-3:]
            assert not any(map(_is_error, s.events[:-2]))
        else:
            errors = [e for e in s.events if _is_error(e)]
            assert not errors, f"a stream on {s.target} (not the spare) got {errors}"
    for i in range(4):
        body = body_for("tiny", chat=bool(i % 2), stream=bool(i // 2), prompt=f"after the kill {i}")
        r = httpx.post(url + path_for(body), json=body, timeout=30)
        assert r.status_code == 200 and r.headers["x-routed-target"].startswith(engine), r.text
    assert_idle(url)

    # it comes back on the same port: put back within a health round or two
    cluster.spare = start_engine_on(cluster.tmp, cluster.spare_port, 1, "spare-restarted")
    for router_url in (url, cluster.url):
        assert wait_for(
            lambda router_url=router_url: spare_target in healthy_targets(router_url),
            timeout=HEALTH_INTERVAL_S * 2 + 2,
        )
    workers = httpx.get(url + "/workers", timeout=5).json()["workers"]
    assert next(w["health"] for w in workers if w["url"] == cluster.spare.url) == "healthy"
    targets = []
    for i in range(3):  # round robin over three targets: one of them is the spare again
        r = httpx.post(
            url + "/v1/completions",
            json=body_for("tiny", chat=False, stream=False, prompt=f"welcome back {i}"),
            timeout=30,
        )
        assert r.status_code == 200, r.text
        targets.append(r.headers["x-routed-target"])
    assert spare_target in targets, targets
    assert_idle(url)
