"""The dashboard's backend in-process: the snapshot and its series, the websocket (auth, pushes,
the policy switch), the staff-only views, and the jobs' pure parts (metrics parsing, pruning).
The browser test (tests/routing/test_dashboard_browser.py) drives all of it against real
processes."""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta

import pytest
from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from channels.testing import WebsocketCommunicator
from django.contrib.auth import get_user_model
from django.test import override_settings
from django.utils import timezone

from apps.replicas import jobs as replica_jobs
from apps.replicas.models import Rank, RankSample, Worker, WorkerEvent
from apps.replicas.runtime import SCOPE_KEY
from apps.routing import jobs
from apps.routing.consumers import NOT_AUTHORIZED
from apps.routing.decision.config import RouterConfig
from apps.routing.decision.router import Router
from apps.routing.live import LiveFleet
from apps.routing.models import BenchRun, RoutingSettings
from apps.routing.selectors import build_snapshot, series

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def router():
    return Router(RouterConfig(policy="cache_aware"))


@pytest.fixture
def client(client, router):
    client.defaults[SCOPE_KEY] = LiveFleet(router)  # a WSGI request's environ, as the ASGI scope
    return client


def make_worker(router, dp_size=2, url="http://127.0.0.1:9"):
    worker = Worker.objects.create(
        url=url,
        dp_size=dp_size,
        model_id="tiny",
        server_info={"dp_size": dp_size, "model_id": "tiny"},
    )
    rank_ids = {r: Rank.objects.create(worker=worker, rank=r).id for r in range(dp_size)}
    LiveFleet(router).worker_saved(worker, rank_ids)
    return worker


def sample(rank, at, requests, prompt, cached, up=True):
    return RankSample.objects.create(
        rank=rank,
        at=at,
        requests=requests,
        prompt_tokens=prompt,
        cached_tokens=cached,
        kv_blocks_used=3,
        kv_blocks_total=64,
        up=up,
    )


# ----- snapshot -----------------------------------------------------------------------------------
def test_snapshot_puts_the_engine_and_the_router_side_by_side(router):
    worker = make_worker(router)
    r0, r1 = worker.ranks.order_by("rank")
    now = timezone.now()
    sample(r0, now - timedelta(seconds=2), 4, 400, 100)
    sample(r0, now, 10, 1000, 700)
    sample(r1, now, 2, 200, 0)
    router.stats.dispatched(f"{worker.url}@0", 600, 480)
    router.stats.dispatched(f"{worker.url}@0", 400, 0)
    snap = build_snapshot(router)
    rank0, rank1 = snap["workers"][0]["ranks"]
    assert rank0["key"] == f"{worker.url}@0"
    assert (
        rank0["engine_requests"],
        rank0["engine_prompt_tokens"],
        rank0["engine_cached_tokens"],
    ) == (10, 1000, 700)
    assert rank0["engine_hit_rate"] == pytest.approx(0.7)
    assert (rank0["requests"], rank0["prompt_tokens"], rank0["predicted_tokens"]) == (2, 1000, 480)
    assert rank0["router_hit_rate"] == pytest.approx(0.48)
    assert rank0["gap"] == pytest.approx(0.22)
    assert (rank0["kv_blocks_used"], rank0["kv_blocks_total"]) == (3, 64)
    assert (
        rank1["engine_hit_rate"] == 0.0
        and rank1["router_hit_rate"] is None
        and rank1["gap"] is None
    )
    fleet = snap["fleet"]
    assert (fleet["engine_prompt_tokens"], fleet["engine_cached_tokens"]) == (1200, 700)
    assert fleet["engine_hit_rate"] == pytest.approx(700 / 1200)
    assert snap["policy"] == "cache_aware" and "round_robin" in snap["policies"]
    json.dumps(snap)  # what the websocket sends must be JSON


