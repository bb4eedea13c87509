"""The periodic jobs, both ways they run, against a real engine:

- embedded (no REDIS_URL): Celery tasks run eagerly where they are sent, and a `runrouter`
  process schedules the jobs itself;
- scale-out (REDIS_URL, Postgres): a real `celery -A controlplane worker --beat` process on
  Redis runs them; the router process then does not scrape at all, and the dashboard's
  on-demand bench goes through the broker to that worker.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
import uuid

import httpx
import psycopg
import pytest

from harness.procs import (
    REPO_ROOT,
    free_port,
    metrics,
    router_command,
    start,
    start_engine,
    wait_for,
)

pytestmark = pytest.mark.slow

DP = 2


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    with start_engine(
        tmp_path_factory.mktemp("jobs"), "--dp-size", str(DP), "--num-kv-blocks", "256"
    ) as engine:
        yield engine


def send_some(url: str, n: int = 6, headers: dict | None = None) -> None:
    with httpx.Client(base_url=url, timeout=60, headers=headers) as client:
        for i in range(n):
            r = client.post(
                "/v1/completions",
                json={"model": "tiny", "prompt": list(range(10, 90)) + [i], "max_tokens": 2},
            )
            assert r.status_code == 200, r.text


# ----- embedded -----------------------------------------------------------------------------------
@pytest.mark.django_db(transaction=True)
def test_tasks_run_eagerly_in_process_without_a_broker(engine, settings):
    from apps.replicas import tasks
    from apps.replicas.models import Rank, RankSample, Worker

    assert settings.CELERY_TASK_ALWAYS_EAGER  # no REDIS_URL: the embedded default
    info = httpx.get(engine.url + "/server_info").json()
    worker = Worker.objects.create(url=engine.url, dp_size=DP, server_info=info, model_id="tiny")
    for r in range(DP):
        Rank.objects.create(worker=worker, rank=r)
    send_some(engine.url)
    assert tasks.scrape_fleet.delay().get() == DP
    m = metrics(engine.url)
    for row in RankSample.objects.select_related("rank"):
        assert (row.prompt_tokens, row.cached_tokens) == (
            m[("prompt_tokens", row.rank.rank)],
            m[("cached_tokens", row.rank.rank)],
        )
    assert tasks.refresh_discovery.delay().get() == {"checked": 1, "changed": 0}


@pytest.mark.django_db(transaction=True)
async def test_discovery_refresh_follows_an_engine_restarted_with_another_dp_size(tmp_path):
    """The refresh job records the change (Rank rows, an event); a router process that syncs from
    the database then routes to the new ranks, keeping the surviving rank's load."""
    from asgiref.sync import sync_to_async

    from apps.replicas.models import Worker, WorkerEvent
    from apps.replicas.services import worker_add
    from apps.routing.decision.config import RouterConfig
    from apps.routing.decision.router import Router
    from apps.routing.feeds.fleet_sync import FleetSync
    from apps.routing.live import LiveFleet
    from tests.support.router_checks import start_engine_on

    port = free_port()
    router = Router(RouterConfig(dp_aware=True))
    fleet_sync = FleetSync(router)
    with start_engine_on(tmp_path, port, 1, "dp1") as engine:
        worker = await worker_add(url=engine.url, runtime=LiveFleet(router))
        await fleet_sync.sync()
        assert [t.key for t in router.fleet.all_targets()] == [f"{engine.url}@0"]
        # live state is not a change
        assert await sync_to_async(jobs_refresh)() == {"checked": 1, "changed": 0}
    # a request in flight on rank 0 across the restart
    router.fleet.all_targets()[0].load.begin(10, 0)
    with start_engine_on(tmp_path, port, 2, "dp2") as engine:
        assert await sync_to_async(jobs_refresh)() == {"checked": 1, "changed": 1}
        worker = await Worker.objects.aget(id=worker.id)
        assert worker.dp_size == 2 and await worker.ranks.acount() == 2
        event = await WorkerEvent.objects.filter(worker=worker, kind="changed").alatest("at")
        assert "dp_size 1 -> 2" in event.detail
        await fleet_sync.sync()
        assert sorted(t.key for t in router.fleet.all_targets()) == [
            f"{engine.url}@0",
            f"{engine.url}@1",
        ]
        # the surviving target kept its load
        assert router.fleet.all_targets()[0].load.requests == 1
        routed = router.route({"prompt": "hello", "max_tokens": 1}, False, None)
        assert routed.target.rank == 1  # the idle new rank


def jobs_refresh():
    from apps.replicas import jobs as replica_jobs

    return replica_jobs.refresh_discovery()


def test_the_router_process_runs_the_jobs_itself_without_a_broker(engine, tmp_path):
    port = free_port()
    db = tmp_path / "router.sqlite3"
    env = {"DATABASE_URL": f"sqlite:///{db}", "CONTROL_PLANE_SCRAPE_INTERVAL_S": "0.5"}
    cmd = router_command(engine.url, port=port)
    with start(
        cmd, f"http://127.0.0.1:{port}", tmp_path / "router.log", env={**env, "REDIS_URL": ""}
    ) as router:
        send_some(router.url)

        def samples():
            with sqlite3.connect(db) as conn:
                return conn.execute(
                    "SELECT count(*), count(DISTINCT at) FROM replicas_ranksample"
                ).fetchone()

        # several scrapes, on schedule
        assert wait_for(lambda: samples()[1] >= 3, timeout=15), samples()
        assert samples()[0] == DP * samples()[1]  # every scrape covers every rank
        assert "periodic jobs in this process" in router.log()


