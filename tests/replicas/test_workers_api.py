"""The workers API and the proxy against a real tiny engine (dp_size 2): discovery through
/server_info, one target per rank, the legacy SGLang endpoints, restore from the database, and
requests that come back with the rank that served them and leave no load behind."""

import asyncio
import json

import httpx
import pytest
from asgiref.testing import ApplicationCommunicator
from django.test import AsyncClient

from apps.replicas.models import Rank, Worker
from apps.replicas.runtime import SCOPE_KEY
from apps.routing.decision.config import RouterConfig
from apps.routing.decision.router import Router
from apps.routing.feeds.fleet_sync import FleetSync
from apps.routing.live import LiveFleet
from apps.routing.process import RouterProcess
from controlplane.asgi import build_application
from harness.procs import free_port, start_engine


async def proxy_post(router, path: str, body: dict) -> httpx.Response:
    """Through the project's real ASGI application (the proxy paths are served before Django)."""
    transport = httpx.ASGITransport(app=build_application(router))
    async with httpx.AsyncClient(
        transport=transport, base_url="http://testserver", timeout=60
    ) as client:
        return await client.post(path, json=body)


pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

CHAT = {
    "messages": [
        {"role": "system", "content": "You answer questions about the Python language."},
        {"role": "user", "content": "What does the yield statement do inside a function body?"},
    ],
    "max_tokens": 2,
    "temperature": 0,
}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    with start_engine(
        tmp_path_factory.mktemp("engine"), "--dp-size", "2", "--num-kv-blocks", "64"
    ) as server:
        yield server


@pytest.fixture
async def router(arouter):
    """These tests run on the event loop: the async flavour (tests/replicas/conftest.py)."""
    return arouter


ADMIN_KEY = "test-admin-key"


@pytest.fixture(autouse=True)
def admin_key(settings):
    """The workers API's mutations need an admin key (apps/replicas/auth.py): configure one."""
    settings.CONTROL_PLANE = {**settings.CONTROL_PLANE, "ADMIN_KEYS": ADMIN_KEY}


class AdminClient(AsyncClient):
    """Sends the admin key with every request (AsyncClient's own ``headers=`` default does not reach
    the ASGI scope in Django 5.2), in the scope a router process gives its requests."""

    def __init__(self, router):
        super().__init__()
        self.router = router

    def _base_scope(self, **request):
        return {**super()._base_scope(**request), SCOPE_KEY: LiveFleet(self.router)}

    def generic(self, *args, headers=None, **kwargs):
        return super().generic(
            *args, headers={"Authorization": f"Bearer {ADMIN_KEY}", **(headers or {})}, **kwargs
        )


@pytest.fixture
def client(router):
    return AdminClient(router)


async def add(client, url, **extra):
    return await client.post(
        "/workers", data=json.dumps({"url": url, **extra}), content_type="application/json"
    )


def keys(router) -> list[str]:
    return sorted(t.key for t in router.fleet.all_targets())


async def test_post_workers_discovers_one_target_per_rank(engine, router, client):
    r = await add(client, engine.url + "/")
    assert r.status_code == 201, r.content
    body = r.json()
    assert (body["url"], body["dp_size"], body["dp_aware"], body["model"]) == (
        engine.url,
        2,
        True,
        "tiny",
    )
    assert [(t["key"], t["rank"], t["circuit"]) for t in body["targets"]] == [
        (f"{engine.url}@0", 0, "closed"),
        (f"{engine.url}@1", 1, "closed"),
    ]
    assert body["server_info"]["dp_size"] == 2 and body["health"] == "healthy"
    assert keys(router) == [f"{engine.url}@0", f"{engine.url}@1"]
    view = router.fleet.workers[body["id"]]
    assert (view.block_size, view.capacity_blocks) == (16, 64)
    assert view.tokenizer_path == body["server_info"]["model_path"]
    assert router.index.capacity == {f"{engine.url}@0": 64, f"{engine.url}@1": 64}
    rows = [(r.rank, r.id) async for r in Rank.objects.filter(worker_id=body["id"])]
    assert rows == [(t.rank, t.rank_id) for t in router.fleet.targets[body["id"]]]
    assert [rank for rank, _ in rows] == [0, 1]


async def test_re_post_updates_instead_of_duplicating(engine, router, client):
    first = (await add(client, engine.url)).json()
    targets = list(router.fleet.targets[first["id"]])
    targets[0].load.begin(10, 10)
    again = await add(client, engine.url + "/")
    assert again.status_code == 201
    assert again.json()["id"] == first["id"]
    assert await Worker.objects.acount() == 1 and await Rank.objects.acount() == 2
    assert router.fleet.targets[first["id"]] == targets  # same objects: load and breakers survive
    assert again.json()["targets"][0]["inflight_requests"] == 1


