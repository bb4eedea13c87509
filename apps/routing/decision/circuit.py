"""A circuit breaker per routing target (SGLang router's defaults: 10 failures in 120 s open it
for 60 s; then one trial request at a time, and 3 successes close it)."""

from __future__ import annotations

import time
from collections import deque


class CircuitBreaker:
    CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"

    def __init__(
        self,
        failure_threshold: int = 10,
        window_s: float = 120.0,
        open_s: float = 60.0,
        success_threshold: int = 3,
        clock=time.monotonic,
    ):
        self.failure_threshold, self.window_s, self.open_s = failure_threshold, window_s, open_s
        self.success_threshold = success_threshold
        self.clock = clock
        self.failures: deque[float] = deque()
        self.opened_at: float | None = None
        self.successes = 0
        self.trial_in_flight = False  # half-open: one request at a time tests the target
        self._state = self.CLOSED

    @property
    def state(self) -> str:
        if self._state == self.OPEN and self.clock() - self.opened_at >= self.open_s:
            self._state, self.successes = self.HALF_OPEN, 0
        return self._state

    def allows(self) -> bool:
        if self._state == self.CLOSED:  # the usual case, read for every target of every request
            return True
        state = self.state
        return state == self.CLOSED or (state == self.HALF_OPEN and not self.trial_in_flight)

    def dispatched(self) -> bool:
        """A request was sent to the target: when half-open it is the trial, and no other request
        is allowed until ``trial_done``. Returns whether it is the trial."""
        if self.state == self.HALF_OPEN:
            self.trial_in_flight = True
            return True
        return False

    def trial_done(self) -> None:
        """The trial request ended (whatever its outcome: success and failure are recorded
        apart)."""
        self.trial_in_flight = False

    def record_success(self) -> None:
        if self.state == self.HALF_OPEN:
            self.successes += 1
            if self.successes >= self.success_threshold:
                self._state, self.trial_in_flight = self.CLOSED, False
                self.failures.clear()

    def record_failure(self) -> None:
        now = self.clock()
        if self.state == self.HALF_OPEN:
            self._open(now)
            return
        self.failures.append(now)
        while self.failures and now - self.failures[0] > self.window_s:
            self.failures.popleft()
        if len(self.failures) >= self.failure_threshold:
            self._open(now)

    def _open(self, now: float) -> None:
        self._state, self.opened_at, self.trial_in_flight = self.OPEN, now, False
        self.failures.clear()
