"""A router restarted with other ``--worker-urls`` after its old engine is gone (issue 12's
scenario, as a new user meets it): the old worker is restored from the database, as every
registered worker is, but it is probed before the fleet serves, so it takes no traffic; under 16
concurrent clients not one request fails (before: 3 of 48 got 502, their four attempts all spent
on the dead worker's four ranks). The old worker stays registered and is shown unhealthy on
/workers: the database, shared by every router process, is the fleet's record.

Real processes: two ``runrouter`` runs on one SQLite database, a real engine for the new fleet;
the old engine is a stand-in process (DP 4) that is discovered once and then stopped.
"""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from harness import procs
from harness.procs import free_port, router_command
from tests.support.router_checks import (
    assert_idle,
    body_for,
    counter,
    path_for,
    start_engine_on,
)

pytestmark = pytest.mark.slow


def start_router_on(tmp, db: str, worker_urls: list[str], name: str):
    port = free_port()
    cmd = router_command(worker_urls, "--health-check-interval-secs", "30", port=port)
    return procs.start(
        cmd,
        f"http://127.0.0.1:{port}",
        tmp / f"{name}.log",
        health="/health",  # 200 once a worker is up and the start-up is done
        timeout=60,
        env={"DATABASE_URL": f"sqlite:///{tmp / db}"},
    )


def test_restarted_with_other_workers_no_request_goes_to_the_gone_one(tmp_path):
    old_port = free_port()
    old = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "harness.standin",
            "--port",
            str(old_port),
            "--dp-size",
            "4",
            "--model",
            "tiny",
        ],
        cwd=procs.REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    old_url = f"http://127.0.0.1:{old_port}"
    engine = None
    try:
        assert procs.wait_for(lambda: _answers(old_url), timeout=20)
        first = start_router_on(tmp_path, "fleet.sqlite3", [old_url], "first")
        first.stop()
        old.terminate()
        old.wait(10)
        new_port = free_port()
        engine = start_engine_on(tmp_path, new_port, 2, "engine")
        second = start_router_on(tmp_path, "fleet.sqlite3", [engine.url], "second")
        try:
            with ThreadPoolExecutor(16) as pool:
                answers = list(pool.map(lambda i: _send(second.url, i), range(48)))
            failed = [(r.status_code, r.text[:200]) for r in answers if r.status_code != 200]
            assert failed == [], failed
            assert all(r.headers["x-routed-target"].startswith(engine.url) for r in answers)
            # not one attempt was spent on it: it was probed before the first request
            assert counter(second.url, "dpmesh_router_retries_total") == 0
            workers = httpx.get(second.url + "/workers", timeout=10).json()["workers"]
            health = {w["url"]: w["health"] for w in workers}
            assert health == {old_url: "unhealthy", engine.url: "healthy"}, health
            assert_idle(second.url)
        finally:
            second.stop()
    finally:
        if old.poll() is None:
            old.kill()
        if engine is not None:
            engine.stop()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _send(url: str, i: int) -> httpx.Response:
    body = body_for("tiny", chat=bool(i % 2), stream=bool(i % 3 == 0), prompt=f"after restart {i}")
    return httpx.post(url + path_for(body), json=body, timeout=60)
