"""What a request's first token costs in time on each worker, learned from what the router sees.

The policy counts prefill tokens; users buy time to first token. Per worker, the router fits

    TTFT = base + per_token x wait tokens + move x moved + per_running x running

over the requests it dispatched there (each at its first token), by least squares with old
samples fading (``WINDOW``):

- ``wait tokens``: what the policy expected the request to wait for on its target: its uncached
  prompt tokens plus the prefill already queued there (``RankLoad.queued_prefill_tokens``);
- ``moved``: 1 when the request went to a rank of the worker that was idle (nothing in flight
  there) while another rank of the same worker had been sent work more recently, else 0. Ranks of
  one engine share a host: on some (an engine whose idle ranks spin down, or busy-poll the cores
  the others need) waking a rank that sat idle costs time the prompt's size does not explain;
  on others (the simulated engine, GPUs with their graphs ready) it costs nothing;
- ``running``: the requests in flight on the target when it was sent (every router process's):
  what a queue costs beyond its prefill tokens (decode steps shared, seats taken);
- ``per_token``: seconds per prompt token waited for, so ``move`` converts to the policy's unit.

``move`` is judged significant once there are at least ``MIN_SAMPLES`` requests of each kind
and the same fit on log(TTFT) puts the move's effect above ``SIGNIFICANCE`` standard errors
(TTFTs are heavy-tailed: a few second-long stalls would otherwise hide a steady cost, or fake
one); ``move / per_token`` (up to ``MOVE_CAP_TOKENS``) is what a move costs in the policy's
unit.

What the router does with it: it shows it (the workers API's ``timing``, /metrics), and the
time check (``Router._quicker``, ``RouterConfig.time_check``) predicts each candidate's TTFT from
it and overrides cache_aware's choice where another is clearly quicker. Each term enters the
prediction only with its evidence: the move where it is significant, the running requests where
theirs is (``running_significant``), so an engine where neither costs is routed by the policy
alone (docs/routing.md, "The time model").

No I/O; the dispatch measures the TTFT and calls ``observe`` (the only clock here paces the
hot path's re-solving, ``recent_fit``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

WINDOW = 256  # samples: each one's weight halves after about WINDOW x ln 2 newer ones
MIN_SAMPLES = 6.0  # of each kind (moved, stayed), as faded counts
SIGNIFICANCE = 2.0  # standard errors
PER_TOKEN_FLOOR_S = 1e-6  # a fit that finds waiting free is noise: a microsecond a token at least
MOVE_CAP_TOKENS = 8192.0
REFIT_SAMPLES, REFIT_S = 32, 1.0  # the hot path's fit is at most this many samples or seconds old
# wait tokens enter the fit in thousands, so the normal equations stay well conditioned
TOKEN_SCALE = 1000.0


@dataclass(frozen=True)
class TimingFit:
    """One worker's fitted figures (seconds), and how much evidence is behind them."""

    base_s: float
    per_token_s: float
    move_s: float
    move_se_s: float  # its standard error (inf: not enough samples)
    moved: float  # faded counts of samples of each kind
    stayed: float
    move_log: float = 0.0  # the move's effect on log(TTFT), and its standard error
    move_log_se: float = math.inf
    per_running_s: float = 0.0  # seconds of TTFT per request already in flight on the target
    per_running_se_s: float = math.inf
    busy: float = 0.0  # faded count of samples sent where something was in flight

    @property
    def known(self) -> bool:
        """Enough requests of each kind to judge the move."""
        return self.moved >= MIN_SAMPLES and self.stayed >= MIN_SAMPLES

    @property
    def move_significant(self) -> bool:
        return self.known and self.move_s > 0 and self.move_log > SIGNIFICANCE * self.move_log_se

    @property
    def move_tokens(self) -> float:
        """What a move costs in the policy's unit (0 unless significant)."""
        if not self.move_significant:
            return 0.0
        return min(MOVE_CAP_TOKENS, self.move_s / max(self.per_token_s, PER_TOKEN_FLOOR_S))

    @property
    def running_significant(self) -> bool:
        """Whether a request in flight measurably delays the next one's first token."""
        return (
            self.busy >= MIN_SAMPLES
            and self.stayed + self.moved - self.busy >= MIN_SAMPLES
            and self.per_running_s > SIGNIFICANCE * self.per_running_se_s
        )

    def predict(self, wait_tokens: float, running: int, moved: bool) -> float:
        """Expected TTFT (seconds) of a request sent with these figures; a term counts only
        where its evidence does (a wait never makes a request faster)."""
        seconds = self.base_s + max(self.per_token_s, 0.0) * wait_tokens
        if self.running_significant:
            seconds += self.per_running_s * running
        if moved and self.move_significant:
            seconds += self.move_s
        return seconds

    def as_dict(self) -> dict:
        se, running_se = self.move_se_s, self.per_running_se_s
        return {
            "base_ms": round(1000 * self.base_s, 2),
            "per_token_us": round(1e6 * self.per_token_s, 3),
            "per_running_ms": round(1000 * self.per_running_s, 2),
            "per_running_se_ms": round(1000 * running_se, 2) if math.isfinite(running_se) else None,
            "move_ms": round(1000 * self.move_s, 2),
            "move_se_ms": round(1000 * se, 2) if math.isfinite(se) else None,
            "move_factor": round(math.exp(self.move_log), 3),
            "moved_samples": round(self.moved, 1),
            "stayed_samples": round(self.stayed, 1),
            "busy_samples": round(self.busy, 1),
            "move_tokens": round(self.move_tokens, 1),
        }


