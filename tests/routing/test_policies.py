"""Routing policies on hand-built targets (fake clock, explicit parameters): CacheAware's cost
model -- prefix affinity, the engine's last-token rule, hot-prefix replication at the exact
break-even point, stickiness of a session's private history, the recent-volume balance term, the
slack band, even spread of cold requests -- and the simple baselines."""

import collections
import random

import pytest

from apps.routing.decision.load import SESSION_HALF_LIFE_S
from apps.routing.decision.policies import (
    CacheAware,
    DecodeLeg,
    PowerOfTwo,
    Random,
    RoundRobin,
    make_policy,
)
from apps.routing.decision.request_shape import RequestShape
from tests.routing.helpers import Clock, targets, worker_view
from tests.routing.test_index import native_or_fail

B = 16


def shape(prompt_tokens: int, blocks: int | None = None) -> RequestShape:
    blocks = prompt_tokens // B if blocks is None else blocks
    return RequestShape(list(range(100, 100 + blocks)), prompt_tokens, B)


# every CacheAware test runs on the compiled costs (csrc/cache_aware.c) and on the pure ones
NATIVE = {"on": True}


@pytest.fixture(autouse=True, params=["native", "pure"])
def costs_in(request):
    if request.param == "native":
        native_or_fail()
    NATIVE["on"] = request.param == "native"
    yield request.param
    NATIVE["on"] = True


def cache_aware(seed=0, **params) -> CacheAware:
    values = {
        "decode_weight": 16.0,
        "stickiness": 1.0,
        "balance_weight": 256.0,
        "slack": 0.0,
        "new_session_slack": 0.0,
        "rework_floor": 0.0,  # the rework term is off unless a test is about it
        "rework_cap": 0.0,
        **params,
    }
    return CacheAware(rng=random.Random(seed), native=NATIVE["on"], **values)


def same_recent_volume(ts, tokens=200):
    """One finished request of ``tokens`` on each target at the same instant: the balance term
    (recent volume relative to the mean) is then exactly zero everywhere."""
    for t in ts:
        t.load.end(t.load.begin(tokens, 0))


def test_prefers_the_target_holding_the_prefix():
    policy = cache_aware()
    ts = targets(4)
    s = shape(100)
    assert policy.choose(ts, s, {ts[2].key: 6}) is ts[2]
    assert policy.choose(ts, s, {ts[1].key: 2, ts[3].key: 5}) is ts[3]
    # 100 tokens, 5 blocks (80 tokens) cached on ts[3]: it computes 20; the others compute 100 and
    # strand 80 tokens of private history (stickiness 1), ts[1] less what it holds itself
    assert policy.costs(ts, s, {ts[1].key: 2, ts[3].key: 5}) == [180, 100 - 32 + 48, 180, 20]


def test_last_token_rule_caps_matched_blocks():
    policy = cache_aware()
    t = targets(1)[0]
    # 64 tokens: the engine recomputes token 63, so only blocks 0..2 can hit
    assert policy.matched_tokens(t, shape(64), {t.key: 4}) == 48
    assert policy.matched_tokens(t, shape(65), {t.key: 4}) == 64
    assert policy.matched_tokens(t, shape(65), {t.key: 2}) == 32
    assert policy.matched_tokens(t, shape(16), {t.key: 1}) == 0
    assert policy.matched_tokens(t, shape(17), {t.key: 1}) == 16
    assert policy.matched_tokens(t, shape(65), {}) == 0


def test_matched_tokens_are_never_negative():
    """An empty prompt (the engine rejects it, but the router routes it first) must not be
    predicted to have -16 cached tokens, nor cost 16 tokens of prefill."""
    policy = cache_aware()
    t = targets(1)[0]
    assert policy.matched_tokens(t, RequestShape([], 0, B), {}) == 0
    assert policy.costs([t], RequestShape([], 0, B), {}) == [0]


