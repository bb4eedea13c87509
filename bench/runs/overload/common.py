"""What the three overload parts share: their workloads, reading the servers' /metrics and RSS
while a run goes on, our router started and waited for until it sees every target, and a run's
results sorted into complete, refused and failed."""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import resource
import threading
import time
from pathlib import Path

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from bench.client import RequestResult
from bench.datasets import SampleRequest, random_text
from bench.runner import RunOptions, send_samples
from bench.runs.routers_at_fleet_scale import quantiles
from harness.procs import ServerProcess, free_port, router_command, start

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
    cmd = router_command(urls, *extra, port=port, policy=policy)
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