# ----- scale-out: Redis + Postgres + a real Celery worker -----------------------------------------
@pytest.fixture
def postgres_db(postgres_server_url):
    name = f"dpmesh_celery_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(f"{postgres_server_url}/postgres", autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield f"{postgres_server_url}/{name}"
    with psycopg.connect(f"{postgres_server_url}/postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def redis_db(redis_url):
    import redis

    redis.Redis.from_url(redis_url).flushdb()
    yield redis_url
    redis.Redis.from_url(redis_url).flushdb()


def query(db_url: str, sql: str, *args):
    with psycopg.connect(db_url) as conn:
        return conn.execute(sql, args).fetchall()


def staff_session(router_url: str, user: str, password: str) -> httpx.Client:
    client = httpx.Client(base_url=router_url, timeout=30)
    page = client.get("/admin/login/")
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text).group(1)
    r = client.post(
        "/admin/login/?next=/dashboard/",
        data={
            "username": user,
            "password": password,
            "csrfmiddlewaretoken": token,
            "next": "/dashboard/",
        },
    )
    assert r.status_code == 302 and r.headers["location"] == "/dashboard/", r.text[:300]
    return client


async def dashboard_snapshots(router_url: str, cookies, seconds: float) -> list[dict]:
    """Snapshots the dashboard websocket pushes within ``seconds`` (logged in by ``cookies``)."""
    import aiohttp

    cookie = "; ".join(f"{name}={value}" for name, value in cookies.items())
    out = []
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(
            router_url.replace("http", "ws") + "/ws/dashboard/",
            headers={"Origin": router_url, "Cookie": cookie},
        ) as ws:
            deadline = asyncio.get_running_loop().time() + seconds
            while (left := deadline - asyncio.get_running_loop().time()) > 0:
                try:
                    message = await ws.receive_json(timeout=left)
                except TimeoutError:
                    break
                if message.get("type") == "snapshot":
                    out.append(message)
    return out


def test_a_real_celery_worker_on_redis_runs_the_jobs(engine, tmp_path, postgres_db, redis_db):
    env = {
        **os.environ,
        "DATABASE_URL": postgres_db,
        "REDIS_URL": redis_db,
        "CONTROL_PLANE_SCRAPE_INTERVAL_S": "1",
        "DJANGO_SUPERUSER_USERNAME": "ops",
        "DJANGO_SUPERUSER_PASSWORD": "celery-test-pw-1",
    }
    port = free_port()
    cmd = router_command(engine.url, port=port)
    # the router's own dashboard timer is slow (30 s): faster pushes can only be the worker's nudges
    router_env = {**env, "CONTROL_PLANE_SCRAPE_INTERVAL_S": "30"}
    with start(cmd, f"http://127.0.0.1:{port}", tmp_path / "router.log", env=router_env) as router:
        assert "periodic jobs on the Celery worker" in router.log()
        send_some(router.url)
        time.sleep(2.5)  # more than two scrape intervals: the router itself must not scrape
        assert query(postgres_db, "SELECT count(*) FROM replicas_ranksample") == [(0,)]

        log = open(tmp_path / "celery.log", "wb")
        worker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "controlplane",
                "worker",
                "--beat",
                "--pool",
                "solo",
                "--loglevel",
                "INFO",
                "--schedule",
                str(tmp_path / "beat-schedule"),
            ],
            cwd=REPO_ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            rows = wait_for(
                lambda: (
                    query(postgres_db, "SELECT count(DISTINCT at) FROM replicas_ranksample")[0][0]
                    >= 2
                ),
                timeout=60,
            )
            assert rows, (tmp_path / "celery.log").read_text()[-3000:]
            m = metrics(engine.url)
            latest = query(
                postgres_db,
                "SELECT r.rank, s.prompt_tokens, s.cached_tokens FROM replicas_ranksample s"
                " JOIN replicas_rank r ON r.id = s.rank_id"
                " WHERE s.at = (SELECT max(at) FROM replicas_ranksample) ORDER BY r.rank",
            )
            assert [(rank, p, c) for rank, p, c in latest] == [
                (r, m[("prompt_tokens", r)], m[("cached_tokens", r)]) for r in range(DP)
            ]

            # every scrape on the worker nudges the router's dashboards through the Redis channel
            # layer
            client = staff_session(router.url, "ops", "celery-test-pw-1")
            snapshots = asyncio.run(dashboard_snapshots(router.url, client.cookies, seconds=5))
            assert len(snapshots) >= 3, len(snapshots)  # one on connect, then one per nudge (~1 s)
            assert snapshots[-1]["workers"][0]["ranks"][0]["engine_prompt_tokens"] is not None

            # the dashboard's on-demand bench: queued through Redis, run by the worker, stored in
            # Postgres
            token = client.cookies["csrftoken"]
            r = client.post(
                "/dashboard/bench",
                json={"dataset": "prefix_repetition", "num_prompts": 15, "max_concurrency": 4},
                headers={"X-CSRFToken": token},
            )
            assert r.status_code == 202, r.text
            run_id = r.json()["id"]
            done = wait_for(
                lambda: (
                    query(postgres_db, "SELECT status FROM routing_benchrun WHERE id = %s", run_id)[
                        0
                    ][0]
                    in ("done", "failed")
                ),
                timeout=120,
            )
            status, result, error = query(
                postgres_db,
                "SELECT status, result, error FROM routing_benchrun WHERE id = %s",
                run_id,
            )[0]
            assert done and status == "done", (
                status,
                error,
                (tmp_path / "celery.log").read_text()[-3000:],
            )
            assert (
                result["completed"] == 15 and result["failed"] == 0 and result["hit_rate"] > 0.3
            ), result
            assert len(result["ttft_ms_series"]) == 15
            # the worker ran it, not the router
            assert "routing.run_bench" in (tmp_path / "celery.log").read_text()
            client.close()
        finally:
            os.killpg(worker.pid, signal.SIGTERM)
            try:
                worker.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait()
