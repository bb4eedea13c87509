"""In-flight load per routing target, as the router itself sees it.

A request's load begins at dispatch and ends exactly once: at the end of its stream, on an
error, a timeout or a client disconnect (``RankLoad.end`` is idempotent, and callers end it in a
``finally``). Prefill work is counted separately until the first token arrives, because that is
the work that delays a newcomer's first token.

With several router processes (``REDIS_URL``), each also knows the others' load on the same
target, as they last published it (apps/routing/feeds/shared_index.py): ``set_peer`` /
``drop_peer``. The policies read the totals (``inflight``, ``inflight_tokens``,
``queued_prefill_tokens``, ``active_sessions``, ``recent_requests``); the plain counters
(``requests``, ``prompt_tokens``, ``pending_prefill_tokens``) stay this process's own, and only they
are ever published.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

RECENT_HALF_LIFE_S = 3.0
SESSION_HALF_LIFE_S = 30.0  # chat think times are seconds to minutes


@dataclass(frozen=True)
class PeerLoad:
    """Another router process's own load on a target, as published, and when it arrived here."""

    requests: int
    prompt_tokens: int
    prefill_tokens: int
    sessions: float  # its active_sessions() when it published
    recent: float  # its recent_requests() when it published
    at: float  # this process's clock


@dataclass
class LoadTicket:
    prompt_tokens: int
    prefill_tokens: int  # the uncached part, as predicted at dispatch
    prefilled: bool = False
    ended: bool = False


class RankLoad:
    """One target's load. cache_aware's compiled choice (csrc/cache_aware.c) reads the counters
    ``totals`` and ``recent_requests`` read (``requests``, ``peer_requests``,
    ``pending_prefill_tokens``, ``peer_prefill_tokens``, ``_sessions``, ``_sessions_at``,
    ``_recent_n``, ``_recent_at``, ``peers``) by name: a change to how those two work out their
    figures is a change there too (tests/routing/test_cache_aware_kernel.py compares them)."""

    def __init__(self, clock=time.monotonic):
        self.requests = 0
        self.prompt_tokens = 0
        self.pending_prefill_tokens = 0
        self.dispatched = 0  # requests ever sent here
        self.clock = clock
        self._recent = 0.0  # prompt tokens
        self._recent_n = 0.0  # requests
        self._recent_at = clock()
        self._sessions = 0.0  # turns of continuing sessions
        self._sessions_at = self._recent_at
        self.peers: dict[str, PeerLoad] = {}  # other router process -> its load here
        self.peer_requests = self.peer_prompt_tokens = self.peer_prefill_tokens = 0

    # ----- totals over this process and its peers: what the policies read -------------------------
    @property
    def inflight(self) -> int:
        return self.requests + self.peer_requests

    @property
    def inflight_tokens(self) -> int:
        return self.prompt_tokens + self.peer_prompt_tokens

    @property
    def queued_prefill_tokens(self) -> int:
        return self.pending_prefill_tokens + self.peer_prefill_tokens

    def set_peer(
        self,
        origin: str,
        requests: int,
        prompt_tokens: int,
        prefill_tokens: int,
        sessions: float = 0.0,
        recent: float = 0.0,
    ) -> None:
        self.peers[origin] = PeerLoad(
            requests, prompt_tokens, prefill_tokens, sessions, recent, self.clock()
        )
        self._sum_peers()

    def drop_peer(self, origin: str) -> None:
        if self.peers.pop(origin, None) is not None:
            self._sum_peers()

    def _sum_peers(self) -> None:
        peers = self.peers.values()
        self.peer_requests = sum(p.requests for p in peers)
        self.peer_prompt_tokens = sum(p.prompt_tokens for p in peers)
        self.peer_prefill_tokens = sum(p.prefill_tokens for p in peers)

    def _peers_decayed(self, field: str, half_life: float, now: float) -> float:
        if not self.peers:  # the usual case (one router process): no generator on the hot path
            return 0.0
        return sum(
            getattr(p, field) * math.exp2(-(now - p.at) / half_life) for p in self.peers.values()
        )

    def _decay(self, now: float) -> float:
        return math.exp2(-(now - self._recent_at) / RECENT_HALF_LIFE_S)

    def recent_tokens(self, now: float | None = None) -> float:
        """Prompt tokens dispatched here lately, decayed with a 3 s half-life: who has been
        serving the sessions that are still active, which in-flight counts alone miss between
        turns."""
        now = self.clock() if now is None else now
        return self._recent * self._decay(now)

    def recent_requests(self, now: float | None = None) -> float:
        """Requests dispatched here lately (same decay): the session count, whatever their size."""
        now = self.clock() if now is None else now
        return self.own_recent_requests(now) + self._peers_decayed(
            "recent", RECENT_HALF_LIFE_S, now
        )

    def own_recent_requests(self, now: float | None = None) -> float:
        now = self.clock() if now is None else now
        return self._recent_n * self._decay(now)

    def active_sessions(self, now: float | None = None) -> float:
        """Sessions served here lately: turns whose private history was already here and chat
        requests that started a conversation here (the router decides which: ``begin``'s
        ``continues_session``), decayed with a 30 s half-life. One-shot completions (however many)
        never count, so a burst of them does not make a rank look busy once it is over."""
        now = self.clock() if now is None else now
        return self.own_active_sessions(now) + self._peers_decayed(
            "sessions", SESSION_HALF_LIFE_S, now
        )

    def own_active_sessions(self, now: float | None = None) -> float:
        if not self._sessions:  # completions only (they start no session): the usual case
            return 0.0
        now = self.clock() if now is None else now
        return self._sessions * math.exp2(-(now - self._sessions_at) / SESSION_HALF_LIFE_S)

    def totals(self, now: float) -> tuple[int, float, int]:
        """``inflight``, ``active_sessions(now)`` and ``queued_prefill_tokens`` in one call (a
        policy reads them for every candidate of every request)."""
        return (self.requests + self.peer_requests, self.active_sessions(now),
                self.pending_prefill_tokens + self.peer_prefill_tokens)  # fmt: skip

    def begin(
        self, prompt_tokens: int, prefill_tokens: int, continues_session: bool = False
    ) -> LoadTicket:
        self.requests += 1
        self.prompt_tokens += prompt_tokens
        self.pending_prefill_tokens += prefill_tokens
        self.dispatched += 1
        now = self.clock()
        decay = self._decay(now)
        self._recent, self._recent_n = (
            self._recent * decay + prompt_tokens,
            self._recent_n * decay + 1,
        )
        self._recent_at = now
        if continues_session:
            self._sessions, self._sessions_at = self.own_active_sessions(now) + 1, now
        return LoadTicket(prompt_tokens, prefill_tokens)

    def first_token(self, ticket: LoadTicket) -> None:
        """The prefill is done: its tokens no longer delay anyone."""
        if not ticket.prefilled and not ticket.ended:
            ticket.prefilled = True
            self.pending_prefill_tokens -= ticket.prefill_tokens

    def end(self, ticket: LoadTicket) -> None:
        if ticket.ended:
            return
        self.first_token(ticket)
        ticket.ended = True
        self.requests -= 1
        self.prompt_tokens -= ticket.prompt_tokens

    @property
    def idle(self) -> bool:
        return self.requests == 0 and self.prompt_tokens == 0 and self.pending_prefill_tokens == 0
