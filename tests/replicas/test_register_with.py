"""``runengine --register-with ROUTER --register-key KEY`` registers the engine with a running
router (whose workers API needs an admin key): the router discovers its ranks and serves through
them. An engine with a wrong key is refused once, says so, and is not listed."""

import argparse

import httpx
import pytest

from engine.server.main import add_arguments, register_key
from harness.procs import free_port, router_command, start, start_engine, wait_for

ADMIN_KEY = "register-test-admin-key"


@pytest.mark.slow
def test_engine_registers_itself_with_the_router(tmp_path):
    port = free_port()
    cmd = router_command(port=port)
    router_url = f"http://127.0.0.1:{port}"
    # no workers yet: the router is up (its /workers answers) but /health is 503
    with start(
        cmd,
        router_url,
        tmp_path / "router.log",
        health="/workers",
        env={
            "DATABASE_URL": f"sqlite:///{tmp_path}/router.sqlite3",
            "CONTROL_PLANE_ADMIN_KEYS": f"other-key,{ADMIN_KEY}",
        },
    ) as router:
        assert httpx.get(router.url + "/health").status_code == 503
        with start_engine(
            tmp_path,
            "--dp-size",
            "1",
            "--num-kv-blocks",
            "64",
            "--register-with",
            router.url,
            "--register-key",
            "wrong-key",
            name="refused",
        ) as refused:
            assert wait_for(lambda: "refused registration" in refused.log(), timeout=30)
            assert "--register-key" in refused.log() and "not retrying" in refused.log()
            assert httpx.get(router.url + "/workers").json() == {"workers": []}
        with start_engine(
            tmp_path,
            "--dp-size",
            "2",
            "--num-kv-blocks",
            "64",
            "--register-with",
            router.url,
            "--register-key",
            ADMIN_KEY,
        ) as engine:
            workers = wait_for(
                lambda: httpx.get(router.url + "/workers").json()["workers"], timeout=30
            )
            assert [w["url"] for w in workers] == [engine.url]
            assert [t["key"] for t in workers[0]["targets"]] == [
                f"{engine.url}@0",
                f"{engine.url}@1",
            ]
            r = httpx.post(
                router.url + "/v1/completions",
                json={"prompt": "hello", "max_tokens": 2},
                timeout=60,
            )
            assert r.status_code == 200 and r.headers["x-routed-target"].startswith(
                engine.url + "@"
            )
    assert "registered with router" in engine.log()
    assert refused.log().count("refused registration") == 1


def test_register_key_defaults_to_the_first_admin_key(monkeypatch):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    monkeypatch.delenv("CONTROL_PLANE_ADMIN_KEYS", raising=False)
    assert register_key(parser.parse_args([])) is None
    monkeypatch.setenv("CONTROL_PLANE_ADMIN_KEYS", " , first, second")
    assert register_key(parser.parse_args([])) == "first"
    assert register_key(parser.parse_args(["--register-key", "flag"])) == "flag"