async def test_get_and_delete_workers(engine, router, client):
    worker_id = (await add(client, engine.url)).json()["id"]
    listed = (await client.get("/workers")).json()["workers"]
    assert [(w["id"], w["url"], w["dp_size"]) for w in listed] == [(worker_id, engine.url, 2)]
    detail = await client.get(f"/workers/{worker_id}")
    assert detail.status_code == 200 and detail.json()["targets"][1]["key"] == f"{engine.url}@1"
    assert (await client.get(f"/workers/{worker_id + 1}")).status_code == 404
    # gives the index something to drop
    routed = router.route({"prompt": list(range(40))}, False, None)
    routed.first_token()  # the time model learns from it, and the worker's detail shows the fit
    routed.finish(ok=True)
    assert router.index.size(routed.target.key) == 2
    timing = (await client.get(f"/workers/{worker_id}")).json()["timing"]
    assert timing["stayed_samples"] == 1.0 and timing["moved_samples"] == 0.0

    r = await client.delete(f"/workers/{worker_id}")
    assert r.status_code == 200 and r.json() == {"deleted": worker_id}
    assert not router.fleet.all_targets() and router.fleet.workers == {}
    assert router.index.ranks == {} and router.index.owners == {} and router.index.capacity == {}
    assert await Worker.objects.acount() == 0 and await Rank.objects.acount() == 0
    assert (await client.delete(f"/workers/{worker_id}")).status_code == 404


async def test_legacy_endpoints(engine, router, client):
    r = await client.post(f"/add_worker?url={engine.url}")
    assert r.status_code == 201 and r.json()["dp_size"] == 2
    assert keys(router) == [f"{engine.url}@0", f"{engine.url}@1"]
    assert (await client.get("/list_workers")).json() == {"urls": [engine.url]}
    r = await client.post(f"/remove_worker?url={engine.url}/")
    assert r.status_code == 200 and r.json() == {"removed": engine.url}
    assert keys(router) == [] and await Worker.objects.acount() == 0
    assert (await client.get("/list_workers")).json() == {"urls": []}
    assert (await client.post(f"/remove_worker?url={engine.url}")).status_code == 404
    assert (await client.get("/add_worker")).status_code == 405


@pytest.mark.parametrize(
    "payload",
    [
        {"url": "ftp://example.com"},
        {"url": "localhost:8000"},
        {},
        {"url": 5},
        {"url": "http://x", "dp_aware": "yes"},
    ],
)
async def test_bad_requests_are_400(router, client, payload):
    r = await client.post("/workers", data=json.dumps(payload), content_type="application/json")
    assert r.status_code == 400
    assert r.json()["error"]["code"] == 400
    assert await Worker.objects.acount() == 0 and keys(router) == []


async def test_bad_json_is_400(router, client):
    r = await client.post("/workers", data=b"{nope", content_type="application/json")
    assert r.status_code == 400


async def test_unreachable_worker_is_502(router, client):
    url = f"http://127.0.0.1:{free_port()}"
    r = await add(client, url)
    assert r.status_code == 502
    assert url in r.json()["error"]["message"]
    assert await Worker.objects.acount() == 0 and keys(router) == []


async def test_dp_unaware_worker_is_one_target_without_rank(engine, router, client):
    r = await add(client, engine.url, dp_aware=False)
    body = r.json()
    assert r.status_code == 201 and body["dp_aware"] is False and body["dp_size"] == 2
    assert [(t["key"], t["rank"]) for t in body["targets"]] == [(engine.url, None)]
    assert [row.rank async for row in Rank.objects.all()] == [None]
    proxied = await proxy_post(router, "/v1/completions", {"prompt": "hello", "max_tokens": 2})
    assert proxied.status_code == 200
    assert proxied.headers["x-routed-target"] == engine.url
    # the engine's own choice, passed on
    assert proxied.headers["x-data-parallel-rank"] in ("0", "1")


async def test_switching_dp_awareness_replaces_targets_and_forgets_old_keys(engine, router, client):
    worker_id = (await add(client, engine.url, dp_aware=False)).json()["id"]
    router.route({"prompt": list(range(40))}, False, None).finish(ok=True)
    assert router.index.size(engine.url) == 2
    body = (await add(client, engine.url, dp_aware=True)).json()
    assert [t["key"] for t in body["targets"]] == [f"{engine.url}@0", f"{engine.url}@1"]
    assert [row.rank async for row in Rank.objects.filter(worker_id=worker_id)] == [0, 1]
    assert engine.url not in router.index.ranks  # no index entries for a target that is gone
    assert engine.url not in router.index.capacity


async def test_fleet_restore_rebuilds_targets_from_the_database(engine, router, client):
    worker_id = (await add(client, engine.url)).json()["id"]
    before = [(t.key, t.rank, t.rank_id) for t in router.fleet.targets[worker_id]]
    restarted = Router(RouterConfig(dp_aware=True))
    assert keys(restarted) == []
    assert await FleetSync(restarted).sync() == 1
    assert [(t.key, t.rank, t.rank_id) for t in restarted.fleet.targets[worker_id]] == before
    assert restarted.index.capacity == {f"{engine.url}@0": 64, f"{engine.url}@1": 64}
    rows = {r.id: r.rank async for r in Rank.objects.filter(worker_id=worker_id)}
    assert rows == {rank_id: rank for _, rank, rank_id in before}


