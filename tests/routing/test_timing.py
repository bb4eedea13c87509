"""The router's time model (apps/routing/decision/timing.py): the fit recovers a move cost and a
per-token rate it is shown, calls a move free where it is, turns it into the policy's tokens;
the router marks which dispatches woke a rank and feeds each first token back; the policy pays
for a move only where it costs; an idle fleet keeps its ties on the rank used last."""

import random

import pytest

from apps.routing.decision.policies import CacheAware
from apps.routing.decision.request_shape import RequestShape
from apps.routing.decision.router import Router, RouterConfig
from apps.routing.decision.timing import (
    MIN_SAMPLES,
    MOVE_CAP_TOKENS,
    Timing,
    WorkerTiming,
)
from tests.routing.helpers import targets, worker_view


def feed(timing: WorkerTiming, n: int, move_s: float, per_token_s: float, noise_s: float, seed=0):
    """``n`` samples of TTFT = 5 ms + per_token x tokens + move_s when moved, with noise."""
    rng = random.Random(seed)
    for i in range(n):
        tokens, moved = rng.choice((64, 256, 640, 1200)), i % 3 == 0
        seconds = 0.005 + per_token_s * tokens + (move_s if moved else 0.0)
        timing.observe(tokens, moved, max(0.0, seconds + rng.gauss(0, noise_s)))


def test_the_fit_recovers_the_move_cost_and_the_rate_per_token():
    timing = WorkerTiming()
    feed(timing, 120, move_s=0.040, per_token_s=20e-6, noise_s=0.003)
    fit = timing.fit
    assert fit.move_s == pytest.approx(0.040, abs=0.003)
    assert fit.per_token_s == pytest.approx(20e-6, rel=0.15)
    assert fit.base_s == pytest.approx(0.005, abs=0.003)
    assert fit.move_significant
    # 40 ms at 20 us a token: a move costs what 2,000 tokens of prefill cost
    assert fit.move_tokens == pytest.approx(2000, rel=0.2)
    shown = fit.as_dict()
    assert shown["move_ms"] == pytest.approx(40, abs=3) and shown["moved_samples"] > 30


def test_a_move_that_costs_nothing_counts_nothing():
    timing = WorkerTiming()
    feed(timing, 200, move_s=0.0, per_token_s=20e-6, noise_s=0.003)
    assert abs(timing.fit.move_s) < 0.003
    assert not timing.fit.move_significant and timing.fit.move_tokens == 0.0


def test_too_few_samples_of_one_kind_count_nothing():
    """A huge difference on a handful of moves is not evidence yet: the policy waits for
    MIN_SAMPLES of each kind."""
    timing = WorkerTiming()
    for _ in range(40):
        timing.observe(256, False, 0.010)
    for _ in range(int(MIN_SAMPLES) - 1):
        timing.observe(256, True, 0.500)
    assert timing.fit.move_s == pytest.approx(0.490, abs=0.01)
    assert not timing.fit.move_significant
    for _ in range(2):  # the counts fade a little: one more than the minimum
        timing.observe(256, True, 0.500)
    assert timing.fit.move_significant


def test_the_move_in_tokens_is_capped_and_survives_a_flat_rate():
    """Prefill that costs (nearly) nothing per token would make a move worth any number of
    tokens: the rate counts at least a microsecond a token, and the move at most the cap."""
    timing = WorkerTiming()
    feed(timing, 120, move_s=0.5, per_token_s=0.0, noise_s=0.001)
    assert timing.fit.move_significant
    assert timing.fit.move_tokens == MOVE_CAP_TOKENS


def test_old_samples_fade():
    """The engine changed (another host, another load): a window of new samples outweighs the
    old ones."""
    timing = WorkerTiming(window=64)
    feed(timing, 200, move_s=0.2, per_token_s=20e-6, noise_s=0.002)
    assert timing.fit.move_significant
    feed(timing, 400, move_s=0.0, per_token_s=20e-6, noise_s=0.002, seed=1)
    assert abs(timing.fit.move_s) < 0.01 and not timing.fit.move_significant