@pytest.mark.parametrize(
    ("queued_prefill", "expected"), [(0, "home"), (63, "home"), (64, "tie"), (65, "away")]
)
def test_hot_shared_prefix_moves_away_exactly_when_home_costs_more(queued_prefill, expected):
    """65 prompt tokens whose 4 blocks (64 tokens) are a shared prefix cached at home. Both targets
    run one request of the same size (so the balance term is zero). Elsewhere the request costs
    65 + 16; at home 1 + 16 + home's queued prefill. Break-even is a queue of 64 tokens."""
    policy = cache_aware()
    home, away = targets(2)
    home.load.begin(200, queued_prefill)
    away.load.begin(200, 0)
    s = shape(65, blocks=4)
    matched = {home.key: 4}
    assert policy.costs([home, away], s, matched, shared_blocks=4) == [
        1 + queued_prefill + 16,
        65 + 16,
    ]
    picks = {
        policy.choose(order, s, matched, shared_blocks=4).key
        for order in ([home, away], [away, home])
        for _ in range(20)
    }
    assert picks == {"tie": {home.key, away.key}, "home": {home.key}, "away": {away.key}}[expected]


@pytest.mark.parametrize(("queued_prefill", "expected"), [(127, "home"), (129, "away")])
def test_private_history_is_stickier_than_a_shared_prefix(queued_prefill, expected):
    """The same 64 cached tokens as one session's own history (no shared branch point): leaving
    strands them, so away also pays 64 stickiness tokens and break-even moves to a 128-token
    queue."""
    policy = cache_aware()
    home, away = targets(2)
    home.load.begin(200, queued_prefill)
    away.load.begin(200, 0)
    s = shape(65, blocks=4)
    assert policy.costs([home, away], s, {home.key: 4}, shared_blocks=0) == [
        17 + queued_prefill,
        81 + 64,
    ]
    assert policy.choose([home, away], s, {home.key: 4}) is (home if expected == "home" else away)
    assert policy.choose([away, home], s, {home.key: 4}) is (home if expected == "home" else away)


@pytest.mark.parametrize(
    ("queued_prefill", "expected"), [(191, "home"), (192, "tie"), (193, "away")]
)
def test_recomputing_a_shared_prefix_under_load_costs_the_fleet_too(queued_prefill, expected):
    """The hot shared prefix above on a busy fleet, with rework at its floor of 2: moving away
    recomputes 64 cached tokens and charges them twice more (the requests queued behind that
    work wait for it), so break-even moves from a 64-token queue at home to 64 x 3 = 192."""
    policy = cache_aware(rework_floor=2.0, rework_cap=8.0)
    home, away = targets(2)
    home.load.begin(200, queued_prefill)
    away.load.begin(200, 0)
    s = shape(6500, blocks=4)  # a long prompt: the queues are shallow next to it (depth < 2)
    matched = {home.key: 4}
    home_cost, away_cost = policy.costs([home, away], s, matched, shared_blocks=4)
    assert away_cost - home_cost == 64 + 2 * 64 + 0 - queued_prefill
    picks = {
        policy.choose(order, s, matched, shared_blocks=4).key
        for order in ([home, away], [away, home])
        for _ in range(20)
    }
    assert picks == {"tie": {home.key, away.key}, "home": {home.key}, "away": {away.key}}[expected]


def test_rework_follows_the_queue_depth_up_to_its_cap_and_is_off_when_idle():
    policy = cache_aware(rework_floor=2.0, rework_cap=8.0)
    home, away = targets(2)
    s, matched = shape(65, blocks=4), {home.key: 4}
    # idle fleet: no one waits for extra work, the cost is this request's alone
    assert policy.costs([home, away], s, matched, shared_blocks=4) == [1, 65]
    for queued, rework in ((0, 2.0), (65, 2.0), (260, 4.0), (10_000, 8.0)):
        h, a = targets(2)
        h.load.begin(100, queued)  # one request in flight each: the fleet is busy
        a.load.begin(100, queued)
        # depth = mean queued / 65 prompt tokens, between the floor and the cap
        home_cost, away_cost = policy.costs([h, a], s, {h.key: 4}, shared_blocks=4)
        assert away_cost - home_cost == pytest.approx(64 + rework * 64), queued


