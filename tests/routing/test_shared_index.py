"""Several router processes share their prefix-index inserts and load through Redis: a prompt
routed by one process is a predicted hit (and goes to the same rank) when it comes back through
another."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager

import httpx
import pytest

from apps.routing.decision.config import RouterConfig
from apps.routing.decision.router import Router
from apps.routing.feeds import shared_index
from apps.routing.feeds.shared_index import LOAD_TTL_S, IndexSync
from harness.procs import free_port, router_command, start, start_engine, wait_for
from harness.standin import Behaviour, StandIn
from tests.routing.helpers import worker_view
from tests.support.router_checks import counter


@contextmanager
def two_routers(tmp_path, worker_url: str, redis_url: str):
    """Router processes a and b on one database and one Redis (index and load shared), both on
    ``worker_url``; each is stopped on the way out, whichever way the test ends."""
    env = {"DATABASE_URL": f"sqlite:///{tmp_path}/shared.sqlite3", "REDIS_URL": redis_url}
    with ExitStack() as stack:
        routers = []
        for name in ("a", "b"):
            port = free_port()
            cmd = router_command(worker_url, port=port)
            routers.append(
                stack.enter_context(
                    start(cmd, f"http://127.0.0.1:{port}", tmp_path / f"{name}.log", env=env)
                )
            )
        yield routers


def test_apply_takes_other_processes_inserts_for_known_targets_only():
    router = Router(RouterConfig())
    router.fleet.put(worker_view(1, url="http://w1", dp_size=2))
    sync = IndexSync(router, "redis://unused")
    own = json.dumps({"from": sync.origin, "inserts": [["http://w1@0", [1, 2]]]})
    assert sync.apply(own) == 0 and router.index.size("http://w1@0") == 0  # its own echo
    # as it arrives from Redis (what it published itself): skipped before parsing
    echo = shared_index.encode({"from": sync.origin, "inserts": [["http://w1@0", [1, 2]]]})
    assert echo.startswith(sync._own) and sync.apply(echo) == 0
    assert router.index.size("http://w1@0") == 0
    other = json.dumps(
        {
            "from": "elsewhere",
            "inserts": [
                ["http://w1@0", [1, 2, 3]],
                ["http://w9@0", [4]],
                ["http://w1@1", ["x"]],
                "junk",
            ],
        }
    )
    assert sync.apply(other) == 1
    assert router.index.match([1, 2, 3]) == {"http://w1@0": 3}
    assert router.index.size("http://w9@0") == 0  # not installed here (yet): skipped
    assert sync.apply(b"not json") == 0


def test_a_well_formed_message_is_checked_as_it_is_decoded_and_repeats_are_sent_once():
    router = Router(RouterConfig())
    router.fleet.put(worker_view(1, url="http://w1", dp_size=2))
    sync = IndexSync(router, "redis://unused")
    batch = [("http://w1@0", [1, 2]), ("http://w1@0", [1, 2]), ("http://w1@1", [1, 2]),
             ("http://w1@0", [5]), ("http://w1@0", [1, 2])]  # fmt: skip
    # a prompt sent again to the same target is published once, as long as nothing came between
    assert shared_index.same_once(batch) == [batch[0], batch[2], batch[3], batch[4]]
    message = shared_index.encode({"from": "b", "inserts": shared_index.same_once(batch)})
    assert shared_index.decode_message(message).inserts == [
        ("http://w1@0", [1, 2]), ("http://w1@1", [1, 2]), ("http://w1@0", [5]),
        ("http://w1@0", [1, 2]),
    ]  # fmt: skip
    assert sync.apply(message) == 4
    assert router.index.match([1, 2]) == {"http://w1@0": 2, "http://w1@1": 2}
    # a digest that is not an integer (a bool is not either) fails the typed decode: that item
    # alone is skipped, the lenient way
    mixed = shared_index.encode(
        {"from": "b", "inserts": [["http://w1@1", [7, True]], ["http://w1@1", [8, 9]]]}
    )
    assert sync.apply(mixed) == 1 and router.index.match([8, 9]) == {"http://w1@1": 2}
    assert router.index.match([7]) == {}


def test_routing_inserts_are_queued_without_waiting(monkeypatch):
    router = Router(RouterConfig(tokenizer_path=None))
    router.fleet.put(worker_view(1, url="http://w1", dp_size=2, block_size=None))
    sync = IndexSync(router, "redis://unused")
    router.observers.append(sync)
    routed = router.route({"prompt": "x" * 300}, False, None)
    assert [key for key, _ in sync.pending] == [routed.target.key] and sync.wakeup.is_set()


def test_load_snapshots_publish_own_load_and_apply_others():
    router = Router(RouterConfig())
    router.fleet.put(worker_view(1, url="http://w1", dp_size=2))
    t0, t1 = router.fleet.targets[1]
    sync = IndexSync(router, "redis://unused")
    assert sync.load_snapshot() == {}  # idle: nothing to say
    ticket = t0.load.begin(120, 80)
    t1.load.set_peer("elsewhere", 7, 700, 70)  # what others published is never published again
    snapshot = sync.load_snapshot()
    assert list(snapshot) == ["http://w1@0"] and snapshot["http://w1@0"][:4] == [1, 120, 80, 0.0]
    # recent requests decay in real time
    assert snapshot["http://w1@0"][4] == pytest.approx(1.0, abs=0.01)

    own = json.dumps({"from": sync.origin, "load": {"http://w1@1": [5, 5, 5, 0, 0]}})
    assert sync.apply(own) == 0 and t1.load.peer_requests == 7
    other = {
        "from": "b",
        "load": {
            "http://w1@0": [2, 300, 100, 1.5, 2.0],
            "http://w9@0": [1, 1, 1, 0, 0],
            "http://w1@1": [-1, 0, 0, 0, 0],
        },
    }
    assert sync.apply(json.dumps(other)) == 1  # w9 is not installed here; negative counts are junk
    assert (t0.load.inflight, t0.load.inflight_tokens, t0.load.queued_prefill_tokens) == (
        3,
        420,
        180,
    )
    # decays meanwhile
    assert t0.load.active_sessions() == pytest.approx(1.5, rel=1e-3) and sync.load_applied == 1
    assert sync.apply(json.dumps({"from": "b", "load": {}})) == 0  # b's load on w1@0 is over
    assert t0.load.inflight == 1 and "b" in sync.peer_seen

    sync.apply(json.dumps({"from": "b", "load": {"http://w1@1": [4, 40, 0, 0, 0]}}))
    assert sync.expire_peers(time.monotonic() + LOAD_TTL_S / 2) == []
    assert sync.expire_peers(time.monotonic() + LOAD_TTL_S + 1) == ["b"]  # b stopped talking
    assert t1.load.peers.keys() == {"elsewhere"} and t1.load.peer_requests == 7
    t0.load.end(ticket)


@pytest.mark.slow
def test_a_prompt_routed_by_one_router_process_is_a_hit_through_another(tmp_path, redis_url):
    # 208 tokens, 12 blocks each
    prompts = [[p] * 8 + list(range(100 + 10 * p, 300 + 10 * p)) for p in range(4)]
    with start_engine(tmp_path, "--dp-size", "2", "--num-kv-blocks", "256") as engine:
        with two_routers(tmp_path, engine.url, redis_url) as (a, b):
            assert (
                "prefix index and load shared" in a.log()
                and "prefix index and load shared" in b.log()
            )
            ranks = {}
            for i, prompt in enumerate(prompts):
                # pinned, so a spreads them over both ranks (its own choice, one request at a
                # time, would keep them all on the rank it used last)
                r = httpx.post(
                    a.url + "/v1/completions",
                    json={"model": "tiny", "prompt": prompt, "max_tokens": 1,
                          "data_parallel_rank": i % 2},
                    timeout=60,
                )  # fmt: skip
                ranks[i] = r.headers["x-data-parallel-rank"]
            assert ranks == {0: "0", 1: "1", 2: "0", 3: "1"}
            assert wait_for(
                lambda: counter(b.url, "dpmesh_router_index_sync_applied_total") >= len(prompts),
                timeout=5,
            )
            for i, prompt in enumerate(prompts):
                r = httpx.post(
                    b.url + "/v1/completions",
                    json={"model": "tiny", "prompt": prompt, "max_tokens": 1},
                    timeout=60,
                )
                assert r.headers["x-data-parallel-rank"] == ranks[i]  # b sends it where a did
                assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 192
            assert (
                counter(b.url, "dpmesh_router_predicted_cached_tokens_total") == len(prompts) * 192
            )


@pytest.mark.slow
def test_router_processes_balance_the_fleet_together(tmp_path, redis_url):
    """Process a holds two long streams on two of four ranks; process b, which routed none of them,
    sends its own new requests to the two idle ranks. When a stops, b forgets a's load at once."""
    slow = Behaviour(tokens=40, token_interval_s=0.25)  # ~10 s streams
    with StandIn(dp_size=4, model="standin-peers", default=slow).start() as standin:
        with two_routers(tmp_path, standin.url, redis_url) as (a, b):
            opened: queue.Queue[int] = queue.Queue()
            with ThreadPoolExecutor(2) as pool:
                for i in range(2):
                    pool.submit(_hold_stream, a.url, f"long conversation number {i}", opened)
                busy = {opened.get(timeout=30) for _ in range(2)}
                assert len(busy) == 2  # a spread its own two streams
                assert wait_for(
                    lambda: counter(b.url, "dpmesh_router_peer_inflight_requests") == 2, timeout=5
                )
                assert counter(b.url, "dpmesh_router_peers") == 1
                placed = []
                # short answers: b's own load is back to zero before the next one
                for i in range(2):
                    r = httpx.post(
                        b.url + "/v1/completions",
                        timeout=30,
                        json={
                            "model": "standin-peers",
                            "prompt": f"a new question {i}",
                            "max_tokens": 1,
                        },
                    )
                    assert r.status_code == 200, r.text
                    placed.append(int(r.headers["x-data-parallel-rank"]))
                assert not busy & set(placed), (busy, placed)
                assert len(set(placed)) == 2  # and spread over the idle two
                a.stop()  # it says goodbye: b stops counting its load at once, not after LOAD_TTL_S
                assert wait_for(
                    lambda: (
                        (
                            counter(b.url, "dpmesh_router_peers"),
                            counter(b.url, "dpmesh_router_peer_inflight_requests"),
                        )
                        == (0, 0)
                    ),
                    timeout=LOAD_TTL_S / 3,
                )


