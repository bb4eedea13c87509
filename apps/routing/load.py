"""In-flight load per routing target, as the router itself sees it.

A request's load begins at dispatch and ends exactly once: at the end of its stream, on an
error, a timeout or a client disconnect (``RankLoad.end`` is idempotent, and callers end it in a
``finally``). Prefill work is counted separately until the first token arrives, because that is
the work that delays a newcomer's first token.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

RECENT_HALF_LIFE_S = 3.0
SESSION_HALF_LIFE_S = 30.0  # chat think times are seconds to minutes


@dataclass
class LoadTicket:
    prompt_tokens: int
    prefill_tokens: int  # the uncached part, as predicted at dispatch
    prefilled: bool = False
    ended: bool = False


class RankLoad:
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

    def _decay(self, now: float) -> float:
        return math.exp2(-(now - self._recent_at) / RECENT_HALF_LIFE_S)

    def recent_tokens(self, now: float | None = None) -> float:
        """Prompt tokens dispatched here lately, decayed with a 3 s half-life: who has been
        serving the sessions that are still active, which in-flight counts alone miss between turns."""
        now = self.clock() if now is None else now
        return self._recent * self._decay(now)

    def recent_requests(self, now: float | None = None) -> float:
        """Requests dispatched here lately (same decay): the session count, whatever their size."""
        now = self.clock() if now is None else now
        return self._recent_n * self._decay(now)

    def active_sessions(self, now: float | None = None) -> float:
        """Sessions served here lately: turns whose private history was already here and chat
        requests that started a conversation here (the router decides which: ``begin``'s
        ``continues_session``), decayed with a 30 s half-life. One-shot completions (however many)
        never count, so a burst of them does not make a rank look busy once it is over."""
        now = self.clock() if now is None else now
        return self._sessions * math.exp2(-(now - self._sessions_at) / SESSION_HALF_LIFE_S)

    def begin(self, prompt_tokens: int, prefill_tokens: int, continues_session: bool = False) -> LoadTicket:
        self.requests += 1
        self.prompt_tokens += prompt_tokens
        self.pending_prefill_tokens += prefill_tokens
        self.dispatched += 1
        now = self.clock()
        decay = self._decay(now)
        self._recent, self._recent_n = self._recent * decay + prompt_tokens, self._recent_n * decay + 1
        self._recent_at = now
        if continues_session:
            self._sessions, self._sessions_at = self.active_sessions(now) + 1, now
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
