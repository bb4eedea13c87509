"""An engine restarted at the same URL comes back with empty prefix caches: the router notices
the new instance id on its health probe, rediscovers the worker and forgets what its index
believed about it (otherwise it would predict hits the engine no longer has)."""

from __future__ import annotations

import sqlite3

import httpx
import pytest

from harness.procs import free_port, wait_for
from tests.support.router_checks import counter, kill_hard, start_engine_on, start_router

pytestmark = pytest.mark.slow


def complete(router_url: str, prompt: list[int]) -> dict:
    r = httpx.post(
        router_url + "/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": 1},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def test_a_restarted_engine_is_rediscovered_and_its_index_forgotten(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    target = f"{url}@0"
    prompt = list(range(50, 250))  # 12 full blocks
    engine = start_engine_on(tmp_path, port, 1, "first")
    with start_router(tmp_path, [url], "router", "--health-check-interval-secs", "0.5") as router:
        assert wait_for(lambda: httpx.get(router.url + "/health").status_code == 200, timeout=30)
        first_id = httpx.get(url + "/health").json()["instance_id"]
        complete(router.url, prompt)
        assert complete(router.url, prompt)["prompt_tokens_details"]["cached_tokens"] == 192
        predicted = counter(router.url, "dpmesh_router_predicted_cached_tokens_total", target)
        assert predicted == 192 and counter(router.url, "dpmesh_router_index_blocks", target) > 0

        kill_hard(engine)
        with start_engine_on(tmp_path, port, 1, "second"):
            assert httpx.get(url + "/health").json()["instance_id"] != first_id
            assert wait_for(
                lambda: counter(router.url, "dpmesh_router_index_blocks", target) == 0, timeout=15
            ), "the router still believes the restarted engine holds its old blocks"
            assert wait_for(
                lambda: httpx.get(router.url + "/health").status_code == 200, timeout=15
            )
            usage = complete(router.url, prompt)
            # the engine's caches are empty...
            assert usage["prompt_tokens_details"]["cached_tokens"] == 0
            # ...and the router predicted exactly that
            assert (
                counter(router.url, "dpmesh_router_predicted_cached_tokens_total", target)
                == predicted
            )
        with sqlite3.connect(tmp_path / "router.sqlite3") as db:
            kinds = [k for (k,) in db.execute("SELECT kind FROM replicas_workerevent ORDER BY id")]
        assert "restarted" in kinds, kinds
