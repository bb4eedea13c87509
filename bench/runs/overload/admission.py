"""Part ``overload``: one engine behind routers with admission limits, offered ``--overload-factor``
times the capacity measured first; every request must end complete or as a 429."""

from __future__ import annotations

from pathlib import Path

from bench.runs.overload.common import (
    ENGINE_GAUGES,
    ROUTER_GAUGES,
    by_label,
    classify,
    gauge_peaks,
    run_load,
    samples,
    settle,
    start_router,
)
from harness.procs import start_engine


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
    out: dict = {
        "max_concurrent_requests": max_concurrent,
        "queue_timeout_s": args.queue_timeout_secs,
        "admission_on": {},
    }

    def router(name: str, queue_size: int | None):
        """A fresh router (admission off when ``queue_size`` is None)."""
        extra = [] if queue_size is None else admission_flags(args, max_concurrent, queue_size)
        return start_router([engine.url], workdir, name, extra, args.dp_size, args.policy)

    with start_engine(workdir, *engine_args, name="overload-engine") as engine:
        with router("router-capacity", max_concurrent) as r:
            out["capacity"] = capacity(args, r.url, max_concurrent)
        rate = args.overload_factor * out["capacity"]["req_per_s"]
        total = max(1, round(rate * args.duration))
        out["offered_req_per_s"], out["offered_requests"] = rate, total
        bound_ms = args.queue_timeout_secs * 1000 + out["capacity"]["ttft_ms"]["p99"]
        out["ttft_bound_ms"] = bound_ms
        print_offer(args, out)
        work = samples(total, args.input_len, args.output_len, seed=2)
        for queue_size in args.queue_size:
            with router(f"router-queue-{queue_size}", queue_size) as r:
                row = open_loop(r.url, engine.url, work, rate, bound_ms)
            out["admission_on"][str(queue_size)] = row
            print_row(f"admission on, queue {queue_size}", row)
        if not args.admission_off:
            return out
        with router("router-open", None) as r:
            out["admission_off"] = open_loop(r.url, engine.url, work, rate, bound_ms)
            print_row("admission off", out["admission_off"])
    return out


def admission_flags(args, max_concurrent: int, queue_size: int) -> list[str]:
    """The router's admission limits for one run."""
    return [
        "--max-concurrent-requests",
        str(max_concurrent),
        "--queue-size",
        str(queue_size),
        "--queue-timeout-secs",
        str(args.queue_timeout_secs),
    ]


def capacity(args, router_url: str, max_concurrent: int) -> dict:
    """What the fleet serves well: a closed loop at the admission limit, in complete requests a
    second (the open-loop runs offer a multiple of it)."""
    n = args.capacity_requests_per_slot * max_concurrent
    work = samples(n, args.input_len, args.output_len, seed=1)
    run = run_load(router_url, work, concurrency=max_concurrent)
    closed = classify(run.results)
    return {
        "concurrency": max_concurrent,
        "requests": n,
        "duration_s": run.duration_s,
        "req_per_s": closed["complete"] / run.duration_s,
        "complete": closed["complete"],
        "ttft_ms": closed["ttft_ms"],
    }


def print_offer(args, out: dict) -> None:
    cap = out["capacity"]
    print(
        f"overload: capacity {cap['req_per_s']:.2f} req/s at {cap['concurrency']} in flight "
        f"(TTFT p50 {cap['ttft_ms']['p50']:.0f} p99 {cap['ttft_ms']['p99']:.0f} ms); "
        f"offering {out['offered_req_per_s']:.2f} req/s for {args.duration:g} s "
        f"({out['offered_requests']} requests); admitted TTFT bound {out['ttft_bound_ms']:.0f} ms",
        flush=True,
    )


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
