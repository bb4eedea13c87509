"""Admission control: how much work this router process lets through to the engines at once, and
what the rest does meanwhile.

A request is admitted (``Admission.acquire`` returns a ``Slot``) when

- a slot is free: fewer than ``--max-concurrent-requests`` requests admitted and not ended yet
  (0: no limit), and
- the fleet is not saturated (``fleet_saturated``, apps/routing/proxy/saturation.py): some
  available target is below ``--saturation-queued-prefill-tokens`` queued prefill tokens and,
  where its KV usage is known, below ``--saturation-kv-usage``. Both 0: the rule is off.

Otherwise it waits in one queue, the lowest ``X-Priority`` first (vLLM's order), then by arrival.
Within a priority, tenants (proxy/tenants.py: ``X-Tenant-Id`` or the API key) share the queue
fairly: the waiter whose tenant has the fewest requests admitted now plus granted lately goes
first (``_next``), so one tenant's burst does not hold the others behind it.
When ``--queue-size`` requests are waiting already, or it could no longer have its first token
within ``--queue-timeout-secs`` of its arrival, it is ``Rejected``: 429 with ``Retry-After``, in
OpenAI's rate-limit shape. "Could no longer": its wait so far plus the time the engines took
lately from dispatch to first token (the longest of the last ``FIRST_TOKEN_WINDOW`` streamed
requests': a non-streamed one's first token is not seen; at most half the timeout; 0 before any)
is past the timeout. So a request that had to wait gets its first
token within the timeout, not the timeout plus a prefill: the timeout bounds the TTFT of what is
admitted, and a client that would miss it hears so early. While the process drains
(apps/routing/proxy/drain.py) every waiting and every new request is rejected with a 503.

Waiters are woken when a slot is released, when a dispatched request's prefill ends (its tokens
leave the targets' queues: this is a ``DispatchObserver``), and, while the fleet stays saturated,
every ``SATURATION_POLL_S`` (the other router processes' load and the engines' KV usage change
without telling this one; the KV usage changes here when ``FleetSync`` next applies a scrape).
One waiter is granted per turn of the event loop, so the one just admitted has routed, and its
load counts, before the next one is weighed.

A slot is released exactly once (``Slot.release`` is idempotent; the endpoint releases it in a
``finally``, after every retry). A waiter whose client leaves is dropped from the queue; one
granted in the same instant releases the slot it was given.
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import itertools
import math
import time
from collections import deque

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from apps.routing.decision.dispatch import DispatchObserver
from apps.routing.decision.router_stats import Histogram
from apps.routing.metrics import PREFIX
from apps.routing.proxy.saturation import fleet_saturated
from controlplane.errors import error_bytes

SATURATION_POLL_S = 0.05
REASONS = ("queue_full", "timeout", "draining")
DRAIN_RETRY_AFTER_S = 1  # the process is going away: retry soon (a load balancer: elsewhere)
HOLD_EWMA = 0.2  # weight of the newest slot hold time in the estimate behind Retry-After
FIRST_TOKEN_WINDOW = 64  # recent dispatch-to-first-token times a waiter's deadline allows for
FAIR_HALF_LIFE_S = 10.0  # how long a tenant's grants count against its next turn in the queue
MAX_TENANTS_KEPT = 10_000  # tenants remembered for that, before the forgotten are dropped


class Rejected(Exception):
    """A request refused admission: ``reason`` (one of ``REASONS``) and when to retry."""

    def __init__(self, reason: str, message: str, retry_after_s: int):
        super().__init__(message)
        self.reason, self.retry_after_s = reason, retry_after_s

    @property
    def status(self) -> int:
        return 503 if self.reason == "draining" else 429

    def body(self) -> bytes:
        if self.reason == "draining":
            return error_bytes(503, str(self), "server_error")
        return error_bytes(429, str(self), "requests", code="rate_limit_exceeded")

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"retry-after", str(self.retry_after_s).encode())]


class Slot:
    """One admitted request's place; ``release`` gives it back (once, however often called)."""

    __slots__ = ("_admission", "granted_at", "released", "tenant")

    def __init__(self, admission: Admission, granted_at: float, tenant: str | None = None):
        self._admission, self.granted_at, self.released = admission, granted_at, False
        self.tenant = tenant

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._admission._released(self)


class _Waiter:
    __slots__ = ("arrived", "future", "queued", "timer", "tenant")

    def __init__(self, arrived: float, future: asyncio.Future, tenant: str | None = None):
        self.arrived, self.future, self.queued = arrived, future, True
        self.timer: asyncio.TimerHandle | None = None
        self.tenant = tenant