@pytest.mark.parametrize(
    ("prompt", "shared_blocks", "share", "rework", "pick"),
    [
        (65, 0, None, 64.0, "home"),  # private history, 64 of 65 cached: 8 x 65, capped at 64
        (65, 4, 0.1, 64.0, "home"),  # a shared prefix its one holder can absorb (0.1 x 2 < 1)
        (128, 0, None, 16.0, "away"),  # half cached: leaving doubles its work, 8 x 2
        (65, 4, None, 8.0, "away"),  # a hot shared prefix: a copy buys balance, rework as before
    ],
)
def test_a_copy_that_buys_no_balance_is_charged_by_the_work_it_multiplies(
    prompt, shared_blocks, share, rework, pick
):
    """A busy fleet, 64 tokens cached at home behind a 2,000-token queue, the other target idle.
    Where a copy buys no balance (private history, or a shared prefix that is not hot) leaving
    only saves this request its wait, and the recomputed tokens are charged by how many times its
    work at home leaving makes of it (prompt / uncached at home) up to ``rework_max``: a prompt
    almost wholly cached stays with its cache where the flat rework of 8 sent it to a copy."""
    policy = cache_aware(rework_floor=8.0, rework_cap=8.0, rework_max=64.0)
    home, away = targets(2)
    queued = 2000
    home.load.begin(200, queued)
    away.load.begin(200, 0)
    s = shape(prompt, blocks=4)
    s.prefix_share = share
    matched = {home.key: 4}
    home_cost, away_cost = policy.costs([home, away], s, matched, shared_blocks=shared_blocks)
    stranded = 0 if shared_blocks else 64  # stickiness 1 x private tokens away lacks
    assert away_cost - home_cost == pytest.approx(64 + stranded + rework * 64 - queued)
    for order in ([home, away], [away, home]):
        chosen = policy.choose(order, s, matched, shared_blocks=shared_blocks)
        assert chosen is (home if pick == "home" else away)


@pytest.mark.parametrize(("share", "hot"), [(None, True), (0.6, True), (0.5, False), (0.1, False)])
def test_only_a_hot_shared_prefix_is_pulled_toward_an_idle_target(share, hot):
    """All in flight on the prefix's home, the other target idle: the balance term (here 256 x
    excess 1/2 each way) pulls the request away only when its prefix carries more than its one
    holder's fair share (1/2 of the traffic on two targets); a prefix its home can absorb stays
    with its queue costs alone. An unknown share counts as hot."""
    policy = cache_aware()
    home, away = targets(2)
    for _ in range(2):
        home.load.begin(200, 0)
    s = shape(65, blocks=4)
    s.prefix_share = share
    home_cost, away_cost = policy.costs([home, away], s, {home.key: 4}, shared_blocks=4)
    swing = 2 * 256 * 0.5 if hot else 0
    assert home_cost - away_cost == pytest.approx((1 + 32) - 65 + swing)


def test_for_a_prefix_that_is_not_hot_the_balance_term_only_argues_against_a_copy():
    """Three targets: the home below the mean load, a more loaded and an idle target without the
    prefix. For a prefix that is not hot the home keeps its pull (negative excess) and the loaded
    one its push; only the idle one loses its pull toward a copy there."""
    policy = cache_aware(balance_weight=300.0)
    home, loaded, idle = targets(3)
    home.load.begin(200, 0)
    for _ in range(3):
        loaded.load.begin(200, 0)
    s = shape(65, blocks=4)
    matched = {home.key: 4}
    s.prefix_share = 0.1  # 0.1 x 3 targets < 1 holder
    cold = policy.costs([home, loaded, idle], s, matched, shared_blocks=4)
    s.prefix_share = 0.9
    hot = policy.costs([home, loaded, idle], s, matched, shared_blocks=4)
    # in flight 1 / 3 / 0, mean 4/3, no sessions: excess -1/8, +5/8, -1/2; pressure 1
    assert cold[0] == hot[0] == pytest.approx(1 + 16 + 300 * -1 / 8)
    assert cold[1] == hot[1] == pytest.approx(65 + 48 + 300 * 5 / 8)
    assert (cold[2], hot[2]) == pytest.approx((65, 65 - 300 / 2))