async def test_health_is_503_until_startup_has_restored_the_fleet(engine, router, client):
    """A process that answers /health 200 serves with the fleet and policy it restored, not a
    partial one."""
    from apps.routing.jobs import notify_on

    await add(client, engine.url)
    restarted = Router(RouterConfig(dp_aware=True))
    process = RouterProcess(restarted, [])  # as serve_router builds it before the socket listens
    client = AdminClient(restarted)
    r = await client.get("/health")
    assert (r.status_code, r.json()["status"]) == (503, "starting")
    tasks = await process.start()
    try:
        r = await client.get("/health")
        assert (r.status_code, r.json()["targets"]) == (200, [f"{engine.url}@0", f"{engine.url}@1"])
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        notify_on(None)  # start() pointed dashboard nudges at this test's loop


async def test_proxy_reports_the_rank_and_leaves_no_load(engine, router, client):
    await add(client, engine.url)
    r = await proxy_post(router, "/v1/chat/completions", CHAT)
    assert r.status_code == 200, r.text
    assert r.headers["x-data-parallel-rank"] in ("0", "1")
    assert r.headers["x-routed-target"] == f"{engine.url}@{r.headers['x-data-parallel-rank']}"
    assert r.json()["usage"]["prompt_tokens"] == 43
    served = []
    body = {"prompt": [(11 * i) % 4000 for i in range(600)], "max_tokens": 2, "temperature": 0}
    # the same long prompt twice: the second lands home and hits what the first cached
    for _ in range(2):
        r = await proxy_post(router, "/v1/completions", body)
        assert r.status_code == 200, r.text
        assert r.headers["x-routed-target"] == f"{engine.url}@{r.headers['x-data-parallel-rank']}"
        served.append(
            (
                r.headers["x-routed-target"],
                r.json()["usage"]["prompt_tokens_details"]["cached_tokens"],
            )
        )
    assert served[1] == (served[0][0], 592)  # (600 - 1) // 16 = 37 blocks hit
    stats = router.stats.targets[served[0][0]]
    # the index predicted exactly what the engine hit
    assert stats.predicted_tokens == stats.cached_tokens
    assert stats.completed == stats.requests == stats.reported
    assert all(t.load.idle for t in router.fleet.all_targets())
    assert [t.load.requests for t in router.fleet.all_targets()] == [0, 0]


@pytest.mark.parametrize("include_usage", [False, True])
async def test_streamed_proxy_relays_events_and_leaves_no_load(
    engine, router, client, include_usage
):
    await add(client, engine.url)
    body = {"prompt": "the quick brown fox", "max_tokens": 3, "temperature": 0, "stream": True}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    r = await proxy_post(router, "/v1/completions", body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["x-routed-target"] == f"{engine.url}@{r.headers['x-data-parallel-rank']}"
    text = r.text
    events = [e for e in text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and text.endswith("\n\n")
    payloads = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    usage_only = [p for p in payloads if not p["choices"]]
    assert len(usage_only) == (1 if include_usage else 0)
    assert all(t.load.idle for t in router.fleet.all_targets())
    # usage learned either way
    assert router.stats.targets[r.headers["x-routed-target"]].reported == 1


async def test_proxy_without_workers_is_503(router, client):
    r = await proxy_post(router, "/v1/completions", {"prompt": "x"})
    assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
    assert router.stats.no_target == 1


async def test_client_disconnect_mid_stream_ends_the_load(engine, router, client):
    """The ASGI path a real client takes: read the first event, then disconnect."""
    await add(client, engine.url)
    body = {
        "prompt": "the quick brown fox",
        "max_tokens": 200,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"testserver"), (b"content-type", b"application/json")],
        "client": ("127.0.0.1", 50000),
        "server": ("testserver", 80),
    }
    app = ApplicationCommunicator(build_application(router), scope)
    await app.send_input(
        {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
    )
    start = await app.receive_output(timeout=30)
    assert (start["type"], start["status"]) == ("http.response.start", 200)
    key = dict(start["headers"])[b"x-routed-target"].decode()
    target = next(t for t in router.fleet.all_targets() if t.key == key)
    first = await app.receive_output(timeout=30)
    assert first["body"].startswith(b"data: ") and first["more_body"]
    assert target.load.requests == 1
    await app.send_input({"type": "http.disconnect"})
    await app.wait(timeout=10)
    for _ in range(100):  # the relay's finally runs as its generator is finalized
        if target.load.idle:
            break
        await asyncio.sleep(0.05)
    assert target.load.idle
    stats = router.stats.targets[key]
    assert (stats.requests, stats.completed) == (1, 0)