def test_a_dispatch_is_a_move_when_it_wakes_an_idle_rank_another_was_used_after():
    timing = Timing()
    a, b = targets(2)
    first = timing.dispatched(a, 100)
    assert not first.moved  # nothing was used before
    a.load.begin(100, 100)
    assert timing.dispatched(b, 100).moved  # idle, and a was used more recently
    b.load.begin(100, 100)
    assert not timing.dispatched(a, 100).moved  # a has a request in flight: awake
    assert timing.warm_keys([a, b]) == {a.key}
    one = targets(1, worker_id=2)[0]  # a worker of one rank never moves
    assert not timing.dispatched(one, 10).moved and not timing.dispatched(one, 10).moved


def test_the_router_learns_from_first_tokens_and_shows_the_fit():
    router = Router(RouterConfig(policy="cache_aware"), rng=random.Random(0))
    router.fleet.put(worker_view(1, dp_size=2, block_size=None, tokenizer_path=None))
    # the first request of a fresh fleet goes to a rank; the next, with the first in flight,
    # also sees that rank as the one used last
    body = {"prompt": "hello " * 50}
    first = router.route(body, chat=False, model=None)
    first.first_token()
    first.finish(ok=True)
    timing = router.timing.workers[1]
    assert timing.n == pytest.approx(1.0) and timing.last_key == first.target.key
    state = router.worker_state(1)
    assert state["timing"]["stayed_samples"] == pytest.approx(1.0)


def test_the_policy_pays_for_a_move_only_where_it_is_significant():
    policy = CacheAware(rng=random.Random(0), slack=0.0, new_session_slack=0.0)
    a, b = targets(2)
    s = RequestShape(list(range(16)), 256, 16)
    s.move_tokens = {b.key: 300.0}
    costs = policy.costs([a, b], s, {})
    assert costs[1] - costs[0] == pytest.approx(300.0)
    # a prefix on b worth more than the move: b still wins; worth less: a recomputes it
    assert policy.choose([a, b], s, {b.key: 15}) is b
    s.move_tokens = {b.key: 1000.0}
    assert policy.choose([a, b], s, {b.key: 15}) is a


def test_an_idle_fleet_keeps_its_ties_on_the_rank_used_last():
    """No request in flight anywhere: of targets that tie, the one its worker used last wins
    (no engine is slower on the rank it just used, and waking the other may cost); once one
    request is in flight, the tie goes back to the least loaded."""
    policy = CacheAware(rng=random.Random(0))
    a, b = targets(2)
    for t in (a, b):
        t.load.end(t.load.begin(100, 0))
    b.load.end(b.load.begin(100, 0))  # b served more lately: the old tie-break picks a
    s = RequestShape(list(range(16)), 256, 16)
    assert policy.choose([a, b], s, {}) is a
    s.warm = {b.key}
    assert policy.choose([a, b], s, {}) is b
    b.load.begin(100, 0)  # now b is busy: least loaded first
    assert policy.choose([a, b], s, {}) is a


def test_the_rank_used_last_gives_up_its_ties_when_it_is_full():
    """Concentrating an idle fleet's new prefixes stops where the rank used last would evict
    what it holds: the next new prefix goes to a rank with room."""
    router = Router(RouterConfig(policy="cache_aware"), rng=random.Random(0))
    router.fleet.put(worker_view(1, dp_size=2, block_size=None, tokenizer_path=None))
    for t in router.fleet.all_targets():
        router.index.set_capacity(t.key, 40)
    ranks = []
    for i in range(6):
        d = router.route({"prompt": f"{i} prefix {i} " * 120}, chat=False, model=None)
        d.first_token()
        d.finish(ok=True)
        ranks.append(d.target.rank)
    assert ranks[0] == ranks[1], ranks  # the first fits beside the second
    assert len(set(ranks)) == 2, ranks  # and not all six
