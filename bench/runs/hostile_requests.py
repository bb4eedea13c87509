"""What a hostile or careless client costs the router: huge prompts, trickled bodies, headers
that never end, while ordinary requests go on.

In front of a real engine (``runengine --model tiny --dp-size 2``), through ``runrouter
--dp-aware``, each phase in turn:

- ``--huge`` concurrent completions of ``--huge-mb`` MB prompts (words), then ``--large``
  concurrent ones of ``--large-mb`` MB: each one's status and time to its answer;
- ``--trickle`` clients that send a body one byte every ``--trickle-interval-s`` seconds, and as
  many that send a request line and headers but never finish them: how long until the router
  closes each, and whether it answered anything;
- all the while, one ordinary completion at a time: how many were served (200) and their worst
  latency;
- the router's RSS (from /proc) idle before, at its peak, and idle after (``--settle-s`` after the
  last hostile request ended), and its CPU seconds over each phase.

::

    .venv/bin/python -m bench.runs.hostile_requests [--huge 5 --huge-mb 15] \\
        [--large 20 --large-mb 1] [--server daphne|uvicorn]

Numbers, not assertions: docs/benchmarks.md, "Hostile requests".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.runs.routers_at_fleet_scale import cpu_seconds
from harness.procs import start_engine, start_router


def rss_mb(pid: int) -> float:
    """Resident MB of ``pid`` and its children (the router is one process; children: none)."""
    total = 0
    for p in [pid, *children(pid)]:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def children(pid: int) -> list[int]:
    try:
        out = []
        for tid in Path(f"/proc/{pid}/task").iterdir():
            text = (tid / "children").read_text().split()
            out += [int(c) for c in text]
        return out
    except OSError:
        return []


def body_of(mb: float, i: int) -> bytes:
    words = int(mb * 2**20 / 6)  # "word " and a digit: ~6 bytes a word
    prompt = f"hostile {i} " + " ".join(f"w{k % 10}" for k in range(words))
    return json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 2}).encode()


async def huge(url: str, bodies: list[bytes]) -> list[tuple[int, float]]:
    """(status, seconds to the answer) of concurrent completions of ``bodies``."""
    async with httpx.AsyncClient(timeout=300) as client:

        async def one(body: bytes) -> tuple[int, float]:
            t0 = time.perf_counter()
            try:
                r = await client.post(
                    url + "/v1/completions", content=body,
                    headers={"content-type": "application/json"},
                )  # fmt: skip
                return r.status_code, time.perf_counter() - t0
            except httpx.HTTPError as exc:  # the router closed the connection before answering
                return type(exc).__name__, time.perf_counter() - t0

        return await asyncio.gather(*(one(b) for b in bodies))


async def trickle(host: str, port: int, interval_s: float, give_up_s: float, headers_only: bool):
    """(seconds until the router closed the connection or None, what it answered first)."""
    reader, writer = await asyncio.open_connection(host, port)
    body = json.dumps({"prompt": "slow " * 200, "max_tokens": 2}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n"
    ).encode()
    t0 = time.perf_counter()
    try:
        if headers_only:
            writer.write(head)  # the blank line that ends the headers never comes
            pending = b"X-Slow: 1\r\n" * 10_000
        else:
            writer.write(head + b"\r\n")
            pending = body
        await writer.drain()
        for k in range(len(pending)):
            if time.perf_counter() - t0 > give_up_s:
                return None, b""
            try:
                answer = await asyncio.wait_for(reader.read(200), interval_s)
                return time.perf_counter() - t0, answer.split(b"\r\n", 1)[0]
            except TimeoutError:
                pass
            writer.write(pending[k : k + 1])
            await writer.drain()
        return None, b""
    except (ConnectionError, OSError):
        return time.perf_counter() - t0, b"(reset)"
    finally:
        writer.close()


async def ordinary(url: str, stop: asyncio.Event, out: list) -> None:
    async with httpx.AsyncClient(timeout=300) as client:
        i = 0
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                r = await client.post(
                    url + "/v1/completions",
                    json={"prompt": f"an ordinary request {i}", "max_tokens": 2},
                )
                out.append((r.status_code, time.perf_counter() - t0))
            except httpx.HTTPError as exc:
                out.append((type(exc).__name__, time.perf_counter() - t0))
            i += 1
            await asyncio.sleep(0.05)


async def phase(name, url, pid, work, report):
    stop, served = asyncio.Event(), []
    side = asyncio.ensure_future(ordinary(url, stop, served))
    peak, cpu0, t0 = rss_mb(pid), cpu_seconds(pid), time.perf_counter()
    task = asyncio.ensure_future(work)
    while not task.done():
        peak = max(peak, rss_mb(pid))
        await asyncio.sleep(0.05)
    stop.set()
    await side
    results = task.result()
    ok = [s for s, _ in served if s == 200]
    worst = max((t for _, t in served), default=float("nan"))
    report.append(
        {
            "phase": name,
            "results": results,
            "wall_s": round(time.perf_counter() - t0, 2),
            "router_cpu_s": round(cpu_seconds(pid) - cpu0, 2),
            "peak_rss_mb": round(peak, 1),
            "ordinary_served": f"{len(ok)}/{len(served)}",
            "ordinary_worst_s": round(worst, 3),
        }
    )
    print(json.dumps(report[-1], default=str), flush=True)


async def run(args, router, pid) -> list:
    from urllib.parse import urlsplit

    url = router.url
    host, port = urlsplit(url).hostname, urlsplit(url).port
    report: list = []
    for n, mb in ((args.huge, args.huge_mb), (args.large, args.large_mb)):
        bodies = [body_of(mb, i) for i in range(n)]  # made before: the client's loop stays free
        await phase(f"{n} x {mb} MB", url, pid, huge(url, bodies), report)

    async def slow():
        bodies = [
            trickle(host, port, args.trickle_interval_s, args.give_up_s, headers_only=False)
            for _ in range(args.trickle)
        ]
        heads = [
            trickle(host, port, args.trickle_interval_s, args.give_up_s, headers_only=True)
            for _ in range(args.trickle)
        ]
        got = await asyncio.gather(*bodies, *heads)
        return {"body trickled": got[: args.trickle], "headers never ended": got[args.trickle :]}

    await phase(f"{args.trickle} + {args.trickle} slow senders", url, pid, slow(), report)
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--huge", type=int, default=5)
    parser.add_argument("--huge-mb", type=float, default=15)
    parser.add_argument("--large", type=int, default=20)
    parser.add_argument("--large-mb", type=float, default=1)
    parser.add_argument("--trickle", type=int, default=4)
    parser.add_argument("--trickle-interval-s", type=float, default=1.0)
    parser.add_argument("--give-up-s", type=float, default=90.0)
    parser.add_argument("--settle-s", type=float, default=5.0)
    parser.add_argument("--server", default=None, help="the router's ASGI server (runrouter)")
    args = parser.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="hostile-"))
    engine = start_engine(tmp, "--model", "tiny", "--dp-size", "2")
    try:
        extra = ["--server", args.server] if args.server else []
        router = start_router(engine.url, *extra, policy="cache_aware", log_path=tmp / "router.log")
        try:
            pid = router.proc.pid
            httpx.post(router.url + "/v1/completions", json={"prompt": "warm", "max_tokens": 2})
            time.sleep(1)
            idle = rss_mb(pid)
            print(f"router idle RSS {idle:.1f} MB", flush=True)
            report = asyncio.run(run(args, router, pid))
            time.sleep(args.settle_s)
            after = rss_mb(pid)
            peak = max(r["peak_rss_mb"] for r in report)
            print(f"router RSS idle before {idle:.1f} MB, after {after:.1f} MB "
                  f"(+{after - idle:.1f}); peak {peak:.1f} MB")  # fmt: skip
            alive = router.proc.poll() is None and engine.proc.poll() is None
            print(f"router and engine alive: {alive}")
        finally:
            router.stop()
    finally:
        engine.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
