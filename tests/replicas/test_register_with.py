"""``runengine --register-with ROUTER`` registers the engine with a running router: the router
discovers its ranks and serves through them."""
import sys

import httpx
import pytest

from tests.support.procs import free_port, start, start_engine, wait_for

pytestmark = pytest.mark.slow


def test_engine_registers_itself_with_the_router(tmp_path):
    port = free_port()
    cmd = [sys.executable, "manage.py", "runrouter", "--dp-aware", "--port", str(port)]
    router_url = f"http://127.0.0.1:{port}"
    # no workers yet: the router is up (its /workers answers) but /health is 503
    with start(cmd, router_url, tmp_path / "router.log", health="/workers",
               env={"DATABASE_URL": f"sqlite:///{tmp_path}/router.sqlite3"}) as router:
        assert httpx.get(router.url + "/health").status_code == 503
        with start_engine(tmp_path, "--dp-size", "2", "--num-kv-blocks", "64", "--register-with", router.url) as engine:
            workers = wait_for(lambda: httpx.get(router.url + "/workers").json()["workers"], timeout=30)
            assert [w["url"] for w in workers] == [engine.url]
            assert [t["key"] for t in workers[0]["targets"]] == [f"{engine.url}@0", f"{engine.url}@1"]
            r = httpx.post(router.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 2}, timeout=60)
            assert r.status_code == 200 and r.headers["x-routed-target"].startswith(engine.url + "@")
    assert "registered with router" in engine.log()
