"""What relaying a streamed answer costs a router: CPU per request and per SSE event.

The stand-in upstream (harness/standin.py) answers every ``/v1/completions`` with
``--tokens`` text events, ``--token-interval-s`` apart (as an engine's decode steps arrive: one
event per read, nothing to batch); each router in turn (ours ``runrouter --dp-aware``, SGLang's
``sglang-router launch --dp-aware``, both cache_aware) relays ``--requests`` of them,
``--concurrency`` at a time, streamed, then ``--plain-requests`` not streamed. The router's user
+ system CPU over each pass, divided by its requests, is its cost; the streamed minus the
non-streamed cost, divided by the events, is what one event costs it::

    .venv/bin/python -m bench.runs.stream_relay [--tokens 200] [--requests 200] \\
        [--plain-requests 5000] [--rounds 1] \\
        [--routers dpmesh dpmesh:uvicorn sglang vllm-router] [--vllm-router PATH]

``--rounds N`` runs every router in turn N times (interleaved: one router's figures move 5-10 %
from run to run on a 2-core host, as much as a change measured) and ends with each figure's
median over the rounds, and its ratio to sglang-router's.

Before the passes each router idles ``--idle-s`` seconds (after a warm-up): its CPU meanwhile,
in ms a second, is the background work it does whatever the traffic (ours: the scrape of the
engines' metrics, the fleet's sync from the database, the health and feed loops). Its share of a
non-streamed request is that rate times the pass's wall time over its requests (the pass runs at
a few hundred requests a second, where ~10 ms a second of background is ~20 us a request); the
line and the medians print it as ``background``.

``dpmesh:SERVER`` is ours under that ASGI server (``runrouter --server``; plain ``dpmesh``: the
default); ``bare`` is harness/bare_proxy.py, our server stack and upstream client forwarding each
body as it is with none of the router's work (the floor our router stands on); ``vllm-router``
is vllm-router's ``cache_aware`` (``pip install vllm-router==0.1.17`` in a venv of its own, its
executable given with ``--vllm-router``).

The trace runs (bench.runs.routers_at_fleet_scale) stream ~200 tokens a request: this is where
most of our router's CPU a request goes there (docs/benchmarks.md, "What a streamed token costs
the router").
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.runs.routers_at_fleet_scale import cpu_seconds
from bench.runs.routers_on_our_engine import router_cmd
from harness.procs import free_port, start


async def drive(url: str, requests: int, concurrency: int, tokens: int, stream: bool) -> None:
    """Send ``requests`` completions through ``url``, ``concurrency`` at a time, reading every
    byte of each answer; a non-200 answer is an error."""
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=120) as client:

        async def one(i: int) -> None:
            body = {"model": "standin", "prompt": f"request {i} " + "lorem ipsum " * 80,
                    "max_tokens": tokens, "stream": stream}  # fmt: skip
            async with limit, client.stream("POST", url + "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"{url} answered {r.status_code}")
                await r.aread()

        await asyncio.gather(*(one(i) for i in range(requests)))


def measure(url: str, pid: int, args, stream: bool, requests: int) -> tuple[float, float]:
    """(CPU ms a request of process ``pid`` and its children, wall seconds) over one pass of
    ``requests``."""
    cpu, wall = cpu_seconds(pid), time.perf_counter()
    asyncio.run(drive(url, requests, args.concurrency, args.tokens, stream))
    return 1000 * (cpu_seconds(pid) - cpu) / requests, time.perf_counter() - wall


def relay_router_cmd(kind: str, standin_url: str, port: int, vllm_router: str) -> list[str]:
    name, _, server = kind.partition(":")
    if name == "bare":  # our server stack and HTTP client, none of the router's work
        return [sys.executable, "-m", "harness.bare_proxy", "--port", str(port),
                "--upstream", standin_url]  # fmt: skip
    if name == "vllm-router":
        return [vllm_router, "--worker-urls", standin_url, "--intra-node-data-parallel-size", "4",
                "--policy", "cache_aware", "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    cmd = router_cmd(name, "cache_aware", standin_url, port)
    return cmd + ["--server", server] if server else cmd


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=200, help="text events a streamed answer")
    parser.add_argument("--token-interval-s", type=float, default=0.005)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--plain-requests", type=int, default=5000, help="the non-streamed "
                        "pass's: a plain request costs ~0.2-0.8 ms, and /proc counts CPU in 10 ms "
                        "ticks, so a pass of a few hundred reads to within ~30 %%")  # fmt: skip
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--routers", nargs="+", default=["dpmesh", "sglang"])
    parser.add_argument("--vllm-router", default="vllm-router", help="the vllm-router executable")
    parser.add_argument("--rounds", type=int, default=1, help="each router in turn, this often")
    parser.add_argument("--idle-s", type=float, default=5.0, help="each router's idle CPU is "
                        "measured over this long before its passes (0: not measured)")  # fmt: skip
    args = parser.parse_args(argv)
    figures: dict[str, list[tuple[float, float, float, float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        port = free_port()
        standin_cmd = [sys.executable, "-m", "harness.standin", "--port", str(port),
                       "--dp-size", "4", "--tokens", str(args.tokens),
                       "--token-interval-s", str(args.token_interval_s)]  # fmt: skip
        with start(standin_cmd, f"http://127.0.0.1:{port}", workdir / "standin.log") as standin:
            for kind in [kind for _ in range(args.rounds) for kind in args.routers]:
                port = free_port()
                env = {"DATABASE_URL": f"sqlite:///{workdir}/{kind}-{port}.sqlite3"}
                cmd = relay_router_cmd(kind, standin.url, port, args.vllm_router)
                with start(cmd, f"http://127.0.0.1:{port}", workdir / f"{kind}.log", env=env,
                           timeout=120) as router:  # fmt: skip
                    warm = max(8, args.requests // 10)
                    asyncio.run(drive(router.url, warm, args.concurrency, args.tokens, True))
                    idle = idle_rate(router.proc.pid, args.idle_s)
                    streamed, wall = measure(router.url, router.proc.pid, args, True,
                                             args.requests)  # fmt: skip
                    plain, plain_wall = measure(router.url, router.proc.pid, args, False,
                                                args.plain_requests)  # fmt: skip
                events = args.tokens + 3  # the text events, the finish event, usage, [DONE]
                per_event_us = 1000 * (streamed - plain) / events
                background_us = 1000 * idle * plain_wall / args.plain_requests
                print(f"{kind:<15} streamed {streamed:6.2f} ms CPU a request ({wall:.1f} s wall), "
                      f"not streamed {plain:6.3f} ms (background {background_us:4.1f} us of it: "
                      f"{idle:.1f} ms a second idle); {per_event_us:5.1f} us an event "
                      f"({args.tokens} tokens, {args.token_interval_s * 1000:g} ms apart)",
                      flush=True)  # fmt: skip
                figures.setdefault(kind, []).append(
                    (streamed, plain, per_event_us, idle, background_us)
                )
    if args.rounds > 1:
        summarize(figures)
    return 0


def idle_rate(pid: int, seconds: float) -> float:
    """CPU ms a second of process ``pid`` (and its children) over ``seconds`` with no traffic."""
    if seconds <= 0:
        return 0.0
    cpu = cpu_seconds(pid)
    time.sleep(seconds)
    return 1000 * (cpu_seconds(pid) - cpu) / seconds


def summarize(figures: dict[str, list[tuple[float, ...]]]) -> None:
    """Each router's median figures over the rounds, and their ratios to sglang-router's."""
    medians = {kind: [statistics.median(f[i] for f in runs) for i in range(5)]
               for kind, runs in figures.items()}  # fmt: skip
    peer = medians.get("sglang")
    print(f"medians over {len(next(iter(figures.values())))} rounds:")
    for kind, (streamed, plain, event, idle, background) in medians.items():
        ratios = ""
        if peer is not None and kind != "sglang":
            ratios = (f"  ({streamed / peer[0]:.2f}x / {plain / peer[1]:.2f}x / "
                      f"{event / peer[2]:.2f}x sglang-router's)")  # fmt: skip
        print(
            f"{kind:<15} streamed {streamed:6.2f} ms, not streamed {plain:6.3f} ms "
            f"(background {background:4.1f} us, {idle:.1f} ms a second idle), "
            f"{event:5.1f} us an event{ratios}"
        )


if __name__ == "__main__":
    sys.exit(main())