class Admission(DispatchObserver):
    """The admission queue of one router process. Lives on the event loop (no locks).

    ``saturated``: a no-argument predicate, True while new requests should wait although a slot
    is free (``fleet_saturated`` bound to the fleet and its thresholds); None: no such rule.
    """

    def __init__(
        self,
        *,
        max_concurrent: int = 0,
        queue_size: int = 100,
        queue_timeout_s: float = 60.0,
        saturated=None,
        clock=time.monotonic,
    ):
        self.max_concurrent = max(0, max_concurrent)  # smg's -1 (off) is 0 here too
        self.queue_size = max(0, queue_size)
        self.queue_timeout_s = queue_timeout_s
        self.saturated = saturated
        self.clock = clock
        self.in_flight = 0  # admitted, not released
        self.waiting = 0  # queued, not granted, expired, rejected or gone
        self.draining = False
        self.rejected = dict.fromkeys(REASONS, 0)
        self.wait_time = Histogram()  # admitted requests: arrival to admission
        self._heap: list[tuple[int, int, _Waiter]] = []  # (priority, arrival order, waiter)
        self._order = itertools.count()
        self._hold_s: float | None = None  # how long a slot is held, on average lately
        self._first_token_s: deque[float] = deque(maxlen=FIRST_TOKEN_WINDOW)
        self._kick_pending = self._poll_pending = False
        # fair share between tenants (``_next``): admitted now, and granted lately (decayed)
        self.admitted_by_tenant: dict[str, int] = {}
        self._granted_lately: dict[str, tuple[float, float]] = {}  # tenant -> (count, at)

    # ----- the request's side ---------------------------------------------------------------------
    async def acquire(self, priority: int = 0, tenant: str | None = None) -> Slot:
        """Admit a request: at once when it can go and nobody waits, else when its turn comes.
        Raises ``Rejected``. Cancelled while waiting (the client left), it leaves the queue, and a
        slot granted in the same instant is released."""
        if self.draining:
            raise self._reject("draining", "the router is shutting down; retry elsewhere or later")
        slot = self.admit_now(tenant)
        if slot is not None:
            return slot
        if self.waiting >= self.queue_size:
            raise self._reject(
                "queue_full",
                f"the router is at capacity: {self.in_flight} requests admitted, {self.waiting} "
                f"waiting (the queue holds {self.queue_size}); retry later",
            )
        return await self._wait(priority, tenant)

    def admit_now(self, tenant: str | None = None) -> Slot | None:
        """``acquire``'s first step, with no await: a slot when the request can go at once and
        nobody waits, else None (then ``acquire`` says why not, or queues it)."""
        if self.draining or self.waiting or not self._slot_free() or self._fleet_saturated():
            return None
        return self._grant(0.0, tenant)

    async def _wait(self, priority: int, tenant: str | None) -> Slot:
        loop = asyncio.get_running_loop()
        waiter = _Waiter(self.clock(), loop.create_future(), tenant)
        heapq.heappush(self._heap, (priority, next(self._order), waiter))
        self.waiting += 1
        self._arm(waiter)
        self._kick()
        try:
            return await waiter.future
        except asyncio.CancelledError:
            future = waiter.future
            if future.done() and not future.cancelled() and future.exception() is None:
                future.result().release()  # granted as the client left
            self._leave(waiter)
            raise
        finally:
            if waiter.timer is not None:
                waiter.timer.cancel()

    def _grant(self, waited_s: float, tenant: str | None = None) -> Slot:
        self.in_flight += 1
        self.wait_time.observe(waited_s)
        if tenant is not None:
            self.admitted_by_tenant[tenant] = self.admitted_by_tenant.get(tenant, 0) + 1
            now = self.clock()
            self._granted_lately[tenant] = (self._lately(tenant, now) + 1.0, now)
            if len(self._granted_lately) > MAX_TENANTS_KEPT:
                self._granted_lately = {
                    t: v for t, v in self._granted_lately.items() if self._lately(t, now) > 0.01
                }
        return Slot(self, self.clock(), tenant)

    def _lately(self, tenant: str, now: float) -> float:
        count, at = self._granted_lately.get(tenant, (0.0, now))
        return count * math.exp2(-(now - at) / FAIR_HALF_LIFE_S)

    def _released(self, slot: Slot) -> None:
        self.in_flight -= 1
        if slot.tenant is not None:
            left = self.admitted_by_tenant.get(slot.tenant, 0) - 1
            if left > 0:
                self.admitted_by_tenant[slot.tenant] = left
            else:
                self.admitted_by_tenant.pop(slot.tenant, None)
        held = self.clock() - slot.granted_at
        self._hold_s = (
            held if self._hold_s is None else self._hold_s + HOLD_EWMA * (held - self._hold_s)
        )
        if self.waiting:
            self._kick()

    def _leave(self, waiter: _Waiter) -> None:
        if waiter.queued:
            waiter.queued = False
            self.waiting -= 1
            self._compact()

    def expected_first_token_s(self) -> float:
        """What a request admitted now should allow for until its first token: the longest of
        the last ``FIRST_TOKEN_WINDOW`` dispatch-to-first-token times, at most half the queue
        timeout (a spike must not close the queue); 0 before any."""
        if not self._first_token_s:
            return 0.0
        return min(max(self._first_token_s), self.queue_timeout_s / 2)

    def _deadline(self, waiter: _Waiter) -> float:
        """The last moment ``waiter`` can be admitted and still see its first token in time."""
        return waiter.arrived + self.queue_timeout_s - self.expected_first_token_s()

    def _arm(self, waiter: _Waiter) -> None:
        delay = max(0.0, self._deadline(waiter) - self.clock())
        waiter.timer = asyncio.get_running_loop().call_later(delay, self._expire, waiter)

    def _expire(self, waiter: _Waiter) -> None:
        if not waiter.queued or waiter.future.done():
            return
        if self._deadline(waiter) - self.clock() > 1e-3:  # the estimate fell: it may wait on
            self._arm(waiter)
            return
        self._leave(waiter)
        waited = self.clock() - waiter.arrived
        waiter.future.set_exception(
            self._reject(
                "timeout",
                f"the request waited {waited:.3g} s for admission; with the engines' recent time "
                f"to a first token ({self.expected_first_token_s():.3g} s) it could not start "
                f"within the queue timeout ({self.queue_timeout_s:g} s): the engines are busy; "
                "retry later",
            )
        )

    # ----- the queue's side -----------------------------------------------------------------------
    def _slot_free(self) -> bool:
        return not self.max_concurrent or self.in_flight < self.max_concurrent

    def _fleet_saturated(self) -> bool:
        return self.saturated is not None and self.saturated()

    def _kick(self) -> None:
        """Weigh the queue's head on the loop's next turn (once, however often asked)."""
        if not self._kick_pending:
            self._kick_pending = True
            asyncio.get_running_loop().call_soon(self._dispatch)

    def _dispatch(self) -> None:
        self._kick_pending = False
        waiter = self._next()
        if waiter is None or not self._slot_free():
            return  # a release kicks again
        if self._fleet_saturated():
            self._poll_later()
            return
        if self.clock() >= self._deadline(waiter):  # too late to start in time (the estimate rose)
            self._expire(waiter)
            self._kick()
            return
        self._leave(waiter)  # out of the heap lazily (``_head``)
        waiter.future.set_result(self._grant(self.clock() - waiter.arrived, waiter.tenant))
        if self.waiting:  # after the granted one has routed: its load then counts
            self._kick()

    def _next(self) -> _Waiter | None:
        """Who goes next: of the waiters at the best priority, the one whose tenant has the
        fewest requests admitted now plus granted lately (a decayed count, ``FAIR_HALF_LIFE_S``),
        then the first to arrive: a tenant that floods the queue waits behind the others' first
        requests, not ahead of them. In arrival order when the head says no tenant."""
        head = self._head()
        if head is None or head.tenant is None:
            return head
        best, now = self._heap[0][0], self.clock()

        def share(entry) -> tuple[float, int]:
            tenant = entry[2].tenant
            if tenant is None:
                return 0.0, entry[1]
            return self.admitted_by_tenant.get(tenant, 0) + self._lately(tenant, now), entry[1]

        waiting = (entry for entry in self._heap if entry[0] == best and entry[2].queued)
        return min(waiting, key=share)[2]

    def _head(self) -> _Waiter | None:
        while self._heap and not self._heap[0][2].queued:
            heapq.heappop(self._heap)
        return self._heap[0][2] if self._heap else None

    def _poll_later(self) -> None:
        if not self._poll_pending:
            self._poll_pending = True
            asyncio.get_running_loop().call_later(SATURATION_POLL_S, self._polled)

    def _polled(self) -> None:
        self._poll_pending = False
        self._dispatch()

    def _compact(self) -> None:
        """Drop entries of waiters gone from the queue (they are skipped lazily at the head)."""
        if not self.waiting:
            self._heap.clear()
        elif len(self._heap) > 2 * self.waiting + 64:
            self._heap = [entry for entry in self._heap if entry[2].queued]
            heapq.heapify(self._heap)

    def _reject(self, reason: str, message: str) -> Rejected:
        self.rejected[reason] += 1
        retry = DRAIN_RETRY_AFTER_S if reason == "draining" else self.retry_after_s()
        return Rejected(reason, message, retry)

    def retry_after_s(self) -> int:
        """When a retry would likely find room: the queue ahead served at the slots' recent pace
        (waiting x mean hold time / slots), at least 1 s and at most the queue timeout; the
        timeout itself when there is no pace to go by (no slot released yet, no concurrency
        limit, or the fleet saturated: the engines, not the slots, hold the queue back)."""
        ceiling = max(1, math.ceil(self.queue_timeout_s))
        if not self.max_concurrent or self._hold_s is None or self._fleet_saturated():
            return ceiling
        estimate = (self.waiting + 1) * self._hold_s / self.max_concurrent
        return min(ceiling, max(1, math.ceil(estimate)))

    # ----- the process's side ---------------------------------------------------------------------
    def drain(self) -> None:
        """Stop admitting: every waiting request is rejected now, every new one at once; those
        admitted run on (``in_flight`` says how many are left)."""
        self.draining = True
        waiters = [entry[2] for entry in self._heap if entry[2].queued]
        for waiter in waiters:
            self._leave(waiter)
            waiter.future.set_exception(
                self._reject("draining", "the router is shutting down; retry elsewhere or later")
            )

    def check_integrity(self) -> None:
        """Raise with the actual numbers unless the counts agree with the queue (for tests)."""
        queued = sum(1 for entry in self._heap if entry[2].queued)
        limit = self.max_concurrent or math.inf
        if queued != self.waiting or not 0 <= self.in_flight <= limit or self.waiting < 0:
            raise AssertionError(
                f"admission: {self.waiting} waiting but {queued} queued (heap {len(self._heap)}); "
                f"{self.in_flight} admitted, limit {self.max_concurrent}"
            )

    def snapshot(self) -> dict:
        """For the dashboard's fleet summary."""
        return {
            "queue_depth": self.waiting,
            "admitted_requests": self.in_flight,
            "rejected_requests": sum(self.rejected.values()),
            "rejected_by_reason": dict(self.rejected),
            "saturated": self._fleet_saturated(),
            "draining": self.draining,
        }

    # ----- DispatchObserver -----------------------------------------------------------------------
    def routed(self, key: str, digests: list[int]) -> None:
        pass

    def prefilled(self, key: str, digests: list[int]) -> None:
        if self.waiting and self.saturated is not None:  # its queued prefill just went down
            self._kick()

    def first_token(self, key: str, seconds: float) -> None:
        self._first_token_s.append(seconds)

    def metric_families(self):
        yield GaugeMetricFamily(
            f"{PREFIX}_queue_depth",
            "Requests waiting for admission in this router process",
            value=self.waiting,
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_admitted_requests",
            "Requests admitted and not ended in this router process (--max-concurrent-requests)",
            value=self.in_flight,
        )
        wait = HistogramMetricFamily(
            f"{PREFIX}_queue_wait_seconds",
            "Admitted requests: arrival to admission (0 when admitted at once)",
        )
        wait.add_metric([], self.wait_time.cumulative(), sum_value=self.wait_time.sum)
        yield wait
        yield GaugeMetricFamily(
            f"{PREFIX}_expected_first_token_seconds",
            "What a queued request must leave for its first token before --queue-timeout-secs "
            "(the longest recent dispatch-to-first-token time, at most half the timeout)",
            value=self.expected_first_token_s(),
        )
        rejected = CounterMetricFamily(
            f"{PREFIX}_rejected_requests",
            "Requests refused admission: queue_full and timeout (429), draining (503)",
            labels=["reason"],
        )
        for reason in REASONS:
            rejected.add_metric([reason], self.rejected[reason])
        yield rejected
        yield GaugeMetricFamily(
            f"{PREFIX}_fleet_saturated",
            "1 while every available target is above a saturation threshold (new requests wait)",
            value=int(self._fleet_saturated()),
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_draining",
            "1 while this router process drains before it stops (new requests get 503)",
            value=int(self.draining),
        )


def make_admission(router) -> Admission:
    """The router process's admission control, made from its config and attached as one of the
    router's dispatch observers (it hears of prefill ends, and its /metrics come with the
    router's). The process makes one (apps/routing/process.py) and hands it to the endpoint, the
    drain and the dashboard."""
    c = router.config
    thresholds = (c.saturation_queued_prefill_tokens, c.saturation_kv_usage)
    admission = Admission(
        max_concurrent=c.max_concurrent_requests,
        queue_size=c.queue_size,
        queue_timeout_s=c.queue_timeout_s,
        saturated=functools.partial(fleet_saturated, router.fleet, *thresholds)
        if any(t > 0 for t in thresholds)
        else None,
    )
    router.observers.append(admission)
    return admission