def test_a_pd_fleet_counts_requests_by_their_prefill_leg_and_shows_the_kv_moved(router):
    """A decode rank reports the same prompt and the prefill side's cached tokens again: the fleet
    totals count each request once (by its prefill leg); each rank shows the KV it moved."""
    roles = {"prefill": "http://127.0.0.1:7", "decode": "http://127.0.0.1:8"}
    workers = {}
    for role, url in roles.items():
        workers[role] = Worker.objects.create(
            url=url, dp_size=1, model_id="tiny",
            server_info={"dp_size": 1, "model_id": "tiny", "disaggregation_mode": role},
        )  # fmt: skip
        rank = Rank.objects.create(worker=workers[role], rank=0)
        LiveFleet(router).worker_saved(workers[role], {0: rank.id})
    now = timezone.now()
    prefill_rank, decode_rank = (workers[r].ranks.get() for r in roles)
    sample(prefill_rank, now, 10, 1000, 600)
    RankSample.objects.filter(rank=prefill_rank).update(kv_bytes_sent=5 * 2**20)
    sample(decode_rank, now, 10, 1000, 600)  # the prefill side's hits, reported again
    RankSample.objects.filter(rank=decode_rank).update(
        kv_blocks_pulled=40, kv_bytes_pulled=4 * 2**20
    )
    router.stats.dispatched(f"{roles['prefill']}@0", 1000, 600)
    router.stats.dispatched(f"{roles['decode']}@0", 1000, 200)  # held before its pulls
    snap = build_snapshot(router)
    rows = {w["role"]: w["ranks"][0] for w in snap["workers"]}
    assert rows["decode"]["role"] == "decode" and rows["decode"]["kv_bytes_pulled"] == 4 * 2**20
    assert rows["decode"]["kv_blocks_pulled"] == 40
    assert rows["prefill"]["kv_bytes_sent"] == 5 * 2**20
    fleet = snap["fleet"]
    assert (fleet["requests"], fleet["prompt_tokens"], fleet["engine_prompt_tokens"]) == (
        1, 1000, 1000)  # fmt: skip
    assert fleet["engine_hit_rate"] == 0.6 and fleet["router_hit_rate"] == 0.6
    assert fleet["kv_bytes_pulled"] == 4 * 2**20


def test_each_rank_says_whether_its_index_is_precise_and_why_not(router):
    """The flag /metrics carries (dpmesh_router_kv_events_precise) is on the dashboard too."""
    from apps.routing.feeds.kv_events import KVEventsFeed
    from apps.routing.feeds.vllm_events import RankDecoder

    worker = make_worker(router)
    feed = KVEventsFeed(router)
    key0, key1 = (t.key for t in router.fleet.targets[worker.id])
    feed.apply_events(key0, [("stored", [1, 2])])  # rank 0's events arrive
    feed.decoders[key1] = RankDecoder(32)
    feed.decoders[key1].mismatch = "vLLM stores blocks of 128 tokens; the router digests 32"
    snap = build_snapshot(router)
    assert snap["workers"][0]["flavour"] == "dpmesh"
    rank0, rank1 = snap["workers"][0]["ranks"]
    assert rank0["precise"] is True
    assert rank1["precise"] is False and "128 tokens" in rank1["kv_events_mismatch"]
    router.observers.remove(feed)
    rank0, _ = build_snapshot(router)["workers"][0]["ranks"]
    assert rank0["precise"] is False  # no KV-event feed: the router's own decisions only


def test_in_flight_counts_every_router_process(router):
    worker = make_worker(router)
    t0 = router.fleet.targets[worker.id][0]
    ticket = t0.load.begin(100, 100)
    t0.load.set_peer("other-process", requests=3, prompt_tokens=900, prefill_tokens=0)
    rank0, rank1 = build_snapshot(router)["workers"][0]["ranks"]
    assert (rank0["inflight_requests"], rank0["inflight_tokens"]) == (4, 1000)
    assert (rank1["inflight_requests"], rank1["inflight_tokens"]) == (0, 0)
    t0.load.end(ticket)