def test_a_replicated_prefix_is_weighed_on_both_copies():
    policy = cache_aware()
    home, copy, cold = targets(3)
    for t, prefill in ((home, 100), (copy, 0), (cold, 0)):
        t.load.begin(200, prefill)
    s = shape(65, blocks=4)
    assert policy.choose([home, copy, cold], s, {home.key: 4, copy.key: 4}, shared_blocks=4) is copy


def test_balance_term_sends_new_sessions_where_fewer_requests_and_sessions_are():
    clock = Clock()
    policy = cache_aware(balance_weight=100.0)
    busy, quiet = targets(2, clock=clock)
    # two in flight here, one of them a session's turn
    busy.load.begin(100, 0, continues_session=True)
    busy.load.begin(100, 0)
    s = shape(40)
    # in flight 2 vs 0 (mean 1: +1 / -1), active sessions 1 vs 0 (+1 / -1): excess +1 / -1,
    # pressure 1
    assert policy.costs([busy, quiet], s, {}) == [40 + 32 + 100, 40 - 100]
    assert policy.choose([busy, quiet], s, {}) is quiet
    clock.now += SESSION_HALF_LIFE_S  # sessions fade together: the relative excess stays
    assert busy.load.active_sessions() == pytest.approx(0.5)
    assert policy.costs([busy, quiet], s, {}) == pytest.approx([172, -60])


def test_one_shot_requests_leave_no_session_trace():
    clock = Clock()
    load = targets(1, clock=clock)[0].load
    for _ in range(50):
        load.end(load.begin(640, 640))
    assert load.active_sessions() == 0 and load.idle


def test_balance_term_is_off_when_the_fleet_is_idle_and_for_private_history():
    clock = Clock()
    policy = cache_aware(balance_weight=100.0)
    busy, quiet = targets(2, clock=clock)
    busy.load.end(busy.load.begin(300, 0))
    quiet.load.end(quiet.load.begin(100, 0))
    # nothing in flight: affinity alone
    assert policy.costs([busy, quiet], shape(40), {}) == [40, 40]
    busy.load.begin(10, 0)
    quiet.load.begin(10, 0)
    # a session whose history (4 private blocks) sits on busy: no balance term, stickiness instead
    assert policy.costs([busy, quiet], shape(80), {busy.key: 4}) == [16 + 16, 80 + 16 + 64]


def test_balance_term_never_outweighs_a_large_cached_prefix():
    clock = Clock()
    policy = cache_aware()
    home, away = targets(2, clock=clock)
    # in flight 1 vs 0 (+1 / -1), no sessions: excess +0.5 / -0.5; pressure 1/2
    home.load.begin(5000, 0)
    s = shape(1000, blocks=62)
    costs = policy.costs([home, away], s, {home.key: 62}, shared_blocks=62)
    assert costs == [8 + 16 + 64, 1000 - 64]
    assert policy.choose([home, away], s, {home.key: 62}, shared_blocks=62) is home


def test_slack_makes_near_costs_a_tie_broken_by_recent_volume():
    clock = Clock()
    a, b = targets(2, clock=clock)
    a.load.end(a.load.begin(10, 0))  # a has recent volume, b none
    s = shape(40, blocks=2)
    matched = {a.key: 1}
    # a holds 16 of the 32 hittable tokens: a computes 24; b computes 40 and strands 16
    assert cache_aware(balance_weight=0.0).costs([a, b], s, matched) == [24, 56]
    assert cache_aware(slack=31.5, balance_weight=0.0).choose([a, b], s, matched) is a
    # 56 <= 24 + 32: inside the band (inclusive), the target with less recent volume wins
    assert cache_aware(slack=32.0, balance_weight=0.0).choose([a, b], s, matched) is b
    # equal costs, equal volume: fewest running requests
    c, d = targets(2, worker_id=2, clock=clock)
    c.load.begin(10, 0)
    c.load.begin(10, 0)
    d.load.begin(20, 0)
    assert c.load.recent_tokens() == d.load.recent_tokens() == 20
    assert cache_aware(decode_weight=0.0, balance_weight=0.0).choose([c, d], shape(40), {}) is d


