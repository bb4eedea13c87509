"""CacheAware's costs in compiled code (apps/routing/decision/csrc/cache_aware.c) against the pure
ones (``CacheAware(native=False)``): the same numbers to the last bit and the same choices, on
random fleets that reach every term (tests/routing/test_policies.py runs its cases on both)."""

import random

import pytest

from apps.routing.decision.policies import CacheAware
from apps.routing.decision.request_shape import RequestShape
from tests.routing.helpers import Clock, targets, worker_view
from tests.routing.test_index import native_or_fail

B = 16


def random_fleet(rng: random.Random, clock: Clock):
    """Targets in a random state (own and peer load, sessions, seats, recent requests), a
    request's shape with random hotness and volume excesses, and random matches."""
    n = rng.randint(1, 9)
    ts = targets(n, clock=clock)
    for t in ts:
        t.worker = worker_view(1, dp_size=n, max_num_seqs=rng.choice([None, 1, 2, 4, 64]))
        for _ in range(rng.randint(0, 4)):
            ticket = t.load.begin(rng.randint(1, 900), rng.randint(0, 900), rng.random() < 0.4)
            if rng.random() < 0.3:
                t.load.first_token(ticket)
            if rng.random() < 0.3:
                t.load.end(ticket)
            clock.now += rng.choice([0.0, 0.5, 7.0])
        if rng.random() < 0.3:
            t.load.set_peer("peer", rng.randint(0, 3), rng.randint(0, 900), rng.randint(0, 500),
                            rng.random() * 3, rng.random() * 5)  # fmt: skip
    blocks = rng.randint(0, 40)
    s = RequestShape(list(range(blocks)), blocks * B + rng.randint(0, 40), B,
                     chat=rng.random() < 0.5)  # fmt: skip
    s.prefix_share = rng.choice([None, 0.0, rng.random(), rng.random() * 0.2])
    s.prefix_requests = rng.choice([0.0, rng.random() * 50, rng.random() * 500])
    if rng.random() < 0.7:
        s.volume_excess = {t.key: rng.uniform(-0.6, 0.6) for t in ts if rng.random() < 0.9}
    s.warm = frozenset(t.key for t in ts if rng.random() < 0.2)
    holds = [rng.choice([0, 0, blocks, rng.randint(0, blocks + 3)]) for _ in ts]
    matched = {t.key: h for t, h in zip(ts, holds, strict=True) if h or rng.random() < 0.5}
    shared = rng.choice([0, min(holds), max(holds), rng.randint(0, blocks)])
    if blocks and rng.random() < 0.25:  # a shared prefix whose holders carry too much: it moves
        holders = {t.key for t in ts if rng.random() < 0.5}
        matched = {key: blocks for key in holders}
        shared = blocks
        s.prefix_share, s.prefix_requests = rng.uniform(0.005, 0.05), rng.uniform(10, 500)
        s.volume_excess = {t.key: rng.uniform(0.2, 0.6) if t.key in holders else
                           rng.uniform(-0.6, 0.0) for t in ts}  # fmt: skip
    return ts, s, matched, shared


@pytest.mark.parametrize("seed", range(3))
def test_the_compiled_costs_are_the_pure_ones_to_the_last_bit(seed):
    """On random fleets and requests, every weight busy (the defaults, and random ones), the
    kernel's costs equal the pure code's exactly, and both choose the same target from the same
    random state."""
    native_or_fail()
    rng = random.Random(seed)
    clock = Clock()
    for case in range(400):
        weights = {} if case % 2 else {
            "decode_weight": rng.choice([0.0, 16.0, rng.random() * 40]),
            "stickiness": rng.random() * 4, "balance_weight": rng.choice([0.0, 512.0]),
            "slack": rng.choice([0.0, 32.0]), "new_session_slack": rng.choice([0.0, 256.0]),
            "rework_floor": rng.random() * 10, "rework_cap": rng.random() * 10,
            "rework_max": rng.choice([1.0, 64.0]), "seat_weight": rng.random() * 3000,
            "volume_weight": rng.random() * 10, "volume_cap": rng.random(),
            "move_margin": rng.random() * 0.3, "move_payback": rng.choice([0.0, 8.0]),
        }  # fmt: skip
        native = CacheAware(rng=random.Random(case), **weights)
        pure = CacheAware(rng=random.Random(case), native=False, **weights)
        assert native.kernel is not None and pure.kernel is None
        ts, s, matched, shared = random_fleet(rng, clock)
        assert native.costs(ts, s, matched, shared) == pure.costs(ts, s, matched, shared), case
        for _ in range(3):
            assert native.choose(ts, s, matched, shared) is pure.choose(ts, s, matched, shared)
