"""What the work ahead of a request costs in time, per worker, learned online from what the router
sees: each request's dispatch-to-first-token time against the state of its target at dispatch.

The cost model (``policies.CacheAware``) counts in prefill tokens: a request's uncached tokens,
the prefill queued ahead of it, ``decode_weight`` tokens for each request already running there
and a penalty for waking a target that has been idle. How many prefill tokens a running request
or a wake-up is worth is a fact of the engine and its hardware, not of the router: on an H100 a
running decode costs a few prefill tokens' time, on a 2-core CPU a few hundred; waking an idle
vLLM-CPU rank whose cores the API server shares can cost more than a whole prefill. So the
router fits, per worker,

    ttft ~ base + per_token x (uncached + queued prefill tokens) + per_running x running
           + wake x [the target had nothing in flight for at least ``WAKE_IDLE_S``]

by recursive least squares with forgetting (recent requests weigh most: the fit follows a
changing engine), and reads the exchange rates off it: ``running_tokens`` = per_running /
per_token and ``wake_tokens`` = wake / per_token. Until a worker has ``MIN_SAMPLES``
observations, or while the fit is not sane (a non-positive per-token time), the priors hold:
the policy's own weights (``decode_weight``, no wake penalty), so the first requests are routed
as before and a fleet whose engines behave as the priors say keeps its routing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

WAKE_IDLE_S = 0.5  # a target with nothing in flight for this long counts as idle
MIN_SAMPLES = 24
FORGET = 0.98  # per observation: the fit's memory is ~50 requests
FEATURES = 4  # 1, tokens, running, idle


@dataclass(frozen=True)
class Rates:
    """What the fit says, in prefill tokens (what the cost model counts in)."""

    running_tokens: float  # one request running on the target
    wake_tokens: float  # dispatching to an idle target
    per_token_s: float  # seconds per prefill token (0: not learned yet)
    samples: int


class RecursiveLeastSquares:
    """y ~ theta . x, updated one observation at a time (no stored history)."""

    def __init__(self, n: int, forget: float = FORGET, prior_scale: float = 1e3):
        self.n, self.forget = n, forget
        self.theta = [0.0] * n
        self.p = [[prior_scale if i == j else 0.0 for j in range(n)] for i in range(n)]

    def update(self, x: list[float], y: float) -> None:
        n, lam, p = self.n, self.forget, self.p
        px = [sum(p[i][j] * x[j] for j in range(n)) for i in range(n)]
        denom = lam + sum(x[i] * px[i] for i in range(n))
        gain = [v / denom for v in px]
        err = y - sum(self.theta[i] * x[i] for i in range(n))
        self.theta = [self.theta[i] + gain[i] * err for i in range(n)]
        self.p = [[(p[i][j] - gain[i] * px[j]) / lam for j in range(n)] for i in range(n)]


class WorkerTiming:
    """One worker's fit (all its ranks run the same engine on the same kind of hardware)."""

    def __init__(self, prior_running_tokens: float):
        self.prior_running_tokens = prior_running_tokens
        self.fit = RecursiveLeastSquares(FEATURES)
        self.samples = 0

    def observe(self, tokens: int, running: int, idle: bool, seconds: float) -> None:
        # tokens in thousands keeps the features of comparable size (a better-conditioned fit)
        self.fit.update([1.0, tokens / 1000.0, float(running), float(idle)], seconds)
        self.samples += 1

    def rates(self) -> Rates:
        base, per_kilotoken, per_running, wake = self.fit.theta
        per_token = per_kilotoken / 1000.0
        if self.samples < MIN_SAMPLES or per_token <= 0:
            return Rates(self.prior_running_tokens, 0.0, 0.0, self.samples)
        return Rates(
            max(self.prior_running_tokens, per_running / per_token),
            max(0.0, wake / per_token),
            per_token,
            self.samples,
        )


class Timing:
    """The fits of every worker, keyed by worker id; what the policy reads at each decision."""

    def __init__(self, prior_running_tokens: float, clock=time.monotonic):
        self.prior_running_tokens = prior_running_tokens
        self.clock = clock
        self.workers: dict[int, WorkerTiming] = {}
        self._busy_until: dict[str, float] = {}  # target key -> when it last had work in flight

    def worker(self, worker_id: int) -> WorkerTiming:
        timing = self.workers.get(worker_id)
        if timing is None:
            timing = self.workers[worker_id] = WorkerTiming(self.prior_running_tokens)
        return timing

    def idle(self, key: str, inflight: int, now: float | None = None) -> bool:
        """Whether a target has had nothing in flight for at least ``WAKE_IDLE_S``."""
        if inflight:
            return False
        now = self.clock() if now is None else now
        return now - self._busy_until.get(key, float("-inf")) >= WAKE_IDLE_S

    def touched(self, key: str) -> None:
        """Work was in flight on ``key`` just now (a dispatch, a first token, an end)."""
        self._busy_until[key] = self.clock()

    def forget(self, worker_id: int) -> None:
        self.workers.pop(worker_id, None)
