"""Real server processes for tests: the shared helpers (bench/procs.py) plus the engine and its
metrics."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx

from bench.procs import REPO_ROOT, ServerProcess, free_port, start

__all__ = [
    "REPO_ROOT",
    "ServerProcess",
    "free_port",
    "start",
    "start_engine",
    "metrics",
    "wait_for",
]


def start_engine(
    tmp_path: Path, *args: str, name: str = "engine", timeout: float = 240.0
) -> ServerProcess:
    port = free_port()
    cmd = [sys.executable, "manage.py", "runengine", "--port", str(port), *args]
    return start(cmd, f"http://127.0.0.1:{port}", tmp_path / f"{name}.log", timeout=timeout)


def metrics(url: str) -> dict[tuple[str, int], float]:
    """Parse the engine's /metrics into {(family, rank): value} (counters without ``_total``)."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("#") or 'rank="' not in line:
            continue
        name_labels, value = line.rsplit(" ", 1)
        name = name_labels.split("{", 1)[0].removeprefix("dpmesh_engine_").removesuffix("_total")
        rank = int(name_labels.split('rank="', 1)[1].split('"', 1)[0])
        out[(name, rank)] = float(value)
    return out


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.1):
    """Poll ``predicate`` until it returns something truthy; return that or the last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)