def test_a_new_session_goes_to_the_least_recently_loaded_of_the_nearly_cheapest():
    """A chat request with no private history anywhere: where it lands is where its later turns
    go, so a wider band (new_session_slack) of near-cheapest targets goes to the least loaded
    lately. A completion starts no session: the narrow slack, and its shared prefix keeps it."""
    clock = Clock()
    home, idle = targets(2, clock=clock)
    home.load.end(home.load.begin(300, 0))
    s = shape(200, blocks=12)
    matched = {home.key: 12}  # all of it a shared prefix: 192 tokens cheaper at home
    policy = cache_aware(balance_weight=0.0, new_session_slack=192.0)
    assert policy.costs([home, idle], s, matched, shared_blocks=12) == [8, 200]
    assert policy.choose([home, idle], s, matched, shared_blocks=12) is home  # a completion
    s.chat = True
    assert policy.choose([home, idle], s, matched, shared_blocks=12) is idle
    assert (
        cache_aware(balance_weight=0.0, new_session_slack=191.0).choose(
            [home, idle], s, matched, shared_blocks=12
        )
        is home
    )
    # the same blocks as private history: the narrow slack applies, and stranding them costs more
    assert policy.costs([home, idle], s, matched) == [8, 392]
    assert (
        cache_aware(balance_weight=0.0, slack=32.0, new_session_slack=1000.0).choose(
            [home, idle], s, matched
        )
        is home
    )


def test_cold_requests_spread_evenly_under_load():
    policy = cache_aware(slack=32.0, new_session_slack=256.0)
    ts = targets(4)
    for i in range(40):
        s = RequestShape([i], 20, B)  # distinct, uncached
        chosen = policy.choose(ts, s, {})
        chosen.load.begin(s.prompt_tokens, s.prompt_tokens)
    assert [t.load.requests for t in ts] == [10, 10, 10, 10]


@pytest.mark.parametrize("seed", range(4))
def test_cold_requests_spread_evenly_when_each_finishes_at_once(seed):
    """No load at all between requests: the balance term and the tie-breaks still spread them."""
    clock = Clock()
    policy = cache_aware(seed=seed, slack=32.0, new_session_slack=256.0)
    ts = targets(3, clock=clock)
    counts = collections.Counter()
    for i in range(31):
        clock.now += 0.5
        s = RequestShape([i], 20, B)
        chosen = policy.choose(ts, s, {})
        chosen.load.end(chosen.load.begin(s.prompt_tokens, s.prompt_tokens))
        counts[chosen.key] += 1
    assert max(counts.values()) <= 31 // 3 + 1
    assert len(counts) == 3
    assert all(t.load.idle for t in ts)


def test_cache_aware_choose_has_no_side_effects():
    policy = cache_aware()
    ts = targets(2)
    policy.choose(ts, shape(40), {})
    assert all(t.load.idle and t.load.dispatched == 0 and t.load.recent_tokens() == 0 for t in ts)


def test_round_robin_cycles_in_key_order():
    ts = targets(3)
    rr = RoundRobin()
    picks = [rr.choose(list(reversed(ts)), shape(20), {ts[0].key: 1}) for _ in range(7)]
    assert picks == [ts[0], ts[1], ts[2], ts[0], ts[1], ts[2], ts[0]]


