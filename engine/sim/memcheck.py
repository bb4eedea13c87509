"""``python -m engine.sim.memcheck``: how much memory a simulated engine takes at DP N.

Starts ``manage.py runengine --simulate PROFILE --dp-size N`` on a free port, sends every rank a
few requests (pinned with ``data_parallel_rank``, all at once), then prints the resident memory
(RSS, and PSS, which counts shared pages once) of the front and of its rank processes, and the
total. A script, not a timed test: the number is what docs/benchmarks.md records.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil

REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(args, port: int, log) -> subprocess.Popen:
    cmd = [sys.executable, "manage.py", "runengine", "--simulate", args.profile]
    cmd += ["--dp-size", str(args.dp_size), "--port", str(port), *args.engine_arg]
    proc = subprocess.Popen(
        cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    deadline = time.monotonic() + args.startup_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"runengine exited with {proc.returncode}; see {log.name}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop(proc)
    raise SystemExit(f"runengine not healthy after {args.startup_timeout} s; see {log.name}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def load(url: str, dp_size: int, per_rank: int, max_tokens: int) -> int:
    """Send ``per_rank`` requests to every rank at once; returns how many succeeded."""
    prompt = "a prompt long enough to fill a few KV blocks " * 8

    def one(i: int) -> bool:
        body = {"prompt": prompt, "max_tokens": max_tokens, "data_parallel_rank": i % dp_size}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
        return r.status_code == 200 and r.json()["usage"]["completion_tokens"] == max_tokens

    with ThreadPoolExecutor(max_workers=min(64, dp_size * per_rank)) as pool:
        return sum(pool.map(one, range(dp_size * per_rank)))


def memory(pid: int) -> tuple[list[tuple[str, int, int]], int, int]:
    """(name, rss, pss) of ``pid`` and each of its descendants, and the RSS and PSS totals."""
    root = psutil.Process(pid)
    rows = []
    for proc in [root, *root.children(recursive=True)]:
        try:
            info = proc.memory_full_info()
        except psutil.Error:
            continue
        rows.append((_role(proc, pid), info.rss, getattr(info, "pss", info.rss)))
    return rows, sum(r[1] for r in rows), sum(r[2] for r in rows)


def _role(proc: psutil.Process, front_pid: int) -> str:
    if proc.pid == front_pid:
        return "front"
    cmdline = " ".join(proc.cmdline())
    if "resource_tracker" in cmdline:
        return "tracker"  # multiprocessing's helper, started with the first spawned rank
    return "rank" if "spawn_main" in cmdline else "other"


def report(rows, rss: int, pss: int, dp_size: int) -> None:
    mib = 2**20
    for role, r, p in rows:
        if role in ("front", "tracker", "other"):
            print(f"{role + ':':<8}RSS {r / mib:7.1f} MiB  PSS {p / mib:7.1f} MiB")
    ranks = [row for row in rows if row[0] == "rank"]
    if ranks:
        mean_rss = sum(r[1] for r in ranks) / len(ranks) / mib
        mean_pss = sum(r[2] for r in ranks) / len(ranks) / mib
        print(
            f"ranks:  {len(ranks)} processes (dp_size {dp_size}), mean RSS {mean_rss:.1f} MiB, "
            f"mean PSS {mean_pss:.1f} MiB"
        )
    print(f"total:  RSS {rss / mib:7.1f} MiB  PSS {pss / mib:7.1f} MiB")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default="h100-llama3.1-8b")
    parser.add_argument("--dp-size", type=int, default=32)
    parser.add_argument("--requests-per-rank", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument(
        "--engine-arg", action="append", default=[], help="extra runengine flag (repeatable)"
    )
    parser.add_argument(
        "--log",
        default=os.path.join(tempfile.gettempdir(), "memcheck-engine.log"),
        help="the engine's log file (default: in the temp directory)",
    )
    args = parser.parse_args(argv)
    port = free_port()
    with open(args.log, "wb") as log:
        started = time.monotonic()
        proc = start(args, port, log)
        print(
            f"runengine --simulate {args.profile} --dp-size {args.dp_size}: healthy after "
            f"{time.monotonic() - started:.1f} s"
        )
        try:
            url = f"http://127.0.0.1:{port}"
            started = time.monotonic()
            ok = load(url, args.dp_size, args.requests_per_rank, args.max_tokens)
            total = args.dp_size * args.requests_per_rank
            print(
                f"{ok}/{total} requests of {args.max_tokens} tokens each in "
                f"{time.monotonic() - started:.1f} s"
            )
            rows, rss, pss = memory(proc.pid)
            report(rows, rss, pss, args.dp_size)
        finally:
            stop(proc)
    return 0 if ok == total else 1


if __name__ == "__main__":
    sys.exit(main())