def test_series_are_per_interval_and_survive_an_engine_restart(router):
    worker = make_worker(router, dp_size=1)
    rank = worker.ranks.get()
    t0 = timezone.now() - timedelta(seconds=10)
    for i, (req, prompt, cached) in enumerate(
        [(0, 0, 0), (4, 400, 100), (8, 800, 500), (2, 100, 80)]
    ):
        sample(rank, t0 + timedelta(seconds=2 * i), req, prompt, cached)
    out = series({rank.id: f"{worker.url}@0"}, window_s=60)
    # intervals: +400/+100, +400/+400, then a restart (counters fell): the new values themselves
    assert out["ranks"][f"{worker.url}@0"] == [
        pytest.approx(0.25),
        pytest.approx(1.0),
        pytest.approx(0.8),
    ]
    assert out["fleet"] == out["ranks"][f"{worker.url}@0"]
    assert out["requests_per_s"] == [pytest.approx(2.0), pytest.approx(2.0), pytest.approx(1.0)]
    assert len(out["t"]) == 3


def test_an_interval_without_prompts_or_with_the_engine_down_has_no_rate(router):
    worker = make_worker(router, dp_size=1)
    rank = worker.ranks.get()
    t0 = timezone.now() - timedelta(seconds=10)
    sample(rank, t0, 1, 100, 50)
    sample(rank, t0 + timedelta(seconds=2), 1, 100, 50)  # idle
    sample(rank, t0 + timedelta(seconds=4), 1, 100, 50, up=False)  # down
    assert series({rank.id: "k"}, window_s=60)["ranks"]["k"] == [None, None]


# ----- jobs ---------------------------------------------------------------------------------------
ENGINE_TEXT = """# HELP dpmesh_engine_prompt_tokens_total Prompt tokens
# TYPE dpmesh_engine_prompt_tokens_total counter
dpmesh_engine_prompt_tokens_total{rank="0"} 1000.0
dpmesh_engine_prompt_tokens_total{rank="1"} 50.0
# TYPE dpmesh_engine_cached_tokens_total counter
dpmesh_engine_cached_tokens_total{rank="0"} 700.0
dpmesh_engine_cached_tokens_total{rank="1"} 0.0
# TYPE dpmesh_engine_kv_blocks_total gauge
dpmesh_engine_kv_blocks_total{rank="0"} 64.0
dpmesh_engine_kv_blocks_total{rank="1"} 64.0
# TYPE dpmesh_engine_rank_up gauge
dpmesh_engine_rank_up{rank="1"} 0.0
"""

VLLM_TEXT = """# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 300.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 100.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 120.0
# TYPE vllm:request_success counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 3.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 2.0
"""


def test_engine_metrics_parse_the_kv_a_pd_rank_moved():
    text = """# TYPE dpmesh_engine_kv_transfer_blocks_pulled counter
dpmesh_engine_kv_transfer_blocks_pulled_total{rank="1"} 12.0
# TYPE dpmesh_engine_kv_transfer_bytes_pulled counter
dpmesh_engine_kv_transfer_bytes_pulled_total{rank="1"} 786432.0
# TYPE dpmesh_engine_kv_transfer_bytes_sent counter
dpmesh_engine_kv_transfer_bytes_sent_total{rank="0"} 65536.0
"""
    parsed = replica_jobs.parse_engine_metrics(text)
    assert parsed[1] == {"kv_blocks_pulled": 12.0, "kv_bytes_pulled": 786432.0}
    assert parsed[0] == {"kv_bytes_sent": 65536.0}


def test_engine_metrics_parse_ours_and_vllms():
    ours = replica_jobs.parse_engine_metrics(ENGINE_TEXT)
    assert ours[0] == {"prompt_tokens": 1000.0, "cached_tokens": 700.0, "kv_blocks_total": 64.0}
    assert ours[1]["prompt_tokens"] == 50.0 and ours[1]["rank_up"] == 0.0  # a dead rank process
    vllm = replica_jobs.parse_engine_metrics(VLLM_TEXT)
    assert vllm[0] == {"prompt_tokens": 300.0, "cached_tokens": 120.0, "requests": 5.0}
    assert vllm[1] == {"prompt_tokens": 100.0}


