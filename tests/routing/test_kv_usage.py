"""Each target's KV usage (``Target.kv_usage``), fed from the engines' own /metrics: the scrape job
writes it into ``RankSample`` rows (ours: its block counts; vLLM: ``vllm:kv_cache_usage_perc``
times the capacity discovery found), every router process's ``FleetSync`` reads the latest fresh
sample per rank into its fleet, and the admission control's saturation rule
(``--saturation-kv-usage``) holds new requests while every target is that full.

Real database (pytest-django), a stand-in engine that serves vLLM's metric names over HTTP, and
the router's ASGI app in process."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta

import httpx
import pytest
from asgiref.sync import sync_to_async
from django.utils import timezone

from apps.replicas import jobs as replica_jobs
from apps.replicas.models import Rank, RankSample, Worker
from apps.replicas.services import worker_add
from apps.routing.decision.config import RouterConfig
from apps.routing.decision.router import Router
from apps.routing.feeds.fleet_sync import KV_USAGE_MAX_AGE_S, FleetSync, kv_usage_by_rank
from apps.routing.live import LiveFleet
from apps.routing.models import RoutingSettings
from apps.routing.proxy.admission import make_admission
from apps.routing.proxy.saturation import fleet_saturated
from controlplane import http
from controlplane.asgi import build_application
from harness.standin import StandIn

CAPACITY = 1000  # KV blocks per rank, as vLLM's cache_config_info says


def vllm_metrics(*usage: float) -> str:
    """A vLLM server's /metrics (its names and labels): one DP engine per usage."""
    lines = [
        "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
        "# TYPE vllm:kv_cache_usage_perc gauge",
        *(
            f'vllm:kv_cache_usage_perc{{engine="{e}",model_name="standin"}} {u}'
            for e, u in enumerate(usage)
        ),
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        *(
            f'vllm:num_requests_running{{engine="{e}",model_name="standin"}} {e + 1}.0'
            for e in range(len(usage))
        ),
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
        "# TYPE vllm:cache_config_info gauge",
        *(
            f'vllm:cache_config_info{{block_size="16",cache_dtype="auto",engine="{e}",'
            f'enable_prefix_caching="True",num_gpu_blocks="{CAPACITY}",'
            f'num_gpu_blocks_override="None",prefix_caching_hash_algo="sha256"}} 1.0'
            for e in range(len(usage))
        ),
    ]
    return "\n".join(lines) + "\n"


OURS = """# TYPE dpmesh_engine_kv_blocks_used gauge
dpmesh_engine_kv_blocks_used{rank="0"} 3.0
# TYPE dpmesh_engine_kv_blocks_total gauge
dpmesh_engine_kv_blocks_total{rank="0"} 64.0
"""


# ----- the scrape ---------------------------------------------------------------------------------
def test_vllms_usage_fraction_becomes_blocks_of_the_capacity_discovery_found():
    parsed = replica_jobs.parse_engine_metrics(vllm_metrics(0.25, 0.75), CAPACITY)
    assert parsed == {
        0: {"running": 1.0, "kv_blocks_used": 250.0, "kv_blocks_total": 1000.0},
        1: {"running": 2.0, "kv_blocks_used": 750.0, "kv_blocks_total": 1000.0},
    }
    assert (
        replica_jobs.parse_engine_metrics(vllm_metrics(0.3337), CAPACITY)[0]["kv_blocks_used"]
        == 334
    )
    # no known capacity: no block counts at all (a total of 0 reads as unknown), not a guess
    assert replica_jobs.parse_engine_metrics(vllm_metrics(0.25)) == {0: {"running": 1.0}}
    # an engine that counts its own blocks (ours) keeps its counts, whatever capacity is given
    assert replica_jobs.parse_engine_metrics(OURS, CAPACITY) == {
        0: {"kv_blocks_used": 3.0, "kv_blocks_total": 64.0}
    }


@pytest.fixture
def vllm_standin():
    """A stand-in that discovery takes for a 2-rank vLLM (no /server_info; vLLM's /metrics)."""
    engine = StandIn(dp_size=2, server_info=False, metrics_text=vllm_metrics(0.25, 0.75)).start()
    yield engine
    engine.stop()


def latest_samples() -> dict:
    rows = RankSample.objects.select_related("rank").order_by("at", "id")
    return {r.rank.rank: (r.up, r.kv_blocks_used, r.kv_blocks_total) for r in rows}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("dp_aware", [True, False])
