"""The README's main command, `manage.py serve`: an engine and a router in one command, the
first admin created from the environment, the dashboard behind it, API keys from its flags."""

from __future__ import annotations

import re
import sys

import httpx
import pytest

from tests.support.procs import free_port, start

pytestmark = pytest.mark.slow


def test_serve_runs_engine_router_and_dashboard(tmp_path):
    port, engine_port = free_port(), free_port()
    env = {
        "DATABASE_URL": f"sqlite:///{tmp_path}/serve.sqlite3",
        "DJANGO_SUPERUSER_USERNAME": "root-ops",
        "DJANGO_SUPERUSER_PASSWORD": "serve-test-pw-1",
        "REDIS_URL": "",
    }
    cmd = [
        sys.executable,
        "manage.py",
        "serve",
        "--port",
        str(port),
        "--engine-port",
        str(engine_port),
        "--dp-size",
        "2",
        "--api-key",
        "sk-serve",
        "--engine-arg=--num-kv-blocks=128",
    ]
    # /health is 200 once the router has discovered the engine and can serve
    with start(
        cmd, f"http://127.0.0.1:{port}", tmp_path / "serve.log", timeout=240, env=env
    ) as serve:
        log = serve.log()
        assert f"Dashboard    http://127.0.0.1:{port}/dashboard/" in log
        assert "admin user 'root-ops' created" in log
        with httpx.Client(base_url=serve.url, timeout=60) as client:
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            assert client.post("/v1/chat/completions", json=body).status_code == 401
            r = client.post(
                "/v1/chat/completions", json=body, headers={"Authorization": "Bearer sk-serve"}
            )
            assert r.status_code == 200 and r.headers["x-data-parallel-rank"] in ("0", "1"), r.text
            targets = client.get("/health").json()["targets"]
            assert sorted(targets) == [
                f"http://127.0.0.1:{engine_port}@0",
                f"http://127.0.0.1:{engine_port}@1",
            ]

            login = client.get("/admin/login/")
            token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', login.text).group(1)
            r = client.post(
                "/admin/login/",
                data={
                    "username": "root-ops",
                    "password": "serve-test-pw-1",
                    "csrfmiddlewaretoken": token,
                    "next": "/dashboard/",
                },
            )
            assert r.status_code == 302 and r.headers["location"] == "/dashboard/"
            page = client.get("/dashboard/")
            assert page.status_code == 200 and "dpmesh control plane" in page.text
            assert client.get("/static/routing/vendor/uplot/uPlot.iife.min.js").status_code == 200
