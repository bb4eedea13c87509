"""Several router processes share their prefix-index inserts through Redis: a prompt routed by
one process is a predicted hit (and goes to the same rank) when it comes back through another."""
from __future__ import annotations

import json
import sys

import httpx
import pytest

from apps.routing.router import Router, RouterConfig
from apps.routing.shared_index import IndexSync
from tests.routing.helpers import worker_view
from tests.support.procs import free_port, start, start_engine, wait_for
from tests.support.router_checks import counter


def test_apply_takes_other_processes_inserts_for_known_targets_only():
    router = Router(RouterConfig())
    router.fleet.put(worker_view(1, url="http://w1", dp_size=2))
    sync = IndexSync(router, "redis://unused")
    own = json.dumps({"from": sync.origin, "inserts": [["http://w1@0", [1, 2]]]})
    assert sync.apply(own) == 0 and router.index.size("http://w1@0") == 0  # its own echo
    other = json.dumps({"from": "elsewhere", "inserts": [["http://w1@0", [1, 2, 3]], ["http://w9@0", [4]],
                                                         ["http://w1@1", ["x"]], "junk"]})
    assert sync.apply(other) == 1
    assert router.index.match([1, 2, 3]) == {"http://w1@0": 3}
    assert router.index.size("http://w9@0") == 0  # not installed here (yet): skipped
    assert sync.apply(b"not json") == 0


def test_routing_inserts_are_queued_without_waiting(monkeypatch):
    router = Router(RouterConfig(tokenizer_path=None))
    router.fleet.put(worker_view(1, url="http://w1", dp_size=2, block_size=None))
    sync = IndexSync(router, "redis://unused")
    router.index_listeners.append(sync.on_insert)
    routed = router.route({"prompt": "x" * 300}, False, None)
    assert [key for key, _ in sync.pending] == [routed.target.key] and sync.wakeup.is_set()


@pytest.mark.slow
def test_a_prompt_routed_by_one_router_process_is_a_hit_through_another(tmp_path, redis_url):
    prompts = [[p] * 8 + list(range(100 + 10 * p, 300 + 10 * p)) for p in range(4)]  # 208 tokens, 12 blocks each
    with start_engine(tmp_path, "--dp-size", "2", "--num-kv-blocks", "256") as engine:
        env = {"DATABASE_URL": f"sqlite:///{tmp_path}/shared.sqlite3", "REDIS_URL": redis_url}
        routers = []
        try:
            for name in ("a", "b"):
                port = free_port()
                cmd = [sys.executable, "manage.py", "runrouter", "--worker-urls", engine.url, "--dp-aware",
                       "--port", str(port)]
                routers.append(start(cmd, f"http://127.0.0.1:{port}", tmp_path / f"{name}.log", env=env))
            a, b = routers
            assert "prefix index shared" in a.log() and "prefix index shared" in b.log()
            ranks = {}
            for i, prompt in enumerate(prompts):
                r = httpx.post(a.url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1},
                               timeout=60)
                ranks[i] = r.headers["x-data-parallel-rank"]
            assert len(set(ranks.values())) == 2  # spread over both ranks by a
            assert wait_for(lambda: counter(b.url, "dpmesh_router_index_sync_applied_total") >= len(prompts), timeout=5)
            for i, prompt in enumerate(prompts):
                r = httpx.post(b.url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1},
                               timeout=60)
                assert r.headers["x-data-parallel-rank"] == ranks[i]  # b sends it where a did
                assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 192
            assert counter(b.url, "dpmesh_router_predicted_cached_tokens_total") == len(prompts) * 192
        finally:
            for router in routers:
                router.stop()