def test_power_of_two_picks_the_lighter_of_two():
    light, heavy = targets(2)
    heavy.load.begin(10, 10)
    p2 = PowerOfTwo(rng=random.Random(0))
    assert all(p2.choose([light, heavy], shape(20), {}) is light for _ in range(20))
    assert all(p2.choose([heavy, light], shape(20), {}) is light for _ in range(20))
    assert p2.choose([heavy], shape(20), {}) is heavy


def test_power_of_two_never_picks_the_heaviest_of_three():
    ts = targets(3)
    ts[0].load.begin(10, 10)
    ts[0].load.begin(10, 10)
    ts[1].load.begin(10, 10)
    p2 = PowerOfTwo(rng=random.Random(1))
    picks = collections.Counter(p2.choose(ts, shape(20), {}).key for _ in range(300))
    assert ts[0].key not in picks
    assert set(picks) == {ts[1].key, ts[2].key}  # ts[1] wins the draws that miss ts[2]
    # ties on requests go to fewer prompt tokens
    a, b = targets(2, worker_id=2)
    a.load.begin(100, 0)
    b.load.begin(10, 0)
    assert all(p2.choose([a, b], shape(20), {}) is b for _ in range(20))


def test_random_covers_all_targets():
    ts = targets(4)
    rnd = Random(rng=random.Random(7))
    picks = collections.Counter(rnd.choose(ts, shape(20), {}).key for _ in range(400))
    assert set(picks) == {t.key for t in ts}
    assert min(picks.values()) > 50


def test_make_policy():
    assert isinstance(make_policy("cache_aware", decode_weight=4.0), CacheAware)
    assert make_policy("cache_aware", decode_weight=4.0).decode_weight == 4.0
    assert {type(make_policy(n)) for n in ("round_robin", "random", "power_of_two")} == {
        RoundRobin,
        Random,
        PowerOfTwo,
    }
    with pytest.raises(ValueError, match="unknown policy 'sticky'"):
        make_policy("sticky")


@pytest.mark.parametrize(
    "policy", [cache_aware(balance_weight=512.0, new_session_slack=256.0), PowerOfTwo()]
)
def test_other_router_processes_load_counts_like_this_ones(policy):
    """A rank another router process has filled is as busy as if this process had filled it."""
    policy.rng = random.Random(3)
    ts = targets(2)
    ts[0].load.set_peer("other-process", requests=2, prompt_tokens=400, prefill_tokens=0)
    assert collections.Counter(policy.choose(ts, shape(40), {}).key for _ in range(20)) == {
        ts[1].key: 20
    }


def test_a_target_with_its_seats_taken_loses_to_one_with_a_free_seat():
    """Both engines run 2 sequences at most: a rank running 2 makes a new request wait for one to
    end (seat_weight per request beyond the seats), so the rank running 1 wins although it
    holds none of the prompt; with the seats unknown, the cached prefix decides."""
    policy = cache_aware(seat_weight=2048.0)
    full, free = targets(2)
    for _ in range(2):
        full.load.begin(100, 0)
    free.load.begin(100, 0)
    s, matched = shape(65, blocks=4), {full.key: 4}
    assert policy.choose([full, free], s, matched) is full  # seats unknown
    full.worker.max_num_seqs = 2  # one view for both targets (one worker)
    home_cost, away_cost = policy.costs([full, free], s, matched)
    assert home_cost - away_cost == pytest.approx((1 + 32) - (65 + 16 + 64) + 2048)
    assert policy.choose([full, free], s, matched) is free