def _hold_stream(url: str, prompt: str, opened: queue.Queue) -> None:
    """Stream through the router; put the serving rank on ``opened`` at the first event and keep
    reading until the stream ends (or the router goes away)."""
    try:
        with httpx.stream(
            "POST",
            url + "/v1/completions",
            timeout=60,
            json={"model": "standin-peers", "prompt": prompt, "max_tokens": 40, "stream": True},
        ) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            opened.put(int(r.headers["x-data-parallel-rank"]))
            for _ in lines:
                pass
    except httpx.HTTPError:
        pass


def test_a_goodbye_drops_the_peer_at_once():
    router = Router(RouterConfig())
    router.fleet.put(worker_view(1, url="http://w1", dp_size=1))
    sync = IndexSync(router, "redis://unused")
    sync.apply(json.dumps({"from": "b", "load": {"http://w1@0": [2, 20, 0, 0, 0]}}))
    assert sync.peer_seen.keys() == {"b"} and router.fleet.targets[1][0].load.inflight == 2
    sync.apply(json.dumps({"from": "b", "load": {}, "bye": True}))
    assert sync.peer_seen == {} and router.fleet.targets[1][0].load.inflight == 0


def test_the_served_volume_is_shared_so_each_process_evens_out_the_fleets_work():
    """Process a sent rank 0 a long prompt; process b, which sent nothing, sees rank 0 above the
    mean and rank 1 below it from a's load snapshot. An older peer's five-number snapshot still
    counts for load, and a peer that stops takes its volume with it."""
    routers, syncs = [], []
    for _ in range(2):
        router = Router(RouterConfig())
        router.fleet.put(worker_view(1, url="http://w1", dp_size=2))
        routers.append(router)
        syncs.append(IndexSync(router, "redis://unused"))
    a, b = syncs
    routers[0].volume.add("http://w1@0", 3000)
    snapshot = a.load_snapshot()
    assert snapshot == {"http://w1@0": [0, 0, 0, 0.0, 0.0, 3000]}
    assert b.apply(json.dumps({"from": a.origin, "load": snapshot})) == 1
    keys = ["http://w1@0", "http://w1@1"]
    assert routers[1].volume.excess(keys) == pytest.approx({keys[0]: 1.0, keys[1]: -1.0}, abs=1e-3)
    routers[1].volume.add(keys[1], 3000)  # b's own share counts beside a's
    assert routers[1].volume.excess(keys) == pytest.approx({keys[0]: 0.0, keys[1]: 0.0}, abs=1e-3)
    assert b.load_snapshot()[keys[1]][5] == 3000  # b publishes only its own
    assert b.apply(json.dumps({"from": a.origin, "load": {keys[0]: [1, 2, 3, 0, 0]}})) == 1
    assert routers[1].volume.excess(keys) == pytest.approx({keys[0]: -1.0, keys[1]: 1.0}, abs=1e-3)
    assert b.apply(json.dumps({"from": "c", "load": {keys[0]: [0, 0, 0, 0, 0, float("nan")]}})) == 0
    b.apply(json.dumps({"from": a.origin, "load": snapshot}))
    b.apply(json.dumps({"from": a.origin, "load": {}, "bye": True}))
    assert a.origin not in routers[1].volume.peers
    assert routers[1].volume.excess(keys) == pytest.approx({keys[0]: -1.0, keys[1]: 1.0}, abs=1e-3)