async def test_the_scrape_records_a_vllm_ranks_blocks_used_and_total(vllm_standin, dp_aware):
    worker = await worker_add(url=vllm_standin.url, dp_aware=dp_aware)
    info = worker.server_info
    assert (info["flavour"], info["dp_size"], info["num_kv_blocks_per_rank"]) == (
        "vllm",
        2,
        CAPACITY,
    )
    try:
        assert await sync_to_async(replica_jobs.scrape_fleet)() == (2 if dp_aware else 1)
        if dp_aware:  # one sample per DP rank
            assert await sync_to_async(latest_samples)() == {
                0: (True, 250, 1000),
                1: (True, 750, 1000),
            }
        else:  # the worker as one target: its ranks' blocks added up
            assert await sync_to_async(latest_samples)() == {None: (True, 1000, 2000)}
    finally:
        await http.client.aclose()


# ----- FleetSync ----------------------------------------------------------------------------------
def make_worker(dp_size: int) -> tuple[Worker, dict]:
    worker = Worker.objects.create(
        url="http://127.0.0.1:9",
        dp_size=dp_size,
        model_id="m",
        server_info={"dp_size": dp_size, "model_id": "m", "flavour": "vllm"},
    )
    return worker, {r: Rank.objects.create(worker=worker, rank=r).id for r in range(dp_size)}


def add_sample(rank_id: int, age_s: float, used: int, total: int = 100, up: bool = True):
    return RankSample.objects.create(
        rank_id=rank_id,
        at=timezone.now() - timedelta(seconds=age_s),
        kv_blocks_used=used,
        kv_blocks_total=total,
        up=up,
    )


@pytest.mark.django_db(transaction=True)
async def test_fleet_sync_sets_each_targets_kv_usage_from_its_ranks_latest_fresh_sample():
    worker, rank_ids = await sync_to_async(make_worker)(5)
    for rank, age, used, total, up in [
        (0, 10, 90, 100, True),
        (0, 1, 40, 100, True),  # rank 0: the latest counts, not the fuller one before
        (1, 10, 50, 100, True),
        (1, 1, 50, 100, False),  # rank 1: its engine did not answer the latest scrape
        (2, KV_USAGE_MAX_AGE_S + 5, 80, 100, True),  # rank 2: nothing scraped it lately
        (3, 1, 0, 0, True),  # rank 3: its capacity is unknown
        (4, 1, 120, 100, True),  # rank 4: more than its capacity says: full, not more
    ]:
        await sync_to_async(add_sample)(rank_ids[rank], age, used, total, up)
    # without the saturation rule nothing reads the KV usage: a sync does not query it
    unread = Router(RouterConfig(dp_aware=True))
    await FleetSync(unread).sync()
    assert [t.kv_usage for t in unread.fleet.all_targets()] == [None] * 5
    router = Router(RouterConfig(dp_aware=True, saturation_kv_usage=0.9))
    fleet_sync = FleetSync(router)
    await fleet_sync.sync()
    targets = {t.rank: t for t in router.fleet.all_targets()}
    assert {rank: t.rank_id for rank, t in targets.items()} == rank_ids
    assert {rank: t.kv_usage for rank, t in targets.items()} == {
        0: 0.4,
        1: None,
        2: None,
        3: None,
        4: 1.0,
    }

    # the next scrape: rank 2 is back, rank 0 went quiet (down), rank 1 answers again
    await sync_to_async(add_sample)(rank_ids[2], 0, 30)
    await sync_to_async(add_sample)(rank_ids[0], 0, 40, up=False)
    await sync_to_async(add_sample)(rank_ids[1], 0, 95)
    await fleet_sync.sync()
    assert {rank: t.kv_usage for rank, t in targets.items()} == {
        0: None,
        1: 0.95,
        2: 0.3,
        3: None,
        4: 1.0,
    }
    assert all(t is targets[t.rank] for t in router.fleet.all_targets())  # the same targets


@pytest.mark.django_db(transaction=True)
def test_the_latest_samples_come_in_one_query_and_age_out_past_the_bound(
    django_assert_num_queries, settings
):
    worker, rank_ids = make_worker(8)
    newest = {rank_id: add_sample(rank_id, 0, 10 * rank) for rank, rank_id in rank_ids.items()}
    for rank_id in rank_ids.values():
        add_sample(rank_id, 5, 99)  # older ones: not read into the answer
    at = newest[rank_ids[0]].at
    with django_assert_num_queries(1):
        usage = kv_usage_by_rank(rank_ids.values())
    assert usage == {rank_id: rank / 10 for rank, rank_id in rank_ids.items()}
    assert kv_usage_by_rank([rank_ids[3]]) == {rank_ids[3]: 0.3}  # only those asked for
    with django_assert_num_queries(0):
        assert kv_usage_by_rank([]) == {}
    # fresh up to the bound, unknown past it
    inside = at + timedelta(seconds=KV_USAGE_MAX_AGE_S - 1)
    outside = at + timedelta(seconds=KV_USAGE_MAX_AGE_S + 1)
    assert len(kv_usage_by_rank(rank_ids.values(), now=inside)) == 8
    assert kv_usage_by_rank(rank_ids.values(), now=outside) == {}
    # scraping less often than every 10 s: the bound is three scrape intervals
    settings.CONTROL_PLANE = {**settings.CONTROL_PLANE, "SCRAPE_INTERVAL_S": 20.0}
    assert len(kv_usage_by_rank(rank_ids.values(), now=outside)) == 8
    assert kv_usage_by_rank(rank_ids.values(), now=at + timedelta(seconds=61)) == {}