def test_a_prompt_cached_nowhere_evens_out_the_targets_recent_volume():
    """The targets' prompt tokens of the last minutes (``shape.volume_excess``, relative to their
    mean) weigh on a request no target holds any of, in proportion to its own prompt tokens: the
    target 30 % below the mean wins against an idle one although four requests decode there
    (their prefill done); the excess counts up to ``volume_cap`` only. A request with a match
    on one target is placed by its prefix and queues alone; a short one barely feels the term."""
    policy = cache_aware(volume_weight=10.0, volume_cap=0.5, balance_weight=0.0)
    light, idle, heavy = targets(3)
    for _ in range(4):  # decoding: no prefill queued
        light.load.first_token(light.load.begin(200, 100))
    s = shape(640)
    s.volume_excess = {light.key: -0.3, idle.key: 0.0, heavy.key: 0.9}
    assert policy.costs([light, idle, heavy], s, {}) == pytest.approx(
        [640 + 64 - 0.3 * 10 * 640, 640, 640 + 0.5 * 10 * 640]
    )
    assert policy.choose([light, idle, heavy], s, {}) is light
    short = shape(16)  # a short new prompt: the load decides, not the share
    short.volume_excess = dict(s.volume_excess)
    assert policy.choose([light, idle, heavy], short, {}) is idle
    # the same request with 4 blocks cached on the heavy target alone: no volume term anywhere
    costs = policy.costs([light, idle, heavy], s, {heavy.key: 4})
    assert costs == pytest.approx([640 + 64 + 64, 640 + 64, 640 - 64])
    s.volume_excess = None  # not known (a policy built by hand): no term either
    assert policy.costs([light, idle, heavy], s, {}) == pytest.approx([640 + 64, 640, 640])


def test_the_volume_pull_never_buys_a_queue():
    """A target below the mean whose prefill queue is longer than the shortest keeps the volume
    term's push but not its pull: the pull only chooses among targets that can start the prompt
    now (a new prompt sent to the light rank's queue made that rank's queue longer for the prefix
    requests behind it, which then left their cache for a copy)."""
    policy = cache_aware(volume_weight=10.0, volume_cap=0.5, balance_weight=0.0)
    light, idle, heavy = targets(3)
    light.load.begin(200, 1_000)  # 1,000 prefill tokens queued
    heavy.load.begin(200, 1_000)
    s = shape(640)
    s.volume_excess = {light.key: -0.3, idle.key: 0.0, heavy.key: 0.9}
    busy = 2 / 3  # two of three targets have a request in flight: the term weighs that much
    assert policy.costs([light, idle, heavy], s, {}) == pytest.approx(
        [640 + 1_016, 640, 640 + 1_016 + busy * 0.5 * 10 * 640]
    )
    assert policy.choose([light, idle, heavy], s, {}) is idle
    idle.load.begin(200, 1_000)  # the same queue everywhere: the pull counts again
    assert policy.choose([light, idle, heavy], s, {}) is light


def test_among_a_prefix_s_holders_the_volume_term_pulls_to_the_least_loaded():
    """A prompt whose best match several targets hold may go to any of them: among those the
    volume term is a pull toward the one with the least recent volume, never a push away from the
    cache (the most loaded holder counts 0, a target without the prefix 0 too; it pays for the
    history it lacks, stickiness 1), as the fleet is busy. One holder: no term."""
    policy = cache_aware(volume_weight=10.0, volume_cap=0.5, balance_weight=0.0)
    a, b, other = targets(3)
    s = shape(640)
    s.volume_excess = {a.key: 0.3, b.key: 0.1, other.key: -0.4}
    matched = {a.key: 4, b.key: 4}
    # an idle fleet has no queue to spread: no volume term
    assert policy.costs([a, b, other], s, matched) == pytest.approx([640 - 64, 640 - 64, 704])
    for t in (a, b, other):  # a request running on each (no prefill left): the fleet is busy
        t.load.begin(0, 0)
    assert policy.costs([a, b, other], s, matched) == pytest.approx(
        [640 - 64 + 16, 640 - 64 - 0.2 * 10 * 640 + 16, 640 + 64 + 16]
    )
    assert policy.choose([a, b, other], s, matched) is b
    # the same prefix on ``a`` alone: no volume term
    assert policy.costs([a, b, other], s, {a.key: 4}) == pytest.approx([576 + 16, 720, 720])