def _cpu_ticks(pid: int) -> int:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def _children(pid: int) -> list[int]:
    return [int(c) for c in open(f"/proc/{pid}/task/{pid}/children").read().split()]


def _scrapes(url: str, name: str, times: int = 6) -> set[float]:
    """``name``'s total over ``times`` scrapes, each on a connection of its own (the kernel
    hands each to either worker)."""
    return {counter(url, name) for _ in range(times)}


@pytest.mark.slow
def test_workers_n_accept_on_one_port_and_share_the_fleet(tmp_path, redis_url):
    """``runrouter --workers 2``: two processes on one port, both serving, each counting the
    other as a peer, either answering /metrics for both; a worker killed is forked again and its
    counts stay; SIGINT drains both and the command exits 0."""
    env = {"DATABASE_URL": f"sqlite:///{tmp_path}/workers.sqlite3", "REDIS_URL": redis_url}
    with StandIn(dp_size=4, model="standin-workers").start() as standin:
        port = free_port()
        cmd = router_command(standin.url, "--workers", "2", port=port)
        with start(cmd, f"http://127.0.0.1:{port}", tmp_path / "workers.log", env=env) as router:
            pid = router.proc.pid
            children = _children(pid)
            assert len(children) == 2, children
            assert wait_for(lambda: counter(router.url, "dpmesh_router_peers") == 1, timeout=5)
            before = [_cpu_ticks(pid) for pid in children]
            body = {"model": "standin-workers", "prompt": "hello", "max_tokens": 1}

            def post(i: int) -> int:
                with httpx.Client(timeout=30) as client:  # a connection each: the kernel picks
                    return client.post(router.url + "/v1/completions", json=body).status_code

            with ThreadPoolExecutor(8) as pool:
                statuses = list(pool.map(post, range(240)))
            assert statuses == [200] * 240
            used = [_cpu_ticks(pid) - b for pid, b in zip(children, before, strict=True)]
            assert min(used) > 0.2 * max(used), used  # both took a share of the connections
            for _ in range(4):  # whichever process answers, it counts the other
                assert counter(router.url, "dpmesh_router_peers") == 1
            # and /metrics is the fleet's: both workers' answers, whichever worker is asked
            total = "dpmesh_router_requests_total"
            assert wait_for(lambda: _scrapes(router.url, total) == {240.0}, timeout=10)
            assert _scrapes(router.url, "dpmesh_router_workers") == {2.0}
            # a worker killed is forked again; what it counted stays counted
            os.kill(children[1], signal.SIGKILL)
            assert wait_for(lambda: len(_children(pid)) == 2 and children[1] not in _children(pid))
            assert wait_for(lambda: _scrapes(router.url, "dpmesh_router_workers") == {2.0}, 30)
            with ThreadPoolExecutor(4) as pool:
                assert list(pool.map(post, range(20))) == [200] * 20
            assert wait_for(lambda: _scrapes(router.url, total) == {260.0}, timeout=10), _scrapes(
                router.url, total
            )
            children = _children(pid)
            router.stop()
            assert router.proc.returncode == 0, router.log()[-2000:]
            assert not [pid for pid in children if os.path.exists(f"/proc/{pid}")]


def test_workers_n_without_redis_says_what_it_needs(tmp_path):
    env = {**os.environ, "DATABASE_URL": f"sqlite:///{tmp_path}/w.sqlite3", "REDIS_URL": ""}
    done = subprocess.run(
        [sys.executable, "manage.py", "runrouter", "--workers", "2", "--port", str(free_port())],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode != 0
    assert "--workers 2 needs REDIS_URL" in done.stderr, done.stderr[-2000:]