def test_an_engine_that_does_not_answer_gets_a_down_sample_with_its_last_counters(
    router, django_assert_max_num_queries
):
    worker = make_worker(router, dp_size=3, url="http://127.0.0.1:9")  # port 9: nobody listens
    ranks = list(worker.ranks.order_by("rank"))
    now = timezone.now()
    sample(ranks[0], now - timedelta(seconds=2), 7, 700, 300)
    sample(ranks[0], now - timedelta(seconds=4), 6, 600, 200)  # older, written later
    sample(ranks[1], now - timedelta(seconds=9), 1, 10, 5)
    # rank 2 was never sampled: zeros
    # the workers, their ranks, every silent rank's last row in one query, the insert (in its
    # transaction): as many for three silent ranks as for one
    with django_assert_max_num_queries(6):
        assert replica_jobs.scrape_fleet(timeout=1.0) == 3
    latest = [RankSample.objects.filter(rank=r).order_by("-at").first() for r in ranks]
    got = [(s.up, s.requests, s.prompt_tokens, s.cached_tokens, s.kv_blocks_total) for s in latest]
    assert got == [
        (False, 7, 700, 300, 64),
        (False, 1, 10, 5, 64),
        (False, 0, 0, 0, 0),
    ]


@override_settings(CONTROL_PLANE={"SAMPLE_RETENTION_S": 60.0, "EVENT_RETENTION_S": 120.0})
def test_prune_deletes_only_what_is_past_retention(router):
    worker = make_worker(router, dp_size=1)
    rank = worker.ranks.get()
    now = timezone.now()
    sample(rank, now - timedelta(seconds=61), 1, 1, 1)
    keep = sample(rank, now - timedelta(seconds=59), 1, 1, 1)
    old = WorkerEvent.objects.create(worker=worker, kind="healthy")
    WorkerEvent.objects.filter(id=old.id).update(at=now - timedelta(seconds=121))
    WorkerEvent.objects.create(worker=worker, kind="unhealthy")
    assert replica_jobs.prune(now=now) == {"samples": 1, "events": 1}
    assert list(RankSample.objects.values_list("id", flat=True)) == [keep.id]
    assert list(WorkerEvent.objects.values_list("kind", flat=True)) == ["unhealthy"]


# ----- websocket ----------------------------------------------------------------------------------
def _staff():
    return get_user_model().objects.create_user("ops", password="pw-ops-123", is_staff=True)


async def _communicator(router, user=None):
    from controlplane.asgi import build_application

    communicator = WebsocketCommunicator(
        build_application(router),
        "/ws/dashboard/",
        headers=[(b"origin", b"http://127.0.0.1"), (b"host", b"127.0.0.1")],
    )
    if user is not None:  # what channels' AuthMiddleware would find in the session
        communicator.scope["user"] = user
    return communicator


async def test_the_websocket_refuses_anonymous_and_non_staff(router):
    from django.contrib.auth.models import AnonymousUser

    for user in (
        AnonymousUser(),
        await sync_to_async(get_user_model().objects.create_user)("guest", password="x"),
    ):
        communicator = await _communicator(router, user)
        connected, code = await communicator.connect()
        assert not connected and code == NOT_AUTHORIZED
    # no session at all, through the real auth middleware
    communicator = await _communicator(router)
    connected, code = await communicator.connect()
    assert not connected and code == NOT_AUTHORIZED


async def test_the_websocket_pushes_snapshots_and_switches_the_policy(router):
    await sync_to_async(make_worker)(router)
    communicator = await _communicator(router, await sync_to_async(_staff)())
    connected, _ = await communicator.connect()
    assert connected
    first = await communicator.receive_json_from(timeout=5)
    assert first["type"] == "snapshot" and first["policy"] == "cache_aware"
    assert [r["key"] for r in first["workers"][0]["ranks"]] == [
        "http://127.0.0.1:9@0",
        "http://127.0.0.1:9@1",
    ]
    await communicator.send_json_to({"action": "set_policy", "policy": "round_robin"})
    pushed = await communicator.receive_json_from(timeout=5)  # the switch nudges every dashboard
    assert pushed["policy"] == "round_robin" and pushed["policy_updated_by"] == "ops"
    assert router.policy.name == "round_robin"
    assert (await sync_to_async(RoutingSettings.load)()).policy == "round_robin"
    await communicator.send_json_to({"action": "set_policy", "policy": "fastest"})
    error = await communicator.receive_json_from(timeout=5)
    assert error["type"] == "error" and "unknown policy" in error["message"]
    await communicator.send_to(text_data="not json")
    assert (await communicator.receive_json_from(timeout=5))["type"] == "error"
    assert router.policy.name == "round_robin"
    await communicator.disconnect()