def test_a_prefix_whose_holders_carry_too_much_moves_to_a_target_well_below_them():
    """A shared prefix held only where the volume is far above the rest (by more than the
    prefix's own traffic would put on a target, its share x the targets, + ``move_margin``)
    moves: a target below that takes the request with no rework charged, pulled by the volume
    term. A prefix hot enough to overload where it would go stays, as do one whose recent
    traffic does not pay for the copy (``move_payback``) and a private history."""
    policy = cache_aware(volume_weight=8.0, volume_cap=0.25, balance_weight=0.0,
                         rework_floor=8.0, rework_cap=8.0)  # fmt: skip
    home, light, other = ts = targets(3)
    for t in ts:  # a request running on each: the fleet is busy
        t.load.begin(0, 0)
    s = shape(576)  # a 512-token prefix (32 blocks) and its own 64 tokens
    s.volume_excess = {home.key: 0.4, light.key: -0.3, other.key: -0.1}
    s.prefix_share, s.prefix_requests = 0.06, 20.0
    matched, prefix = {home.key: 32}, 32
    # 0.4 - 0.06 x 3 - 0.1 = 0.12: both others are below; the lighter is pulled harder
    assert policy.movable(ts, s, [512, 0, 0], 512, 512) == [False, True, True]
    assert policy.choose(ts, s, matched, prefix) is light
    s.prefix_share = 0.25  # 0.4 - 0.75 - 0.1: it would overload any target it went to
    assert policy.movable(ts, s, [512, 0, 0], 512, 512) is None
    assert policy.choose(ts, s, matched, prefix) is home
    s.prefix_share, s.prefix_requests = 0.06, 5.0  # 5 x 576 tokens < 8 x the 512 copied
    assert policy.choose(ts, s, matched, prefix) is home
    s.prefix_requests = 20.0
    assert policy.choose(ts, s, matched, 16) is home  # half of it is private history
    s.volume_excess = {home.key: 0.1, light.key: -0.05, other.key: -0.05}  # near the mean
    assert policy.choose(ts, s, matched, prefix) is home


# ----- the decode leg of a prefill/decode-disaggregated request -----------------------------------
def test_the_decode_leg_goes_where_the_load_is_least_whatever_it_holds():
    """Its prompt is computed: a decode rank holding all of it but running two more requests
    loses to an idle one that must pull it (a pull is a one-off; a seat is every step)."""
    policy = DecodeLeg(rng=random.Random(0))
    ts = targets(3)
    for _ in range(2):
        ts[0].load.begin(100, 0)
    ts[1].load.begin(100, 0)
    s = shape(4096)
    assert policy.choose(ts, s, {ts[0].key: 256}) is ts[2]


def test_among_near_ties_the_decode_leg_pulls_least():
    policy = DecodeLeg(rng=random.Random(0))
    ts = targets(4)
    for t in ts:
        t.load.begin(100, 0)
    s = shape(1024)
    assert policy.choose(ts, s, {ts[1].key: 20, ts[3].key: 40}) is ts[3]
    # a long context in flight weighs like a seat: 64 k tokens on ts[3] is two seats
    ts[3].load.begin(64 * 1024, 0)
    ts[3].load.end(ts[3].load.begin(1, 0))
    assert policy.choose(ts, s, {ts[1].key: 20, ts[3].key: 40}) is ts[1]


def test_a_pd_router_routes_the_decode_leg_by_load_and_the_prefill_leg_by_cache():
    from apps.routing.decision.router import Router

    router = Router()
    for worker_id, role in ((1, "prefill"), (2, "decode")):
        router.fleet.put(worker_view(worker_id, dp_size=2, role=role), {0: None, 1: None})
    body = {"prompt": list(range(1000, 1000 + 64 * B))}
    first = router.route(body, False, None, role="prefill")
    again = router.route(body, False, None, role="prefill")
    assert again.target.key == first.target.key  # the prefix's home, busy or not
    d1 = router.route(body, False, None, role="decode")
    d2 = router.route(body, False, None, role="decode")
    assert {d1.target.worker.role, d2.target.worker.role} == {"decode"}
    assert d1.target.key != d2.target.key  # the first holds it now, but a seat outweighs a pull
