"""Part ``memory``: the router's RSS in front of many workers of many ranks each, idle and after a
few chats (the target is 150 MB)."""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil

from bench.runs.overload.common import MIB, rss, start_router
from harness.procs import start_engine


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
