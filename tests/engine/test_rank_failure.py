"""A rank process that dies turns /health to 503, fails its in-flight requests with a clear
error instead of hanging, and leaves the other ranks serving."""

import json
import os
import signal

import httpx
import pytest

from harness.procs import metrics, start_engine, wait_for

pytestmark = pytest.mark.slow


def test_dead_rank_fails_its_requests_and_health(tmp_path):
    with start_engine(tmp_path, "--dp-size", "2", "--num-kv-blocks", "128") as engine:
        pid = httpx.get(engine.url + "/server_info").json()["ranks"][1]["pid"]
        body = {
            "prompt": "a long story",
            "max_tokens": 1000,
            "ignore_eos": True,
            "stream": True,
            "data_parallel_rank": 1,
        }
        with (
            httpx.Client(timeout=60) as client,
            client.stream("POST", engine.url + "/v1/completions", json=body) as r,
        ):
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            os.kill(pid, signal.SIGKILL)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][len("data: ") :])["error"]
        assert error["code"] == 503 and "rank 1 died" in error["message"]

        health = httpx.get(engine.url + "/health")
        assert health.status_code == 503 and "rank 1" in health.json()["reason"]
        pinned = httpx.post(
            engine.url + "/v1/completions", json={"prompt": "x", "data_parallel_rank": 1}
        )
        assert pinned.status_code == 503 and pinned.json()["error"]["code"] == 503
        for _ in range(3):  # unpinned requests go to the rank that still serves
            r = httpx.post(
                engine.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60
            )
            assert r.status_code == 200 and r.headers["x-data-parallel-rank"] == "0"
        m = wait_for(
            lambda: (m := metrics(engine.url))[("kv_blocks_used", 0)] == 0 and m, timeout=10
        )
        assert m[("rank_up", 1)] == 0 and m[("rank_up", 0)] == 1
        assert m[("inflight_requests", 0)] == 0 and m[("inflight_requests", 1)] == 0
    assert "DP rank 1 died" in engine.log()


def test_a_rank_that_ends_after_the_loop_closed_is_no_error_at_shutdown():
    """At SIGTERM the front's loop may close before a rank's reader thread sees its pipe end; the
    reader's last call then has no loop to go to, and that is the stop, not a failure."""
    import asyncio
    from types import SimpleNamespace

    from engine.server.frontend import EngineClient

    loop = asyncio.new_event_loop()
    loop.close()
    stopping = SimpleNamespace(loop=loop, stopping=True)
    EngineClient._call(stopping, lambda: None)  # no RuntimeError
    running = SimpleNamespace(loop=loop, stopping=False)
    EngineClient._call(running, lambda: None)  # closed: nothing to tell either
    live = asyncio.new_event_loop()
    calls = []
    EngineClient._call(SimpleNamespace(loop=live, stopping=False), calls.append, 1)
    live.call_soon(live.stop)
    live.run_forever()
    live.close()
    assert calls == [1]