# ----- views --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "method,path",
    [
        ("get", "/dashboard/"),
        ("get", "/dashboard/snapshot"),
        ("post", "/dashboard/policy"),
        ("post", "/dashboard/bench"),
    ],
)
def test_dashboard_views_refuse_anonymous(client, router, method, path):
    response = getattr(client, method)(path)
    assert response.status_code == 302 and "/admin/login/" in response["Location"]


def test_dashboard_page_and_policy_switch_for_staff(client, router):
    _staff()
    client.login(username="ops", password="pw-ops-123")
    page = client.get("/dashboard/")
    assert page.status_code == 200 and b"/ws/dashboard/" in page.content
    assert b"routing/vendor/uplot/uPlot.iife.min.js" in page.content  # served by us, no CDN
    assert b"http://" not in page.content.split(b"<body")[0].replace(b"http://www.w3.org", b"")
    r = client.post(
        "/dashboard/policy", json.dumps({"policy": "power_of_two"}), content_type="application/json"
    )
    assert r.status_code == 200 and router.policy.name == "power_of_two"
    r = client.post(
        "/dashboard/policy", json.dumps({"policy": "nope"}), content_type="application/json"
    )
    assert r.status_code == 400 and "unknown policy" in r.json()["error"]["message"]


def test_bench_requests_are_validated(client, router):
    _staff()
    client.login(username="ops", password="pw-ops-123")
    for body, message in [
        ({"dataset": "sharegpt"}, "dataset"),
        ({"num_prompts": 0}, "num_prompts"),
        ({"max_concurrency": "8"}, "max_concurrency"),
        ({"rate": 3}, "unknown"),
        ({"dataset": "multi_turn", "num_prompts": 3}, "multi_turn"),
    ]:
        r = client.post("/dashboard/bench", json.dumps(body), content_type="application/json")
        assert r.status_code == 400 and message in r.json()["error"]["message"], body
    assert not BenchRun.objects.exists()


def test_the_dashboard_needs_a_csrf_token_for_its_actions(router):
    from django.test import Client

    _staff()
    client = Client(enforce_csrf_checks=True, **{SCOPE_KEY: LiveFleet(router)})
    client.login(username="ops", password="pw-ops-123")
    r = client.post(
        "/dashboard/policy", json.dumps({"policy": "random"}), content_type="application/json"
    )
    assert r.status_code == 403 and router.policy.name == "cache_aware"


# ----- nudges from job threads --------------------------------------------------------------------
async def test_nudges_from_job_threads_are_sent_on_the_router_loop_without_waiting():
    """A job thread must not wait on the router's loop: once the loop stops (the process is
    exiting), a waiting thread would keep the interpreter from ever exiting."""
    layer = get_channel_layer()
    channel = await layer.new_channel()
    await layer.group_add(jobs.DASHBOARD_GROUP, channel)
    jobs.notify_on(asyncio.get_running_loop())
    try:
        await asyncio.to_thread(jobs.notify_dashboard, "scraped")
        assert (await asyncio.wait_for(layer.receive(channel), 5))["reason"] == "scraped"
        stopped = asyncio.new_event_loop()  # a loop that no longer runs
        jobs.notify_on(stopped)
        # returns at once
        await asyncio.wait_for(asyncio.to_thread(jobs.notify_dashboard, "scraped"), 5)
        stopped.close()
        await asyncio.wait_for(asyncio.to_thread(jobs.notify_dashboard, "scraped"), 5)
    finally:
        jobs.notify_on(None)
        await layer.group_discard(jobs.DASHBOARD_GROUP, channel)