NO_FIT = TimingFit(0.0, 0.0, 0.0, math.inf, 0.0, 0.0)
LOG_FLOOR_S = 1e-4  # log(TTFT) of a TTFT under 0.1 ms (a clock's granularity) counts as 0.1 ms


K = 4  # regressors: 1, kilotokens waited for, moved, requests running


class WorkerTiming:
    """The decayed normal equations of one worker's fit, and which of its ranks was used last."""

    def __init__(self, window: int = WINDOW):
        self.decay = 1.0 - 1.0 / window
        # sum of w x x^T over x = (1, kilotokens, moved, running): [0][0] is the faded sample
        # count and [2][2] the faded count of moves
        self.xx = [[0.0] * K for _ in range(K)]
        self.xy = [0.0] * K
        self.yy = 0.0
        self.xlog = [0.0] * K  # the same for log(TTFT)
        self.loglog = 0.0
        self.busy = 0.0  # faded count of samples with something running
        self.last_key: str | None = None  # the rank sent work most recently
        self._fit: TimingFit | None = None  # the last solve, and the samples since
        self._pending = 0
        self._solved_at = 0.0

    @property
    def n(self) -> float:
        return self.xx[0][0]

    @property
    def fit(self) -> TimingFit:
        """Solved when read (the workers API, /metrics), not at every first token."""
        if self._fit is None or self._pending:
            self._fit, self._pending, self._solved_at = self._solve(), 0, time.monotonic()
        return self._fit

    def recent_fit(self) -> TimingFit:
        """The fit for the hot path (the time check at every request): solved again once
        ``REFIT_SAMPLES`` new samples came in or ``REFIT_S`` passed since, not at every one (a
        solve is ~15-30 us of Python)."""
        if self._fit is None or (
            self._pending
            and (self._pending >= REFIT_SAMPLES or time.monotonic() - self._solved_at >= REFIT_S)
        ):
            return self.fit
        return self._fit

    def observe(self, wait_tokens: int, moved: bool, seconds: float, running: int = 0) -> None:
        d = self.decay
        x = (1.0, wait_tokens / TOKEN_SCALE, 1.0 if moved else 0.0, float(running))
        log = math.log(max(seconds, LOG_FLOOR_S))
        for i in range(K):
            self.xy[i] = self.xy[i] * d + x[i] * seconds
            self.xlog[i] = self.xlog[i] * d + x[i] * log
            row = self.xx[i]
            for j in range(K):
                row[j] = row[j] * d + x[i] * x[j]
        self.yy = self.yy * d + seconds * seconds
        self.loglog = self.loglog * d + log * log
        self.busy = self.busy * d + (1.0 if running else 0.0)
        self._pending += 1

    def _solve(self) -> TimingFit:
        # a whisker of ridge keeps a fit with one kind of sample (or one prompt size) solvable
        a = [[self.xx[i][j] + (1e-9 if i == j else 0.0) for j in range(K)] for i in range(K)]
        inv = _inverse(a)
        if inv is None:
            return NO_FIT
        moved = self.xx[2][2]
        beta, se = self._coefficients(inv, self.xy, self.yy)
        beta_log, se_log = self._coefficients(inv, self.xlog, self.loglog)
        return TimingFit(
            base_s=beta[0],
            per_token_s=beta[1] / TOKEN_SCALE,
            move_s=beta[2],
            move_se_s=se[2],
            moved=moved,
            stayed=self.n - moved,
            move_log=beta_log[2],
            move_log_se=se_log[2],
            per_running_s=beta[3],
            per_running_se_s=se[3],
            busy=self.busy,
        )

    def _coefficients(self, inv, xy, yy) -> tuple[list[float], list[float]]:
        """Least squares coefficients and their standard errors."""
        beta = [sum(inv[i][j] * xy[j] for j in range(K)) for i in range(K)]
        rss = yy - sum(beta[i] * xy[i] for i in range(K))
        dof = self.n - K
        if dof <= 0:
            return beta, [math.inf] * K
        scale = max(rss, 0.0) / dof
        return beta, [math.sqrt(scale * max(inv[i][i], 0.0)) for i in range(K)]


