"""Real server processes, for the benchmarks and the tests alike: a free port, start a command,
wait until it answers, read its log, stop it (its whole process group if it will not go)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port that was free a moment ago (the OS picks it, so parallel runs do not clash)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    url: str
    log_path: Path
    stop_signal: int = signal.SIGINT  # SIGTERM for one started from a shell's background job

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 15.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(self.stop_signal)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # its rank processes too
                self.proc.wait()

    def kill(self, timeout: float = 30.0) -> None:
        """SIGKILL the whole process group and wait until none of it is left alive: the children
        (vLLM's engine cores, our ranks) outlive the parent by a moment while the kernel tears
        them down, holding their ports, and a restart on the same ports fails until they are
        gone."""
        with contextlib.suppress(ProcessLookupError):  # already gone, all of it
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout)
        deadline = time.monotonic() + timeout
        while group_alive(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def group_alive(pgid: int) -> list[int]:
    """The pids of process group ``pgid`` that are still running (zombies, already dead and only
    waiting to be reaped, are not counted)."""
    alive = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)"
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            alive.append(int(entry.name))
    return alive


def failure_log(log: str, tail: int = 4000) -> str:
    """What a failed start printed: its error lines first (a traceback's last lines hide the
    root cause that vLLM logs above them), then the log's tail."""
    errors = [line for line in log.splitlines() if "Error" in line or "ERROR" in line]
    head = "\n".join(errors[:30])
    return f"error lines:\n{head}\n--- last {tail} characters:\n{log[-tail:]}"


def start(
    cmd: list[str],
    url: str,
    log_path: Path,
    health: str = "/health",
    timeout: float = 180.0,
    env: dict | None = None,
    stop_signal: int = signal.SIGINT,
) -> ServerProcess:
    """Start ``cmd`` (logs to ``log_path``) and wait until ``url + health`` answers 200."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=REPO_ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
    server = ServerProcess(proc, url, log_path, stop_signal)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"{cmd[:4]} exited with {proc.returncode}:\n{failure_log(server.log())}"
            )
        try:
            if httpx.get(url + health, timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    server.stop()
    raise RuntimeError(f"{cmd[:4]} not healthy after {timeout}s:\n{failure_log(server.log())}")
