"""The router's time model (apps/routing/decision/timing.py): the fit recovers a move cost and a
per-token rate it is shown, calls a move free where it is (heavy tails included), turns it into
the policy's tokens; the router marks which dispatches woke a rank, feeds each first token back
and shows the fit on the workers API."""

import random

import pytest

from apps.routing.decision.router import Router, RouterConfig
from apps.routing.decision.timing import (
    MIN_SAMPLES,
    MOVE_CAP_TOKENS,
    Timing,
    WorkerTiming,
)
from apps.routing.metrics import render_metrics
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


def test_a_heavy_tail_neither_hides_a_steady_move_cost_nor_fakes_one():
    """Second-long stalls now and then, on both kinds: a steady 25 ms on every move is still
    significant (the log fit), and stalls alone are not."""
    rng = random.Random(3)

    def run(move_s):
        timing = WorkerTiming()
        for i in range(80):
            moved = i % 2 == 0
            stall = 1.0 if rng.random() < 0.05 else 0.0
            timing.observe(
                256, moved, 0.02 + (move_s if moved else 0.0) + stall + rng.gauss(0, 2e-3)
            )
        return timing.fit

    assert run(0.025).move_significant
    assert not run(0.0).move_significant


def test_the_fit_is_on_metrics_per_worker():
    from apps.routing.metrics import render_metrics

    router = Router(RouterConfig(policy="cache_aware"), rng=random.Random(0))
    router.fleet.put(worker_view(1, dp_size=2, block_size=None, tokenizer_path=None))
    assert b"ttft_move_seconds{" not in render_metrics(router)  # no first token yet: no series
    feed(router.timing.of(1), 60, move_s=0.05, per_token_s=20e-6, noise_s=0.003)
    text = render_metrics(router).decode()
    move = next(x for x in text.splitlines() if x.startswith("dpmesh_router_ttft_move_seconds{"))
    assert 'worker="http://w1"' in move and float(move.rsplit(" ", 1)[1]) == pytest.approx(
        0.05, abs=0.005
    )
    assert 'dpmesh_router_ttft_move_significant{worker="http://w1"} 1.0' in text


def trained(move_s: float = 0.0, per_running_s: float = 0.0, seed: int = 5) -> Router:
    """A router whose one worker (DP 2) has a fit learnt from ``TTFT = 20 ms + 20 us a token
    + move_s when woken + per_running_s a running request``."""
    router = Router(RouterConfig(policy="cache_aware"), rng=random.Random(0))
    router.fleet.put(worker_view(1, dp_size=2, block_size=None, tokenizer_path=None))
    rng, timing = random.Random(seed), router.timing.of(1)
    for i in range(120):
        tokens, moved, running = rng.choice((64, 256, 640)), i % 3 == 0, rng.choice((0, 0, 2, 6))
        seconds = 0.02 + 20e-6 * tokens + (move_s if moved else 0) + per_running_s * running
        timing.observe(tokens, moved, seconds + rng.gauss(0, 0.002), running)
    return router


def one_at_a_time(router: Router, prompts: list[str], rank: int | None = None) -> list[str]:
    keys = []
    for prompt in prompts:
        d = router.route({"prompt": prompt}, chat=False, model=None, rank=rank)
        d.first_token()
        d.finish(ok=True)
        keys.append(d.target.key)
    return keys


def test_an_idle_fleet_keeps_new_prefixes_on_the_rank_used_last():
    """No evidence needed: the rank just used is never slower for a prompt cached nowhere."""
    router = Router(RouterConfig(policy="cache_aware"), rng=random.Random(0))
    router.fleet.put(worker_view(1, dp_size=2, block_size=None, tokenizer_path=None))
    keys = one_at_a_time(router, [f"prefix {i} " * 40 for i in range(8)])
    assert len(set(keys)) == 1, keys
    assert router.stats.time_checked == 0


def test_an_idle_fleet_copies_a_prefix_to_the_warm_rank_where_waking_one_costs_time():
    """A repeat of a prefix the idle rank holds, while the other rank was used last: the policy
    sends it to its holder; where waking a rank measurably costs (the fit), the time check
    keeps it on the warm rank and recomputes the prefix there."""
    prompt = "a prefix held by one rank " * 12
    for move_s, copied in ((0.3, True), (0.0, False)):
        router = trained(move_s=move_s)
        assert router.timing.workers[1].fit.move_significant is copied
        home = one_at_a_time(router, [prompt + "first"])[0]
        other = 1 - int(home.rsplit("@", 1)[1])
        one_at_a_time(router, ["something else"], rank=other)  # the other rank is warm now
        again = one_at_a_time(router, [prompt + "again"])[0]
        assert (again != home) is copied, (home, again)
        assert router.stats.time_checked == int(copied)


def test_a_busy_holder_loses_requests_when_its_queue_costs_more_than_a_recompute():
    prompt = "shared system prompt " * 30
    for per_running_s, spread in ((0.05, True), (0.0, False)):
        router = trained(per_running_s=per_running_s)
        assert router.timing.workers[1].fit.running_significant is spread
        home = one_at_a_time(router, [prompt + "q0"])[0]
        held = [router.route({"prompt": prompt + f"q{i}"}, False, None) for i in range(1, 8)]
        keys = [d.target.key for d in held]
        if spread:  # a running request costs 50 ms there, the prompt ~3 ms on the idle rank
            assert keys[0] == home and len(set(keys)) == 2, keys
            assert router.stats.time_checked > 0
        else:  # no measured cost of a queue: CacheAware keeps the prefix's requests on its holder
            assert set(keys) == {home} and router.stats.time_checked == 0
        text = render_metrics(router).decode()
        assert (
            f"dpmesh_router_time_check_overrides_total {float(router.stats.time_checked)}" in text
        )