def _inverse(m: list[list[float]]) -> list[list[float]] | None:
    """Gauss-Jordan with partial pivoting; None when singular."""
    n = len(m)
    a = [row[:] + [1.0 if i == j else 0.0 for j in range(n)] for i, row in enumerate(m)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-18:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        p = a[col][col]
        a[col] = [v / p for v in a[col]]
        for r in range(n):
            if r != col and a[r][col]:
                f = a[r][col]
                a[r] = [v - f * w for v, w in zip(a[r], a[col], strict=True)]
    return [row[n:] for row in a]


@dataclass
class TimingSample:
    """What one dispatch is observed as at its first token."""

    timing: WorkerTiming
    wait_tokens: int
    moved: bool
    running: int = 0

    def observe(self, seconds: float) -> None:
        self.timing.observe(self.wait_tokens, self.moved, seconds, self.running)


class Timing:
    """Every worker's ``WorkerTiming``, by worker id."""

    def __init__(self):
        self.workers: dict[int, WorkerTiming] = {}

    def of(self, worker_id: int) -> WorkerTiming:
        timing = self.workers.get(worker_id)
        if timing is None:
            timing = self.workers[worker_id] = WorkerTiming()
        return timing

    def forget(self, worker_id: int) -> None:
        self.workers.pop(worker_id, None)

    def warm_keys(self, targets) -> set[str]:
        """The targets that were their worker's rank sent work most recently."""
        out = set()
        for t in targets:
            timing = self.workers.get(t.worker.worker_id)
            if timing is not None and timing.last_key == t.key:
                out.add(t.key)
        return out

    @staticmethod
    def would_move(timing: WorkerTiming, target) -> bool:
        """Whether sending work to ``target`` now wakes it: nothing in flight there, and another
        rank of its worker was sent work more recently."""
        return (
            timing.last_key is not None
            and timing.last_key != target.key
            and target.load.inflight == 0
        )

    def dispatched(self, target, wait_tokens: int) -> TimingSample:
        """``target`` was chosen (before its load begins): the sample its first token completes."""
        timing = self.of(target.worker.worker_id)
        moved = self.would_move(timing, target)
        sample = TimingSample(timing, wait_tokens, moved, target.load.inflight)
        timing.last_key = target.key
        return sample
