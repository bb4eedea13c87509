"""Per-target routing statistics, kept in memory on the hot path and persisted periodically."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, fields


@dataclass
class TargetStats:
    requests: int = 0  # dispatched
    prompt_tokens: int = 0
    predicted_tokens: int = 0  # prompt tokens the router's index expected the engine to have cached
    completed: int = 0
    errors: int = 0
    aborted: int = 0  # the client went away first: not the target's fault
    reported: int = 0  # completed requests whose engine reported usage
    cached_tokens: int = 0  # prompt tokens the engine reported as cached

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class Histogram:
    """Cumulative-bucket histogram in Prometheus' shape (seconds)."""

    BUCKETS = (
        0.005,
        0.01,
        0.025,
        0.05,
        0.1,
        0.25,
        0.5,
        1.0,
        2.5,
        5.0,
        10.0,
        30.0,
        60.0,
        120.0,
        300.0,
    )

    def __init__(self, buckets: tuple[float, ...] = BUCKETS):
        self.buckets = buckets
        self.counts = [0] * len(buckets)  # per bucket, not cumulative
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.count += 1
        self.sum += value
        i = bisect_left(self.buckets, value)  # the first bound >= value
        if i < len(self.counts):
            self.counts[i] += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """[(le, count <= le)], ending with +Inf, as Prometheus exposes buckets."""
        out, running = [], 0
        for bound, n in zip(self.buckets, self.counts, strict=True):
            running += n
            out.append((repr(bound), running))
        out.append(("+Inf", self.count))
        return out


PERSISTED_FIELDS = ("requests", "prompt_tokens", "cached_tokens", "predicted_tokens", "errors")


OVERHEAD_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class RouterStats:
    """This process's routing counters. The per-target ones are also written to the Rank rows
    (apps/routing/feeds/persist.py) as increments; ``persisted`` is what has been written so far, so
    ``unwritten`` is this process's part that the rows do not have yet."""

    def __init__(self):
        self.targets: dict[str, TargetStats] = {}
        self.persisted: dict[str, dict[str, int]] = {}  # target key -> counters in the database
        self.persisted_circuits: dict[str, str] = {}  # target key -> circuit state written last
        self.retries = 0
        self.no_target = 0
        self.time_checked = 0  # policy choices the time check replaced (Router._quicker)
        self.responses: dict[tuple[str, int], int] = {}  # (endpoint, HTTP status) -> answers sent
        self.latency = Histogram()  # dispatch to the end of the upstream answer, per routed request
        self.ttft = Histogram()  # dispatch to the first streamed token
        # the router's own time per request: arrival to the upstream request sent, admission
        # waits and earlier attempts left out (apps/routing/proxy/upstream.py)
        self.overhead = Histogram(OVERHEAD_BUCKETS)

    def responded(self, endpoint: str, status: int) -> None:
        key = (endpoint, status)
        self.responses[key] = self.responses.get(key, 0) + 1

    def _get(self, key: str) -> TargetStats:
        stats = self.targets.get(key)
        if stats is None:
            stats = self.targets[key] = TargetStats()
        return stats

    def dispatched(self, key: str, prompt_tokens: int, predicted_tokens: int) -> None:
        s = self._get(key)
        s.requests += 1
        s.prompt_tokens += prompt_tokens
        s.predicted_tokens += predicted_tokens

    def finished(
        self, key: str, *, ok: bool, cached_tokens: int | None, aborted: bool = False
    ) -> None:
        s = self._get(key)
        if aborted:
            s.aborted += 1
            return
        if not ok:
            s.errors += 1
            return
        s.completed += 1
        if isinstance(cached_tokens, int):
            s.reported += 1
            s.cached_tokens += cached_tokens

    def counters(self, key: str) -> dict[str, int]:
        """The persisted counters of ``key`` as this process has them now."""
        stats = self.targets.get(key)
        return {name: getattr(stats, name) if stats else 0 for name in PERSISTED_FIELDS}

    def unwritten(self, key: str) -> dict[str, int]:
        """What this process counted for ``key`` that is not in the database yet."""
        now, base = self.counters(key), self.persisted.get(key)
        if base is None:
            return now
        return {name: now[name] - base[name] for name in PERSISTED_FIELDS}

    def snapshot(self) -> dict[str, dict]:
        return {key: s.as_dict() for key, s in self.targets.items()}
