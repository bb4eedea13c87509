"""The README's main commands: `manage.py serve` (an engine and a router in one command, the
first admin created from the environment, the dashboard behind it, API keys from its flags),
then the README's `manage.py bench` line against it, read from README.md itself so the two
cannot drift apart. One server for the module: it takes half a minute to start."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import httpx
import pytest

from harness.procs import REPO_ROOT, free_port, start

pytestmark = pytest.mark.slow

API_KEY = "sk-serve"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(the serve process, its port, its engine's port), started once for the module's tests."""
    tmp_path = tmp_path_factory.mktemp("serve")
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
        API_KEY,
        "--engine-arg=--num-kv-blocks=128",
    ]
    # /health is 200 once the router has discovered the engine and can serve
    with start(
        cmd, f"http://127.0.0.1:{port}", tmp_path / "serve.log", timeout=240, env=env
    ) as serve:
        yield serve, port, engine_port


def test_serve_runs_engine_router_and_dashboard(served):
    serve, port, engine_port = served
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


def readme_command(program: str) -> list[str]:
    """The README's ``.venv/bin/python <program> ...`` command line (``manage.py bench``), its
    continuation lines joined, as argv."""
    text = (REPO_ROOT / "README.md").read_text().replace("\\\n", " ")
    start = f".venv/bin/python {program} "
    lines = [line for line in text.splitlines() if line.startswith(start)]
    assert len(lines) == 1, f"README.md has {len(lines)} command lines starting {start!r}"
    return shlex.split(lines[0], comments=True)


def test_the_readme_bench_command_runs_against_serve(served):
    """A newcomer's second command: the README's benchmark line, as written but for the port,
    against what `manage.py serve` started. A router has no /server_info, so the tokenizer comes
    from its workers (bench.cli's discovery); the key comes from the environment, as vLLM's."""
    serve, _, _ = served
    argv = readme_command("manage.py bench")
    argv[0] = sys.executable
    argv[argv.index("--base-url") + 1] = serve.url
    done = subprocess.run(
        argv,
        cwd=REPO_ROOT,
        env={**os.environ, "OPENAI_API_KEY": API_KEY},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    prompts = argv[argv.index("--num-prompts") + 1]
    assert re.search(rf"Successful requests:\s+{prompts}\n", done.stdout), done.stdout
    assert "Hit rate (cached / prompt tokens):" in done.stdout, done.stdout