@pytest.mark.django_db(transaction=True)
def test_a_sync_reads_the_database_in_one_trip_and_the_kv_usage_only_for_the_saturation_rule(
    django_assert_num_queries,
):
    make_worker(4)
    RoutingSettings.load()  # (created once, as the router's start does)
    plain = FleetSync(Router(RouterConfig(dp_aware=True)))
    with django_assert_num_queries(2):  # the workers, their ranks
        policy, rows, usage = plain._read(adopt_policy=False)
    assert policy is None and len(rows) == 1 and usage is None
    with django_assert_num_queries(3):  # and the recorded policy
        policy, _, _ = plain._read(adopt_policy=True)
    assert policy == RoutingSettings.load().policy
    saturation = FleetSync(Router(RouterConfig(dp_aware=True, saturation_kv_usage=0.9)))
    with django_assert_num_queries(3):  # and every rank's latest sample, in one query
        _, _, usage = saturation._read(adopt_policy=False)
    assert usage == {}  # nothing scraped yet


# ----- end to end: the saturation rule ------------------------------------------------------------
BODY = {"model": "standin", "prompt": "admit me", "max_tokens": 2}


@pytest.mark.django_db(transaction=True)
async def test_a_vllm_fleet_full_by_its_metrics_holds_new_requests_until_a_scrape_says_room(
    vllm_standin,
):
    engine = vllm_standin
    router = Router(
        RouterConfig(
            dp_aware=True, policy="round_robin", saturation_kv_usage=0.9, queue_timeout_s=10
        )
    )
    await worker_add(url=engine.url, runtime=LiveFleet(router))
    fleet_sync = FleetSync(router)  # what every router process runs every 2 s
    admission = make_admission(router)
    transport = httpx.ASGITransport(app=build_application(router, admission))
    client = httpx.AsyncClient(transport=transport, base_url="http://localhost", timeout=30)

    async def scrape_and_sync(*usage: float) -> list:
        engine.metrics_text = vllm_metrics(*usage)
        await sync_to_async(replica_jobs.scrape_fleet)()
        await fleet_sync.sync()
        return [t.kv_usage for t in router.fleet.all_targets()]

    try:
        await fleet_sync.sync()
        assert [t.kv_usage for t in router.fleet.all_targets()] == [None, None]  # not scraped
        assert (await client.post("/v1/completions", json=BODY)).status_code == 200
        assert await scrape_and_sync(0.5, 0.97) == [0.5, 0.97]
        assert not fleet_saturated(router.fleet, 0, 0.9)  # rank 0 has room
        assert (await client.post("/v1/completions", json=BODY)).status_code == 200

        assert await scrape_and_sync(0.95, 0.97) == [0.95, 0.97]
        assert fleet_saturated(router.fleet, 0, 0.9)
        started = time.monotonic()
        held = asyncio.ensure_future(client.post("/v1/completions", json=BODY))
        await asyncio.sleep(0.5)
        assert not held.done() and admission.waiting == 1
        assert len(engine.received) == 2  # it never reached the engine

        # scraped, not applied yet: a router process follows the database only when it syncs
        engine.metrics_text = vllm_metrics(0.95, 0.5)
        await sync_to_async(replica_jobs.scrape_fleet)()
        await asyncio.sleep(0.2)
        assert not held.done()
        await fleet_sync.sync()
        answer = await asyncio.wait_for(held, 5)
        waited = time.monotonic() - started
    finally:
        await client.aclose()
        await http.client.aclose()
    assert answer.status_code == 200, answer.text
    assert len(engine.received) == 3
    assert [t.kv_usage for t in router.fleet.all_targets()] == [0.95, 0.5]
    assert admission.wait_time.count == 3 and admission.wait_time.sum >= 0.6
    assert waited >= 0.7
    assert (admission.in_flight, admission.waiting) == (0, 0)
    admission.check_integrity()
