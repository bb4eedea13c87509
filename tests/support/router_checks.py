"""Helpers for tests that run the router as a real process: start it (and engines) on chosen
ports, read its /metrics and /health, and take its SSE answers apart."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest

from harness import procs
from harness.procs import ServerProcess, wait_for

ADMIN_KEY = (
    "test-router-admin-key"  # start_router's routers take it for the workers API's mutations
)
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN_KEY}"}

LOAD_GAUGES = (
    "dpmesh_router_inflight_requests",
    "dpmesh_router_inflight_prompt_tokens",
    "dpmesh_router_pending_prefill_tokens",
)


# ----- processes ---------------------------------------------------------------------------------
def start_router(
    tmp: Path, worker_urls: list[str], name: str, *flags: str, env: dict | None = None
) -> ServerProcess:
    """``runrouter --dp-aware`` with its own SQLite database and ``ADMIN_KEY`` as its admin key
    (and ``env`` besides); ready when it answers /metrics (its /health is 503 until some worker
    is up)."""
    env = {
        "DATABASE_URL": f"sqlite:///{tmp / (name + '.sqlite3')}",
        "CONTROL_PLANE_ADMIN_KEYS": ADMIN_KEY,
        **(env or {}),
    }
    return procs.start_router(
        worker_urls, *flags, log_path=tmp / f"{name}.log", health="/metrics", timeout=60, env=env
    )


def start_engine_on(tmp: Path, port: int, dp_size: int, name: str) -> ServerProcess:
    """A tiny-model engine on ``port`` (a router may already be waiting for it there)."""
    cmd = [
        sys.executable,
        "manage.py",
        "runengine",
        "--port",
        str(port),
        "--dp-size",
        str(dp_size),
        "--num-kv-blocks",
        "128",
        "--threads-per-rank",
        "1",
    ]  # the CPUs are shared: never oversubscribe
    return procs.start(cmd, f"http://127.0.0.1:{port}", tmp / f"{name}.log", timeout=240)


def kill_hard(server: ServerProcess) -> None:
    """SIGKILL the server's whole process group (an engine's front and rank processes): no
    goodbye), and wait until none of it is left to hold a port a restart needs."""
    server.kill()


# ----- reading the router and its answers ------------------------------------------------------
def prom(url: str) -> list[tuple[str, dict, float]]:
    """Samples of a Prometheus text page: (name, labels, value)."""
    samples = []
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, value = line.rsplit(" ", 1)
        name, _, rest = head.partition("{")
        labels = (
            dict(part.split("=", 1) for part in rest.rstrip("}").split(",") if part) if rest else {}
        )
        samples.append((name, {k: v.strip('"') for k, v in labels.items()}, float(value)))
    return samples


def router_load(url: str) -> dict[str, dict[str, float]]:
    """{target: {gauge: value}} for the three load gauges."""
    load: dict[str, dict[str, float]] = {}
    for name, labels, value in prom(url):
        if name in LOAD_GAUGES:
            load.setdefault(labels["target"], {})[name] = value
    return load


def counter(url: str, name: str, target: str | None = None) -> float:
    return sum(
        v
        for n, labels, v in prom(url)
        if n == name and (target is None or labels.get("target") == target)
    )


def busy_targets(url: str) -> dict:
    return {t: g for t, g in router_load(url).items() if any(g.values())}


def assert_idle(url: str, timeout: float = 5.0) -> None:
    """Every target's in-flight requests, prompt tokens and pending prefill are back to 0."""
    if not wait_for(lambda: not busy_targets(url), timeout=timeout):
        pytest.fail(f"router load not released: {busy_targets(url)}")


def healthy_targets(url: str) -> list[str]:
    return httpx.get(url + "/health", timeout=5).json()["targets"]


def sse_events(text: str) -> list[str]:
    """The ``data:`` payloads of an SSE body (each event ends with a blank line)."""
    assert text.endswith("\n\n"), f"SSE body does not end with a blank line: {text[-80:]!r}"
    return [e.removeprefix("data: ") for e in text.split("\n\n") if e]


def texts(events: list[str]) -> list[str]:
    out = []
    for e in events:
        if e == "[DONE]":
            continue
        for choice in json.loads(e).get("choices") or []:
            out.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return [t for t in out if t]


def body_for(
    model: str,
    *,
    chat: bool,
    stream: bool,
    max_tokens: int = 4,
    prompt: str = "hello there",
    usage: bool | None = None,
) -> dict:
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if usage is not None:
        body["stream_options"] = {"include_usage": usage}
    return body


def path_for(body: dict) -> str:
    return "/v1/chat/completions" if "messages" in body else "/v1/completions"
