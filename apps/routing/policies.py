"""Routing policies: given the available targets and what the prefix index says they hold,
pick one. ``choose`` has no side effects; the router commits the choice (load, index)."""
from __future__ import annotations

import abc
import itertools
import random

from apps.replicas.fleet import Target
from apps.routing.digests import RequestShape


class Policy(abc.ABC):
    name: str

    def __init__(self, rng: random.Random | None = None):
        self.rng = rng or random.Random()

    @abc.abstractmethod
    def choose(self, targets: list[Target], shape: RequestShape, matched: dict[str, int]) -> Target:
        """Pick one of ``targets`` (non-empty). ``matched`` maps target keys to the leading
        blocks of the request the index believes they hold."""


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self, rng=None):
        super().__init__(rng)
        self.cursor = itertools.count()

    def choose(self, targets, shape, matched):
        ordered = sorted(targets, key=lambda t: t.key)
        return ordered[next(self.cursor) % len(ordered)]


class Random(Policy):
    name = "random"

    def choose(self, targets, shape, matched):
        return self.rng.choice(targets)


class PowerOfTwo(Policy):
    name = "power_of_two"

    def choose(self, targets, shape, matched):
        if len(targets) == 1:
            return targets[0]
        a, b = self.rng.sample(targets, 2)
        return min((a, b), key=lambda t: (t.load.requests, t.load.prompt_tokens))


class CacheAware(Policy):
    """Choose the target where this request's first token comes soonest.

    cost(t) = uncached prefill tokens of this request on t      (what t must compute for it)
            + prefill tokens already queued on t                (what it computes first)
            + decode_weight x requests decoding on t            (each adds a token to every step)

    The lowest cost wins; ties go to the target with the fewest requests, then the one that has
    been sent the fewest, then chance, so cold prefixes spread evenly instead of piling onto
    target 0. A hot prefix stays home until home's queue costs more than recomputing the prefix
    elsewhere; then it is replicated to a second target, and later requests weigh both. No global
    switch ever turns affinity off for the whole fleet.
    """

    name = "cache_aware"

    def __init__(self, rng=None, decode_weight: float = 16.0):
        super().__init__(rng)
        self.decode_weight = decode_weight

    def matched_tokens(self, target: Target, shape: RequestShape, matched: dict[str, int]) -> int:
        # the engine always recomputes the prompt's last token, so its last full block never hits
        usable = (shape.prompt_tokens - 1) // shape.block_tokens
        return min(matched.get(target.key, 0), usable) * shape.block_tokens

    def cost(self, target: Target, shape: RequestShape, matched: dict[str, int]) -> float:
        load = target.load
        decoding = load.requests
        uncached = shape.prompt_tokens - self.matched_tokens(target, shape, matched)
        return uncached + load.pending_prefill_tokens + self.decode_weight * decoding

    def choose(self, targets, shape, matched):
        return min(targets, key=lambda t: (self.cost(t, shape, matched), t.load.requests, t.load.dispatched,
                                           self.rng.random()))


POLICIES = {cls.name: cls for cls in (RoundRobin, Random, PowerOfTwo, CacheAware)}


def make_policy(name: str, **kwargs) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose one of {sorted(POLICIES)}")
    return POLICIES[name](**kwargs) if name == "cache_aware" else POLICIES[name]()
