"""Real server processes for tests: start, wait until healthy, read logs, stop."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def start(
    cmd: list[str],
    url: str,
    log_path: Path,
    health: str = "/health",
    timeout: float = 180.0,
    env: dict | None = None,
) -> ServerProcess:
    """Start ``cmd`` (logs to ``log_path``) and wait until ``url + health`` answers 200."""
    log = open(log_path, "wb")
    proc = subprocess.Popen(
        cmd,
        cwd=REPO_ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
        start_new_session=True,
    )
    server = ServerProcess(proc, url, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[:4]} exited with {proc.returncode}:\n{server.log()[-4000:]}")
        try:
            if httpx.get(url + health, timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    server.stop()
    raise RuntimeError(f"{cmd[:4]} not healthy after {timeout}s:\n{server.log()[-4000:]}")


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
