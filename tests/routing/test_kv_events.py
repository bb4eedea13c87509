"""The router follows its engines' KV events: its prefix index holds what the engine's cache holds,
so it stops predicting hits for blocks the engine evicted (approximate mode would keep predicting
them until they aged out)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from apps.routing.decision.config import RouterConfig
from apps.routing.decision.fleet import WorkerView
from apps.routing.decision.router import Router
from apps.routing.feeds.kv_events import RELEASE_TAIL_S, KVEventsFeed
from harness.procs import metrics, start_engine, wait_for
from tests.routing.helpers import Clock, worker_view
from tests.support.router_checks import counter, start_router


def feed_with(view: WorkerView) -> tuple[Router, KVEventsFeed]:
    router = Router(RouterConfig())
    router.fleet.put(view)
    return router, KVEventsFeed(router)


def test_snapshots_and_events_become_the_index():
    router, feed = feed_with(worker_view(1, url="http://w1", dp_size=2, kv_events="/kv_events"))
    router.index.insert("http://w1@0", [1, 2, 3])  # what routing inserted before the feed connected
    assert feed.apply(1, {"rank": 0, "snapshot": [1, 2, 9]})
    assert router.index.match([1, 2, 3]) == {"http://w1@0": 2} and router.index.match([9]) == {
        "http://w1@0": 1
    }
    assert feed.apply(
        1, {"rank": 1, "events": [["stored", [1, 2, 3]], ["removed", [2]], ["stored", [2]]]}
    )
    assert router.index.match([1, 2, 3]) == {"http://w1@0": 2, "http://w1@1": 3}
    assert feed.apply(1, {"rank": 0, "events": [["removed", [1]]]})
    assert router.index.match([1, 2]) == {"http://w1@1": 2}
    assert not feed.apply(1, {"rank": 5, "snapshot": [4]})  # no such rank here
    assert not feed.apply(2, {"rank": 0, "snapshot": [4]})  # no such worker
    assert router.index.match([4]) == {} and feed.applied == 3


def test_readers_follow_the_workers_that_offer_events(monkeypatch):
    async def scenario():
        router, feed = feed_with(
            worker_view(1, url="http://w1", dp_size=2, kv_events="/kv_events", instance_id="first")
        )
        # approximate: no events offered
        router.fleet.put(worker_view(2, url="http://w2", dp_size=2))
        # no ranks known
        router.fleet.put(worker_view(3, url="http://w3", dp_aware=False, kv_events="/kv_events"))
        followed = []

        async def follow(worker_id, spec):
            followed.append((worker_id, spec[3]))
            await asyncio.sleep(3600)

        monkeypatch.setattr(feed, "_follow", follow)
        feed.reconcile()
        await asyncio.sleep(0)
        assert followed == [(1, "first")]
        first = feed.readers[1][1]
        feed.reconcile()  # nothing changed: the same reader
        assert feed.readers[1][1] is first
        router.fleet.put(
            worker_view(1, url="http://w1", dp_size=2, kv_events="/kv_events", instance_id="second")
        )
        feed.reconcile()  # the engine restarted: start over from a new snapshot
        await asyncio.sleep(0)
        assert first.cancelled() and followed == [(1, "first"), (1, "second")]
        router.fleet.remove(1)
        feed.reconcile()
        assert feed.readers == {}

    asyncio.run(scenario())


@pytest.mark.slow
def test_the_router_forgets_what_the_engine_evicted(tmp_path):
    with (
        start_engine(tmp_path, "--dp-size", "1", "--num-kv-blocks", "32") as engine,
        start_router(tmp_path, [engine.url], "router") as router,
    ):
        target = f"{engine.url}@0"
        assert wait_for(
            lambda: counter(router.url, "dpmesh_router_kv_events_connected") == 1, timeout=30
        )

        def send(prompt: list[int]) -> tuple[int, float]:
            """(engine-reported cached tokens, router-predicted cached tokens) of one request."""
            before = counter(router.url, "dpmesh_router_predicted_cached_tokens_total", target)
            r = httpx.post(
                router.url + "/v1/completions",
                timeout=60,
                json={"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0},
            )
            assert r.status_code == 200, r.text
            return (
                r.json()["usage"]["prompt_tokens_details"]["cached_tokens"],
                counter(router.url, "dpmesh_router_predicted_cached_tokens_total", target) - before,
            )

        def index_is_the_engines_cache() -> bool:
            m = metrics(engine.url)
            return (
                counter(router.url, "dpmesh_router_index_blocks", target)
                == m[("kv_blocks_cached", 0)] + m[("kv_blocks_used", 0)]
            )

        prompt = [7] * 8 + list(range(100, 192))  # 100 tokens: 6 full blocks, 96 tokens can hit
        assert send(prompt) == (0, 0)
        assert send(prompt) == (96, 96)
        for i in range(3):  # 3 x 13 blocks through a 32-block pool: the first prompt is evicted
            send([i + 1] * 200)
        assert wait_for(index_is_the_engines_cache, timeout=10)
        assert send(prompt) == (0, 0)  # approximate mode would have predicted 96 here
        assert send(prompt) == (96, 96)
        assert wait_for(index_is_the_engines_cache, timeout=10)
        assert counter(router.url, "dpmesh_router_kv_events_applied_total") >= 5


def test_a_removal_racing_a_routed_request_waits_until_it_is_prefilled():
    router, feed = feed_with(worker_view(1, url="http://w1", dp_size=1, kv_events="/kv_events"))
    clock = Clock()
    feed.clock = clock
    key = "http://w1@0"
    feed.apply(1, {"rank": 0, "snapshot": [1, 2, 3, 4]})
    feed.routed(key, [1, 2])  # two requests just routed there need blocks 1 and 2
    feed.routed(key, [1])
    # evicted before they were admitted
    feed.apply(1, {"rank": 0, "events": [["removed", [1, 2, 3]]]})
    assert router.index.match([1, 2]) == {key: 2} and router.index.match([3]) == {}
    feed.apply(1, {"rank": 0, "events": [["stored", [2]]]})  # one of them re-cached block 2
    feed.prefilled(key, [1, 2])
    clock.now += RELEASE_TAIL_S
    assert feed.flush() == 0  # block 1 is still pending for the other request
    feed.prefilled(key, [1])
    assert feed.flush() == 0  # the tail: its stored event may be on its way
    clock.now += RELEASE_TAIL_S
    assert feed.flush() == 1  # not stored again: the removal stands
    assert router.index.match([1]) == {} and router.index.match([2]) == {key: 1}
    assert feed.pending[key] == {} and feed.deferred == {}
    feed.prefilled(key, [7])  # a request that was never pending here changes nothing
    assert feed.pending[key] == {}


def test_routed_requests_are_pending_until_their_first_token_or_their_end():
    router, feed = feed_with(worker_view(1, url="http://w1", dp_size=1, kv_events="/kv_events"))
    feed.apply(1, {"rank": 0, "snapshot": []})
    routed = router.route({"prompt": "x" * 300}, False, None)
    assert feed.pending[routed.target.key] == {d: 1 for d in routed.shape.digests}
    routed.first_token()
    routed.finish(ok=True)  # released once only
    assert feed.pending[routed.target.key] == {}
    failed = router.route({"prompt": "x" * 300}, False, None)
    failed.finish(ok=False)
    assert feed.pending[failed.target.key] == {}
