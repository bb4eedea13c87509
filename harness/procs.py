"""Real server processes, for the benchmarks and the tests alike: a free port, start a command,
wait until it answers, read its log, stop it (its whole process group if it will not go); the
engine and the router as processes (their command lines written once, here), and the engine's
metrics.

Neither ``bench`` nor ``tests`` is imported here: both import this module, so it must not lean on
either."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
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

    def _kill_all(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)  # its process group: its rank processes too

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 15.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(self.stop_signal)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self._kill_all()
                self.proc.wait()

    def kill(self, timeout: float = 30.0) -> None:
        """SIGKILL the whole process group and wait until none of it is left alive: the children
        (vLLM's engine cores, our ranks) outlive the parent by a moment while the kernel tears
        them down, holding their ports, and a restart on the same ports fails until they are
        gone."""
        with contextlib.suppress(ProcessLookupError):  # already gone, all of it
            self._kill_all()
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
    new_session: bool = True,
) -> ServerProcess:
    """Start ``cmd`` (logs to ``log_path``) and wait until ``url + health`` answers 200. It gets
    a process group of its own either way (signals to the caller's group do not reach it; stopping
    it kills its children too). ``new_session``: in a session of its own, too, which with the
    kernel's autogroups (``/proc/sys/kernel/sched_autogroup_enabled``) is also a CPU share of its
    own, as for a process started from a terminal of its own; else in the caller's session and
    CPU share, as processes of one service. What that changes behind vLLM-CPU: docs/benchmarks-
    history.md "Behind vLLM-CPU: vLLM and the router in one CPU share"."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=REPO_ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=new_session,
            process_group=None if new_session else 0,
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


# ----- the engine and the router ---------------------------------------------------------------
def start_engine(
    tmp_path: Path, *args: str, name: str = "engine", timeout: float = 240.0
) -> ServerProcess:
    """``runengine`` on a free port with ``args``, logging to ``tmp_path/<name>.log``."""
    port = free_port()
    cmd = [sys.executable, "manage.py", "runengine", "--port", str(port), *args]
    return start(cmd, f"http://127.0.0.1:{port}", tmp_path / f"{name}.log", timeout=timeout)


def router_command(
    worker_urls: str | Sequence[str] = (),
    *extra: str,
    port: int,
    dp_aware: bool = True,
    policy: str | None = None,
) -> list[str]:
    """The argv of ``manage.py runrouter`` on ``port`` in front of ``worker_urls`` (one URL or
    several; none for a router whose workers register later), then ``extra`` flags as given.

    The one place that spells the router's command line, so a renamed flag is one edit, not one
    per benchmark and test."""
    urls = [worker_urls] if isinstance(worker_urls, str) else list(worker_urls)
    cmd = [sys.executable, "manage.py", "runrouter"]
    if urls:
        cmd += ["--worker-urls", *urls]
    if dp_aware:
        cmd.append("--dp-aware")
    if policy is not None:
        cmd += ["--policy", policy]
    return [*cmd, "--port", str(port), *extra]


def wait_for_prompt_ids(router_url: str, timeout_s: float = 15.0) -> bool:
    """Wait until our router at ``router_url`` sends every vLLM worker of its fleet a completion's
    text prompt as token ids (``GET /workers`` ``prompt_ids``: its check of their ``/tokenize``
    has answered yes); False when ``timeout_s`` passed first (prompts then go as text). A bench
    that compares routers waits for it so as not to time ours sending text."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            workers = httpx.get(router_url + "/workers", timeout=5).json()["workers"]
        except (httpx.HTTPError, ValueError, KeyError):
            workers = None
        vllm = [w for w in workers or () if w.get("flavour") == "vllm"]
        if workers is not None and all(w.get("prompt_ids") for w in vllm):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


def sglang_router_command(
    worker_urls: str | Sequence[str], *extra: str, port: int, policy: str, exe: str | None = None
) -> list[str]:
    """The argv of SGLang's router (``sglang-router launch --dp-aware``: ``exe``, else the one in
    this Python's environment, where requirements.txt installs it) on ``port`` in front of
    ``worker_urls``."""
    exe = exe or shutil.which("sglang-router", path=str(Path(sys.executable).parent))
    if exe is None:
        raise FileNotFoundError("sglang-router is not installed beside this Python")
    urls = [worker_urls] if isinstance(worker_urls, str) else list(worker_urls)
    # its Prometheus exporter on a free port: the default (29000) is taken by any other
    # sglang-router on the host, and it panics on a port in use
    return [
        exe, "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls,
        "--dp-aware", "--policy", policy, "--log-level", "warn",
        "--prometheus-port", str(free_port()), *extra,
    ]  # fmt: skip


def start_router(
    worker_urls: str | Sequence[str],
    *extra: str,
    log_path: Path,
    port: int | None = None,
    policy: str | None = None,
    dp_aware: bool = True,
    health: str = "/health",
    timeout: float = 180.0,
    env: dict | None = None,
) -> ServerProcess:
    """The router of ``router_command`` started on ``port`` (a free one when None) and waited for
    until ``health`` answers 200 (its /health is 503 until some worker is up: a router started
    before its workers waits on /metrics or /workers instead)."""
    port = port or free_port()
    cmd = router_command(worker_urls, *extra, port=port, dp_aware=dp_aware, policy=policy)
    return start(cmd, f"http://127.0.0.1:{port}", log_path, health=health, timeout=timeout, env=env)


# ----- reading and waiting ---------------------------------------------------------------------
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
