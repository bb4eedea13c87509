"""Part ``streams``: a thousand concurrent streamed completions through one router, in rounds:
do they all end with ``[DONE]``, and does the router's RSS come back down after each?"""

from __future__ import annotations

import time
from pathlib import Path

from bench.runs.overload.common import (
    ENGINE_GAUGES,
    MIB,
    ROUTER_GAUGES,
    gauge_peaks,
    max_overlap,
    quantiles_ms,
    raise_nofile,
    rss,
    rss_peak,
    run_load,
    samples,
    settle,
    start_router,
)
from harness.procs import ServerProcess, start_engine


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
