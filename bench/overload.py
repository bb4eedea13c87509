"""Issue 12's acceptance runs, on the simulated engine (``runengine --simulate``) over real HTTP
and real processes. Three parts, each printed as it ends:

* ``overload``: one engine at DP N behind a router with admission limits. The fleet's capacity is
  measured first (closed loop at ``--max-concurrent-requests`` = DP x ``--max-num-seqs``), then
  Poisson arrivals at ``--overload-factor`` (3) x that rate for ``--duration`` seconds: once per
  ``--queue-size`` (16: the queue fills, 429 ``queue_full``; 1000: requests wait out
  ``--queue-timeout-secs``, 429 ``timeout``), each on a fresh router, and once with admission off.
  Per run: sent, complete responses, 429s (and how many lacked ``Retry-After``), other errors,
  the admitted requests' TTFT against the bound (``--queue-timeout-secs`` + the closed-loop TTFT
  p99: the longest wait plus what an admitted request then takes), whether every request ended
  in a complete response or a 429, the engine's peak running / waiting, and the router's and the
  engine's in-flight / queue gauges after the run (all must be 0).
* ``streams``: ``--streams`` (1,000) concurrent streamed completions through one router to one
  engine, ``--streams-rounds`` (2) times: how many ended with ``[DONE]``, how many were open at
  once (client side, and the engine's running peak), the router's RSS before, at its peak
  (sampled every 0.1 s) and after each round (a leak grows round after round).
* ``memory``: ``--memory-workers`` (4) engines at DP ``--memory-dp-size`` (8) registered with one
  ``--dp-aware`` router; the router's RSS idle and after a few chat requests (target: 150 MB),
  and the engines' total RSS.

::

    .venv/bin/python -m bench.overload [--parts overload streams memory] [--duration 30] \\
        [--dp-size 2] [--simulate a100-40gb-llama3.1-8b] [--max-num-seqs 4] [--policy P] \\
        [--queue-size 16 1000] [--no-admission-off] [--workdir DIR] [--json out.json]

Every process is this machine's: on a small host the client, the router and the engine's ranks
share the cores, so the capacity measured is this machine's, not the modelled GPU's (the
``--max-num-seqs`` default keeps the modelled engine, not the CPUs, the bottleneck).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import resource
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from bench.client import RequestResult
from bench.compare_fleet import quantiles
from bench.compare_routers import router_cmd
from bench.datasets import SampleRequest, random_text
from bench.procs import ServerProcess, free_port, start
from bench.runner import RunOptions, send_samples
from tests.support.procs import start_engine

MIB = 1024 * 1024
ROUTER_GAUGES = (
    "dpmesh_router_queue_depth",
    "dpmesh_router_admitted_requests",
    "dpmesh_router_inflight_requests",
    "dpmesh_router_inflight_prompt_tokens",
    "dpmesh_router_pending_prefill_tokens",
)
ENGINE_GAUGES = (
    "dpmesh_engine_num_requests_running",
    "dpmesh_engine_num_requests_waiting",
    "dpmesh_engine_inflight_requests",
)


# ----- helpers ------------------------------------------------------------------------------------
def samples(n: int, input_len: int, output_len: int, seed: int) -> list[SampleRequest]:
    """Independent text prompts of about ``input_len`` tokens (a distinct head: no shared
    prefix)."""
    rng = random.Random(seed)
    return [
        SampleRequest(f"{i}: {random_text(rng, input_len)}", input_len, output_len)
        for i in range(n)
    ]


def quantiles_ms(values_s) -> dict:
    """p50 / p90 / p99 / max of seconds, in milliseconds."""
    ms = [v * 1000.0 for v in values_s]
    q = quantiles(ms)
    return {"p50": q["p50"], "p90": q["p90"], "p99": q["p99"], "max": max(ms, default=math.nan)}


def by_label(url: str, names, label: str | None = None) -> dict:
    """From ``url``/metrics: each named sample summed over its labels, or (``label`` given) the
    one named sample by that label's values."""
    names = (names,) if isinstance(names, str) else tuple(names)
    out: dict = {} if label else dict.fromkeys(names, 0.0)
    text = httpx.get(url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names:
                key = sample.labels[label] if label else sample.name
                out[key] = out.get(key, 0.0) + sample.value
    return out


def gauges(url: str, names) -> dict[str, float]:
    """Each named sample at ``url``/metrics, summed over its labels."""
    return by_label(url, names)


def settle(url: str, names, timeout: float = 10.0) -> dict[str, float]:
    """The gauges once they are all 0, or as they are after ``timeout`` (a stuck one stays)."""
    deadline = time.monotonic() + timeout
    while True:
        values = gauges(url, names)
        if not any(values.values()) or time.monotonic() > deadline:
            return values
        time.sleep(0.25)


def rss(pid: int, children: bool = False) -> int:
    proc = psutil.Process(pid)
    procs = [proc, *proc.children(recursive=True)] if children else [proc]
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            total += p.memory_info().rss
    return total


class Peaks:
    """The peak of each value ``read()`` returns (a dict), sampled in a thread every
    ``interval`` seconds while the block runs (a failed read is skipped)."""

    def __init__(self, read, interval: float):
        self.read, self.interval, self.peak = read, interval, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            with contextlib.suppress(httpx.HTTPError, psutil.NoSuchProcess):
                for name, value in self.read().items():
                    self.peak[name] = max(self.peak.get(name, 0.0), value)
            self._stop.wait(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def rss_peak(pid: int) -> Peaks:
    """The process's peak RSS (``.peak["rss"]``, bytes), sampled every 0.1 s."""
    return Peaks(lambda: {"rss": rss(pid)}, 0.1)


def gauge_peaks(url: str, names) -> Peaks:
    """The peak of each named gauge at ``url``/metrics, sampled every 0.25 s."""
    return Peaks(lambda: gauges(url, names), 0.25)


def max_overlap(results: list[RequestResult]) -> int:
    """The most requests open at one instant (client side: from send to the stream's end)."""
    events = sorted([(r.start, 1) for r in results] + [(r.start + r.latency, -1) for r in results])
    open_now = peak = 0
    for _, step in events:
        open_now += step
        peak = max(peak, open_now)
    return peak


def raise_nofile(wanted: int) -> int:
    """Raise this process's open-file limit (inherited by the servers it starts) toward
    ``wanted``; returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def start_router(
    urls: list[str],
    workdir: Path,
    name: str,
    extra: list[str],
    targets: int,
    policy: str = "cache_aware",
) -> ServerProcess:
    """Our router in front of ``urls`` (``--dp-aware``), healthy once it lists ``targets``
    targets."""
    port = free_port()
    env = {"DATABASE_URL": f"sqlite:///{workdir}/{name}.sqlite3"}
    cmd = router_cmd("dpmesh", policy, urls, port) + extra
    router = start(cmd, f"http://127.0.0.1:{port}", workdir / f"{name}.log", env=env, timeout=120)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        health = httpx.get(router.url + "/health", timeout=5).json()
        if len(health.get("targets", [])) >= targets:
            return router
        time.sleep(0.3)
    router.stop()
    raise RuntimeError(f"{name}: fewer than {targets} targets after 60 s: {health}")


def run_load(url: str, work: list[SampleRequest], rate: float = float("inf"), concurrency=None):
    opts = RunOptions(
        base_url=url, model="tiny", request_rate=rate, max_concurrency=concurrency, progress=False
    )
    return asyncio.run(send_samples(opts, work))


def classify(results: list[RequestResult]) -> dict:
    complete = [r for r in results if r.ok and r.status == 200 and r.done]
    refused = [r for r in results if r.status == 429]
    done = {id(r) for r in complete}
    other = [r for r in results if id(r) not in done and r.status != 429]
    return {
        "sent": len(results),
        "complete": len(complete),
        "rejected_429": len(refused),
        "rejected_429_without_retry_after": sum(r.retry_after is None for r in refused),
        "retry_after_values": sorted({r.retry_after for r in refused if r.retry_after}),
        "other_errors": len(other),
        "other_error_samples": sorted({r.error[:200] for r in other})[:5],
        "nothing_lost": len(complete) + len(refused) == len(results),
        "ttft_ms": quantiles_ms(r.ttft for r in complete),
    }


# ----- part 1: overload ---------------------------------------------------------------------------
def overload(args, workdir: Path) -> dict:
    slots = args.dp_size * args.max_num_seqs
    max_concurrent = args.max_concurrent_requests or slots
    engine_args = [
        "--dp-size",
        str(args.dp_size),
        "--simulate",
        args.simulate,
        "--simulate-speedup",
        str(args.simulate_speedup),
        "--max-num-seqs",
        str(args.max_num_seqs),
    ]

    def admission(queue_size: int) -> list[str]:
        return [
            "--max-concurrent-requests",
            str(max_concurrent),
            "--queue-size",
            str(queue_size),
            "--queue-timeout-secs",
            str(args.queue_timeout_secs),
        ]

    out: dict = {
        "max_concurrent_requests": max_concurrent,
        "queue_timeout_s": args.queue_timeout_secs,
        "admission_on": {},
    }
    with start_engine(workdir, *engine_args, name="overload-engine") as engine:
        with start_router(
            [engine.url],
            workdir,
            "router-capacity",
            admission(max_concurrent),
            args.dp_size,
            args.policy,
        ) as r:
            # capacity: a closed loop at the admission limit (what the fleet serves well)
            n = args.capacity_requests_per_slot * max_concurrent
            work = samples(n, args.input_len, args.output_len, seed=1)
            run = run_load(r.url, work, concurrency=max_concurrent)
        closed = classify(run.results)
        capacity = closed["complete"] / run.duration_s
        out["capacity"] = {
            "concurrency": max_concurrent,
            "requests": n,
            "duration_s": run.duration_s,
            "req_per_s": capacity,
            "complete": closed["complete"],
            "ttft_ms": closed["ttft_ms"],
        }
        rate = args.overload_factor * capacity
        total = max(1, round(rate * args.duration))
        out["offered_req_per_s"], out["offered_requests"] = rate, total
        bound_ms = args.queue_timeout_secs * 1000 + closed["ttft_ms"]["p99"]
        out["ttft_bound_ms"] = bound_ms
        print(
            f"overload: capacity {capacity:.2f} req/s at {max_concurrent} in flight "
            f"(TTFT p50 {closed['ttft_ms']['p50']:.0f} p99 {closed['ttft_ms']['p99']:.0f} ms); "
            f"offering {rate:.2f} req/s for {args.duration:g} s ({total} requests); admitted "
            f"TTFT bound {bound_ms:.0f} ms",
            flush=True,
        )
        work = samples(total, args.input_len, args.output_len, seed=2)
        for queue_size in args.queue_size:
            name = f"router-queue-{queue_size}"
            with start_router(
                [engine.url], workdir, name, admission(queue_size), args.dp_size, args.policy
            ) as r:
                row = open_loop(r.url, engine.url, work, rate, bound_ms)
            out["admission_on"][str(queue_size)] = row
            print_row(f"admission on, queue {queue_size}", row)
        if not args.admission_off:
            return out
        with start_router([engine.url], workdir, "router-open", [], args.dp_size, args.policy) as r:
            out["admission_off"] = open_loop(r.url, engine.url, work, rate, bound_ms)
            print_row("admission off", out["admission_off"])
    return out


def open_loop(router_url: str, engine_url: str, work, rate: float, bound_ms: float) -> dict:
    statuses = by_label(router_url, "dpmesh_router_http_responses_total", "status")
    reasons = by_label(router_url, "dpmesh_router_rejected_requests_total", "reason")
    with gauge_peaks(engine_url, ENGINE_GAUGES[:2]) as engine_peak:
        run = run_load(router_url, work, rate=rate)
    row = classify(run.results)
    row["engine_peak"] = {name: engine_peak.peak.get(name, 0.0) for name in ENGINE_GAUGES[:2]}
    row["duration_s"] = run.duration_s
    row["complete_per_s"] = row["complete"] / run.duration_s
    row["ttft_within_bound"] = row["ttft_ms"]["p99"] <= bound_ms
    row["router_after"] = settle(router_url, ROUTER_GAUGES)
    row["engine_after"] = settle(engine_url, ENGINE_GAUGES)
    row["stuck"] = {k: v for k, v in {**row["router_after"], **row["engine_after"]}.items() if v}
    row["router_rejections"] = delta(
        reasons, by_label(router_url, "dpmesh_router_rejected_requests_total", "reason")
    )
    row["router_responses"] = delta(
        statuses, by_label(router_url, "dpmesh_router_http_responses_total", "status")
    )
    return row


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in sorted(after.items()) if v - before.get(k, 0.0)}


def print_row(name: str, row: dict) -> None:
    t = row["ttft_ms"]
    print(
        f"  {name:<14} sent {row['sent']} complete {row['complete']} 429 {row['rejected_429']} "
        f"(no Retry-After {row['rejected_429_without_retry_after']}, Retry-After values "
        f"{row['retry_after_values']}, router counted {row['router_rejections']}) "
        f"other errors {row['other_errors']} "
        f"nothing lost {row['nothing_lost']} | TTFT ms p50 {t['p50']:.0f} p90 {t['p90']:.0f} "
        f"p99 {t['p99']:.0f} max {t['max']:.0f} within bound {row['ttft_within_bound']} | "
        f"engine peak running/waiting {row['engine_peak'][ENGINE_GAUGES[0]]:.0f}/"
        f"{row['engine_peak'][ENGINE_GAUGES[1]]:.0f} | run {row['duration_s']:.1f} s | "
        f"stuck after: {row['stuck'] or 'none'} | router's "
        f"responses by status {row['router_responses']}",
        flush=True,
    )
    if row["other_error_samples"]:
        print(f"    errors: {row['other_error_samples']}", flush=True)


# ----- part 2: 1,000 concurrent streams -----------------------------------------------------------
def streams(args, workdir: Path) -> dict:
    nofile = raise_nofile(4 * args.streams + 1024)  # client + router sockets, both sides
    per_rank = -(-args.streams // args.streams_dp_size)
    engine_args = [
        "--dp-size",
        str(args.streams_dp_size),
        "--simulate",
        args.streams_simulate,
        "--simulate-speedup",
        str(args.simulate_speedup),
        "--max-num-seqs",
        str(max(per_rank, 1024)),
    ]
    out: dict = {"streams": args.streams, "nofile": nofile, "rounds": []}
    with start_engine(workdir, *engine_args, name="streams-engine") as engine:
        with start_router([engine.url], workdir, "router-streams", [], args.streams_dp_size) as r:
            run_load(r.url, samples(4, 16, 4, seed=3))  # warm: the first requests' lazy work
            out["rss_before_mib"] = rss(r.proc.pid) / MIB
            for k in range(args.streams_rounds):  # a second round: does "after" keep growing?
                out["rounds"].append(stream_round(args, engine.url, r, seed=4 + k))
                print_streams(k + 1, args.streams, out["rss_before_mib"], out["rounds"][-1])
    return out


def stream_round(args, engine_url: str, router: ServerProcess, seed: int) -> dict:
    work = samples(args.streams, args.streams_input_len, args.streams_output_len, seed=seed)
    with rss_peak(router.proc.pid) as sampler, gauge_peaks(engine_url, ENGINE_GAUGES[:1]) as peak:
        run = run_load(router.url, work, rate=args.streams_rate)
    time.sleep(1.0)
    res = run.results
    return {
        "rss_peak_mib": sampler.peak.get("rss", 0) / MIB,
        "rss_after_mib": rss(router.proc.pid) / MIB,
        "router_after": settle(router.url, ROUTER_GAUGES),
        "done": sum(r.done for r in res),
        "complete": sum(r.ok and r.done for r in res),
        "failed": [
            f"after {r.latency:.2f} s, {r.output_tokens} tokens: {r.error[:200]}"
            for r in res
            if not (r.ok and r.done)
        ][:5],
        "tokens": sum(r.output_tokens for r in res),
        "max_open_client": max_overlap(res),
        "peak_engine_running": peak.peak.get(ENGINE_GAUGES[0], 0.0),
        "duration_s": run.duration_s,
        "ttft_ms": quantiles_ms(r.ttft for r in res if r.ok),
        "latency_ms": quantiles_ms(r.latency for r in res if r.ok),
    }


def print_streams(k: int, streams: int, before_mib: float, out: dict) -> None:
    print(
        f"streams, round {k}: {out['done']}/{streams} ended with [DONE] ({out['complete']} "
        f"complete, {out['tokens']} tokens) in {out['duration_s']:.1f} s; open at once (client) "
        f"{out['max_open_client']}, engine running peak {out['peak_engine_running']:.0f}; "
        f"router RSS before {before_mib:.1f} MiB, peak {out['rss_peak_mib']:.1f}, "
        f"after {out['rss_after_mib']:.1f}; router gauges after {out['router_after']}",
        flush=True,
    )
    if out["failed"]:
        print(f"  failed: {out['failed']}", flush=True)


# ----- part 3: router memory with W workers x D ranks ---------------------------------------------
def memory(args, workdir: Path) -> dict:
    engine_args = ["--dp-size", str(args.memory_dp_size), "--simulate", args.simulate]
    n, dp = args.memory_workers, args.memory_dp_size
    out: dict = {
        "workers": n,
        "dp_size": dp,
        "available_before_mib": psutil.virtual_memory().available / MIB,
    }
    with contextlib.ExitStack() as stack:
        started = time.perf_counter()
        with ThreadPoolExecutor(n) as pool:
            futures = [
                pool.submit(start_engine, workdir, *engine_args, name=f"mem-engine-{i}")
                for i in range(n)
            ]
            engines = [stack.enter_context(f.result()) for f in futures]
        out["engines_start_s"] = time.perf_counter() - started
        out["engines_rss_mib"] = sum(rss(e.proc.pid, children=True) for e in engines) / MIB
        out["engine_processes"] = sum(
            1 + len(psutil.Process(e.proc.pid).children(recursive=True)) for e in engines
        )
        router = stack.enter_context(
            start_router([e.url for e in engines], workdir, "router-memory", [], n * dp)
        )
        out["targets"] = len(httpx.get(router.url + "/health", timeout=5).json()["targets"])
        time.sleep(2.0)
        out["router_rss_idle_mib"] = rss(router.proc.pid) / MIB
        body = {"model": "tiny", "max_tokens": 16}
        with httpx.Client(base_url=router.url, timeout=60) as client:
            codes = [
                client.post(
                    "/v1/chat/completions",
                    json={**body, "messages": [{"role": "user", "content": f"hello {i}"}]},
                ).status_code
                for i in range(args.memory_requests)
            ]
        out["chat_status"] = {str(c): codes.count(c) for c in sorted(set(codes))}
        time.sleep(1.0)
        out["router_rss_after_mib"] = rss(router.proc.pid) / MIB
        out["available_during_mib"] = psutil.virtual_memory().available / MIB
    out["within_target"] = out["router_rss_after_mib"] <= args.memory_target_mib
    print(
        f"memory: {n} workers x DP {dp} ({out['engine_processes']} engine processes, "
        f"{out['engines_rss_mib']:.0f} MiB RSS, up in {out['engines_start_s']:.0f} s), router "
        f"sees {out['targets']} targets; router RSS idle {out['router_rss_idle_mib']:.1f} MiB, "
        f"after {args.memory_requests} chats {out['router_rss_after_mib']:.1f} MiB "
        f"{out['chat_status']} (target <= {args.memory_target_mib} MiB: "
        f"{'met' if out['within_target'] else 'NOT met'})",
        flush=True,
    )
    return out


PARTS = {"overload": overload, "streams": streams, "memory": memory}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS))
    parser.add_argument("--simulate", default="a100-40gb-llama3.1-8b")
    parser.add_argument("--simulate-speedup", type=float, default=1.0)
    parser.add_argument("--json", default=None, help="write every number here")
    parser.add_argument("--workdir", default=None, help="keep the servers' logs here")
    g = parser.add_argument_group("overload")
    g.add_argument("--dp-size", type=int, default=2)
    g.add_argument("--max-num-seqs", type=int, default=4, help="per rank, the engine's")
    g.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=0,
        help="the router's (default: dp-size x max-num-seqs)",
    )
    g.add_argument(
        "--queue-size",
        type=int,
        nargs="+",
        default=[16, 1000],
        help="one admission run per size (a short queue: 429 queue_full; a long one: timeouts)",
    )
    g.add_argument("--capacity-requests-per-slot", type=int, default=16)
    g.add_argument("--policy", default="cache_aware", help="the overload routers' --policy")
    g.add_argument(
        "--admission-off",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run the same load with admission off",
    )
    g.add_argument("--queue-timeout-secs", type=float, default=5.0)
    g.add_argument("--input-len", type=int, default=128)
    g.add_argument("--output-len", type=int, default=32)
    g.add_argument("--overload-factor", type=float, default=3.0)
    g.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals")
    g = parser.add_argument_group("streams")
    g.add_argument("--streams", type=int, default=1000)
    g.add_argument("--streams-dp-size", type=int, default=2)
    g.add_argument("--streams-simulate", default="h100-llama3.1-8b")
    g.add_argument("--streams-input-len", type=int, default=32)
    g.add_argument("--streams-output-len", type=int, default=256)
    g.add_argument("--streams-rounds", type=int, default=2)
    g.add_argument(
        "--streams-rate",
        type=float,
        default=float("inf"),
        help="arrivals per second (default: all at once)",
    )
    g = parser.add_argument_group("memory")
    g.add_argument("--memory-workers", type=int, default=4)
    g.add_argument("--memory-dp-size", type=int, default=8)
    g.add_argument("--memory-requests", type=int, default=32)
    g.add_argument("--memory-target-mib", type=float, default=150.0)
    args = parser.parse_args(argv)
    results = {}
    with contextlib.ExitStack() as stack:
        if args.workdir:
            workdir = Path(args.workdir)
            workdir.mkdir(parents=True, exist_ok=True)
        else:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="overload-")))
        for part in args.parts:
            results[part] = PARTS[part](args, workdir)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
