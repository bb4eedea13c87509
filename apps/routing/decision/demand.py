"""What the recent traffic asks of the fleet: how hot each shared prefix is (``PrefixDemand``, the
policy copies only a hot one) and how many prompt tokens each target has served lately
(``ServedVolume``, with every router process's share), both decaying with time."""

from __future__ import annotations

import time


def decayed(value: float, at: float, now: float, half_life_s: float) -> float:
    """``value`` as of ``at``, halved every ``half_life_s`` up to ``now``."""
    return value * 0.5 ** ((now - at) / half_life_s)


class PrefixDemand:
    """How much of the recent traffic each shared prefix carries: a count per prefix (named by
    the digest of its last block, where requests branch) and one over all requests, both decayed
    with a half-life of ``half_life_s``. ``share`` is the first over the second.

    The cost model reads it to tell a hot prefix, one that needs more ranks than hold it, from a
    prefix its holders can serve at their fair share of the traffic; only the first is worth
    copying to an idle rank when requests happen to bunch up on its home."""

    PRUNE_EVERY = 4096

    def __init__(self, half_life_s: float = 30.0, clock=time.monotonic):
        self.half_life_s, self.clock = half_life_s, clock
        self.counts: dict[int, tuple[float, float]] = {}  # prefix digest -> (count, as of)
        self.total, self.total_at = 0.0, clock()
        self.adds = 0

    def _decayed(self, value: float, at: float, now: float) -> float:
        return decayed(value, at, now, self.half_life_s)

    def add(self, prefix: int | None) -> None:
        """One request routed; ``prefix``: the digest that ends the shared prefix it matched."""
        now = self.clock()
        self.total = self._decayed(self.total, self.total_at, now) + 1.0
        self.total_at = now
        if prefix is not None:
            value, at = self.counts.get(prefix, (0.0, now))
            self.counts[prefix] = (self._decayed(value, at, now) + 1.0, now)
        self.adds += 1
        if self.adds % self.PRUNE_EVERY == 0:  # forget prefixes no longer asked for
            self.counts = {
                d: (v, at) for d, (v, at) in self.counts.items() if self._decayed(v, at, now) > 0.01
            }

    def share(self, prefix: int) -> float:
        """The fraction of recent requests that matched ``prefix`` (0 for one never added)."""
        return self.asked(prefix)[1]

    def asked(self, prefix: int) -> tuple[float, float]:
        """The recent requests that matched ``prefix`` (decayed) and their fraction of all."""
        now = self.clock()
        value, at = self.counts.get(prefix, (0.0, now))
        value = self._decayed(value, at, now)
        total = self._decayed(self.total, self.total_at, now)
        return value, value / total if total > 0 else 0.0


VOLUME_HALF_LIFE_S = 300.0  # minutes of traffic: a rank's share of the work, not its queue now
REBASE_HALF_LIVES = 64.0  # scaled values are rebased past 2 ** this


class ServedVolume:
    """The prompt tokens each target was sent lately, decayed with a half-life of
    ``half_life_s`` (minutes, where the load's own counts look seconds back). Cached tokens count:
    a cached prompt still fills its rank's KV cache and is read at every decode step.

    Queues and requests in flight say where a request starts soonest; they forget a rank's share
    of the work as soon as its queue drains. On a fleet that is mostly idle between bursts (the
    Mooncake trace: TTFT p50 35 ms) most requests find every queue empty and land by chance, and
    each rank's share of the tokens drifts like a random walk with nothing pulling it back: in the
    routing lab one rank of four ended with 1.18x the mean (docs/benchmarks.md). ``excess`` is
    what the cost model pulls back with.

    Several router processes (apps/routing/feeds/shared_index.py) each publish their own volume per
    target with their load snapshots; ``set_peer`` keeps the latest of each process, decayed
    from when it arrived, and a target's volume is its own plus its peers'. Without it, each
    process would even out only its own share of the fleet's work."""

    def __init__(self, half_life_s: float = VOLUME_HALF_LIFE_S, clock=time.monotonic):
        self.half_life_s, self.clock = half_life_s, clock
        # Values are kept scaled by 2 ** ((as of - origin) / half_life): all decay alike, so a
        # value now is the scaled one over the scale now, and ``excess`` (a ratio) needs no
        # decay at all; a request costs additions, not a power per target.
        self.origin = clock()
        self.tokens: dict[str, float] = {}  # target key -> scaled tokens
        # other router process -> target key -> its scaled tokens there
        self.peers: dict[str, dict[str, float]] = {}

    def _scale(self, now: float) -> float:
        exponent = (now - self.origin) / self.half_life_s
        if exponent > REBASE_HALF_LIVES:  # keep the scaled values far from overflow
            factor = 0.5**exponent
            self.tokens = {k: v * factor for k, v in self.tokens.items()}
            self.peers = {
                o: {k: v * factor for k, v in peer.items()} for o, peer in self.peers.items()
            }
            self.origin, exponent = now, 0.0
        return 2.0**exponent

    def own(self, key: str, now: float | None = None) -> float:
        """The tokens this process itself sent ``key`` lately (decayed): what it publishes."""
        scale = self._scale(self.clock() if now is None else now)
        return self.tokens.get(key, 0.0) / scale

    def set_peer(self, origin: str, volumes: dict[str, float]) -> None:
        """Process ``origin``'s own volume per target, as it published it just now (replaces
        what it published before)."""
        scale = self._scale(self.clock())
        self.peers[origin] = {key: value * scale for key, value in volumes.items()}

    def drop_peer(self, origin: str) -> None:
        self.peers.pop(origin, None)

    def add(self, key: str, tokens: int) -> None:
        """``tokens`` prompt tokens were just routed to target ``key`` (by this process: the
        peers' shares stay theirs)."""
        scale = self._scale(self.clock())  # first: it may rebase the stored values
        self.tokens[key] = self.tokens.get(key, 0.0) + tokens * scale

    def excess(self, keys: list[str]) -> dict[str, float]:
        """Each target's volume relative to the mean of ``keys`` (0: at the mean, -1: nothing
        lately); all 0 while none of them was sent anything."""
        own, peers = self.tokens, self.peers.values()
        if peers:
            values = [own.get(key, 0.0) + sum(peer.get(key, 0.0) for peer in peers)
                      for key in keys]  # fmt: skip
        else:  # one router process
            get = own.get
            values = [get(key, 0.0) for key in keys]
        mean = sum(values) / len(values) if values else 0.0
        if mean <= 0:
            return dict.fromkeys(keys, 0.0)
        return {key: value / mean - 1 for key, value in zip(keys, values, strict=True)}

    def forget(self, key: str) -> None:
        self.tokens.pop(key, None)
        for peer in self.peers.values():
            peer.pop(key, None)
