"""One dispatched request, from the routing decision to its end.

``Router.route`` chooses a target, commits (begins the target's load, inserts the request's blocks
into the index, tells the observers) and returns a ``Dispatch``. From then on the dispatch owns the
request's two ends, each happening once however the request goes:

- ``first_token``: the engine has computed the prompt (its first token arrived): the prefill no
  longer weighs on the target's queue, and the time to first token is observed;
- ``finish``: the request ended (``ok``, with the engine's usage; or an error; or ``aborted``: the
  client left first). The load ends, the latency is observed, the circuit breaker and the stats
  are told.

Both ends tell the ``DispatchObserver``s that the prefill is over (a request that ends before its
first token has given up on it). The load ticket is the one record of which ends have happened.
The proxy (apps/routing/proxy/upstream.py) calls ``finish`` from one ``finally`` per attempt;
nothing else ends a request's load.
"""

from __future__ import annotations

import abc
import time

from apps.routing.decision.fleet import Target
from apps.routing.decision.load import LoadTicket
from apps.routing.decision.misses import MissPlan, MissReasons
from apps.routing.decision.request_shape import RequestShape
from apps.routing.decision.router_stats import RouterStats
from apps.routing.decision.timing import TimingSample


class DispatchObserver(abc.ABC):
    """Told of every routing decision and of every request's prefill end, on the event loop
    (implementations must not block: the shared index queues, the KV-event feed counts)."""

    @abc.abstractmethod
    def routed(self, key: str, digests: list[int]) -> None:
        """A request with these block digests was just sent to target ``key``."""

    def prefilled(self, key: str, digests: list[int]) -> None:  # noqa: B027 (optional hook)
        """That request's prompt is computed (first token) or abandoned (it ended first)."""

    def first_token(self, key: str, seconds: float) -> None:  # noqa: B027 (optional hook)
        """That request's first token came ``seconds`` after it was sent to target ``key``."""

    def metric_families(self):
        """Prometheus metric families about this observer, for the router's /metrics."""
        return ()

    def target_state(self, key: str) -> dict:
        """What this observer knows of target ``key``, for the workers API."""
        return {}


class Dispatch:
    """A request sent to ``target``: what the index predicted, its load ticket, its timing."""

    __slots__ = ("target", "shape", "predicted_tokens", "ticket", "trial", "started", "_stats",
                 "_observers", "timing_sample", "_clock", "plan", "_misses", "_explained",
                 "pending", "_reported")  # fmt: skip

    def __init__(
        self,
        target: Target,
        shape: RequestShape,
        predicted_tokens: int,
        *,
        trial: bool,
        stats: RouterStats,
        observers: list[DispatchObserver],
        clock=time.perf_counter,
        misses: MissReasons | None = None,
    ):
        self.target, self.shape, self.predicted_tokens = target, shape, predicted_tokens
        # the load's ticket; None until the router's commit begins it (``settle``), which every
        # reader of it here runs first
        self.ticket: LoadTicket | None = None
        self.trial = trial  # the half-open circuit's one trial request
        self._clock = clock  # the router's (the routing lab's is virtual)
        self.started = clock()
        self._stats, self._observers = stats, observers
        # the router's time model learns from this request's first token (set with the ticket)
        self.timing_sample: TimingSample | None = None
        # what the router knew, to name the reason of every prompt token the engine computed
        # (apps/routing/decision/misses.py): the plan is the router's commit's to set (``settle``);
        # both None where it predicts nothing (a passthrough path, a decode leg)
        self.plan: MissPlan | None = None
        self._misses = misses
        self._explained: tuple | None = None
        self._reported: tuple | None = None  # (a usage, its cached tokens): ``cached_tokens``
        # the rest of the router's commit, where it was left for after the send
        # (``Router.route(settle_later=True)``); ``settle`` runs it, once
        self.pending = None

    def settle(self) -> None:
        """Finish the router's commit (the index, the observers, the stats, the miss plan), if
        it was left for later; idempotent. Every end of the dispatch settles it first."""
        pending = self.pending
        if pending is not None:
            self.pending = None
            pending()

    @property
    def explains(self) -> bool:
        """Whether the router names the reasons of this request's misses (it predicts where its
        prompt is cached: not a passthrough path, not a decode leg)."""
        return self._misses is not None

    @property
    def prefill_tokens(self) -> int:
        """The prompt tokens the index expected the engine to compute (not cached there)."""
        self.settle()
        return self.ticket.prefill_tokens

    @property
    def finished(self) -> bool:
        self.settle()
        return self.ticket.ended

    def first_token(self) -> None:
        """The first token arrived (idempotent; a no-op once finished)."""
        self.settle()
        if self.ticket.prefilled:
            return
        self.target.load.first_token(self.ticket)
        self._tell_prefilled()
        seconds = self._clock() - self.started
        self._stats.ttft.observe(seconds)
        if self.timing_sample is not None:
            self.timing_sample.observe(seconds)
        for observer in self._observers:
            observer.first_token(self.target.key, seconds)

    def cached_tokens(self, usage: dict | None) -> int | None:
        """``cached_of(usage)``, read once per usage (the answer's header, the end and the miss
        reasons all ask)."""
        reported = self._reported
        if reported is not None and reported[0] is usage:
            return reported[1]
        cached = cached_of(usage)
        self._reported = (usage, cached)
        return cached

    def miss_reasons(self, usage: dict | None) -> dict[str, int] | None:
        """Tokens per reason for the prompt tokens the engine computed (its ``usage`` says how
        many it had cached; without them: the reasons expected if it had what the router
        predicted). None where the router predicts nothing. Worked out once per usage."""
        self.settle()
        if self.plan is None or self._misses is None:
            return None
        cached = self.cached_tokens(usage)
        prompt = (usage or {}).get("prompt_tokens") if cached is not None else None
        if not isinstance(prompt, int):
            prompt = self.plan.shape.prompt_tokens
        key = (prompt, self.predicted_tokens if cached is None else cached)
        if self._explained is None or self._explained[0] != key:
            self._explained = (key, *self._misses.explain(self.plan, *key))
        return self._explained[1]

    def finish(self, *, ok: bool, usage: dict | None = None, aborted: bool = False) -> None:
        """End the request (idempotent). ``usage``: the engine's, for its cached tokens;
        ``aborted``: the client left first (not the target's error)."""
        self.settle()
        if self.ticket.ended:
            return
        if not self.ticket.prefilled:
            self._tell_prefilled()
        self.target.load.end(self.ticket)
        self._stats.latency.observe(self._clock() - self.started)
        breaker = self.target.breaker
        if ok:
            breaker.record_success()
        if self.trial:
            breaker.trial_done()
        cached = self.cached_tokens(usage)
        self._stats.finished(
            self.target.key, ok=ok, cached_tokens=cached, aborted=aborted and not ok
        )
        if ok and cached is not None and self.miss_reasons(usage) is not None:
            _, reasons, diverged_at = self._explained
            self._misses.count(self.plan, reasons, diverged_at)

    def unreachable(self) -> None:
        """The target failed before answering anything (refused, reset, a retryable status):
        it counts against its circuit breaker, and the proxy tries another target."""
        self.target.breaker.record_failure()
        self.finish(ok=False)
        self._stats.retries += 1

    def _tell_prefilled(self) -> None:
        for observer in self._observers:
            observer.prefilled(self.target.key, self.shape.digests)


def cached_of(usage: dict | None) -> int | None:
    """The engine's cached prompt tokens in an OpenAI ``usage`` (None: not reported)."""
    details = (usage or {}).get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if isinstance(cached, int) and not isinstance(cached, bool) else None
