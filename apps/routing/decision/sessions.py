"""Session affinity: a client's session stays on the rank it started on.

A session is named by the client: the ``X-Session-ID`` header (vLLM's router, ATOMesh's
``dp_sticky``) or the OpenAI ``user`` field. The prefix index already keeps a conversation where
its history is cached; a session id also holds when the index cannot see the link (a client that
rewrites its history, a summary instead of the transcript, a tokenizer the router cannot load),
and it costs no lookup.

A session's rank is kept unless that rank is overloaded (more than ``overload_factor`` times the
other candidates' mean requests in flight, and at least ``overload_margin`` more than it) or no
longer a candidate (down, draining, removed): then the policy chooses again and the session moves
there. Entries expire ``ttl_s`` after their last request; the table is bounded (oldest dropped).
"""

from __future__ import annotations

import time
from collections import OrderedDict

SESSION_HEADER = b"x-session-id"
MAX_SESSION_ID = 256


def session_of(body: dict, headers) -> str | None:
    """The request's session id: the ``X-Session-ID`` header, else the OpenAI ``user`` field."""
    for name, value in headers or ():
        if name.lower() == SESSION_HEADER and value:
            return "h:" + value.decode("latin-1")[:MAX_SESSION_ID]
    user = body.get("user")
    if isinstance(user, str) and user:
        return "u:" + user[:MAX_SESSION_ID]
    return None


class SessionTable:
    """Session id -> the target key it lives on, with the last time it was used."""

    def __init__(
        self,
        ttl_s: float = 600.0,
        max_sessions: int = 100_000,
        overload_factor: float = 2.0,
        overload_margin: int = 4,
        clock=time.monotonic,
    ):
        self.ttl_s, self.max_sessions, self.clock = ttl_s, max_sessions, clock
        self.overload_factor, self.overload_margin = overload_factor, overload_margin
        self.homes: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self.kept = self.moved = self.started = 0  # for /metrics

    def home(self, session: str, candidates: list) -> object | None:
        """The candidate the session lives on, when it should stay there; None: let the policy
        choose (a new session, an expired one, or its rank overloaded or gone)."""
        entry = self.homes.get(session)
        if entry is None or self.clock() - entry[1] > self.ttl_s:
            return None
        target = next((t for t in candidates if t.key == entry[0]), None)
        if target is None or self._overloaded(target, candidates):
            return None
        return target

    def record(self, session: str, key: str, kept: bool) -> None:
        """The session's request went to ``key`` (``kept``: its home chose it)."""
        previous = self.homes.pop(session, None)
        self.homes[session] = (key, self.clock())
        if kept:
            self.kept += 1
        elif previous is None or self.clock() - previous[1] > self.ttl_s:
            self.started += 1
        else:
            self.moved += 1
        self._trim()

    def active(self) -> int:
        self._trim()
        return len(self.homes)

    def metric_families(self, prefix: str):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        yield GaugeMetricFamily(
            f"{prefix}_sessions", "Client sessions (X-Session-ID, user) with a home rank",
            value=self.active(),
        )  # fmt: skip
        family = CounterMetricFamily(
            f"{prefix}_session_requests",
            "Requests of named sessions: kept on their rank, started one, or moved (their rank "
            "overloaded or gone)",
            labels=["outcome"],
        )
        for outcome, value in (("kept", self.kept), ("started", self.started),
                               ("moved", self.moved)):  # fmt: skip
            family.add_metric([outcome], value)
        yield family

    def _overloaded(self, target, candidates: list) -> bool:
        others = [t.load.inflight for t in candidates if t is not target]
        if not others:
            return False
        mean = sum(others) / len(others)
        n = target.load.inflight
        return n > self.overload_factor * mean and n >= mean + self.overload_margin

    def _trim(self) -> None:
        now = self.clock()
        homes = self.homes
        while homes and (
            len(homes) > self.max_sessions or now - next(iter(homes.values()))[1] > self.ttl_s
        ):
            homes.popitem(last=False)
