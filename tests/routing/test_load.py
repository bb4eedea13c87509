"""RankLoad: a request's load begins once and ends exactly once, whatever order the proxy's paths
call first_token and end in."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from apps.routing.decision.load import RECENT_HALF_LIFE_S, SESSION_HALF_LIFE_S, RankLoad
from tests.routing.helpers import Clock


def test_begin_first_token_end():
    load = RankLoad()
    a = load.begin(prompt_tokens=100, prefill_tokens=60)
    b = load.begin(prompt_tokens=30, prefill_tokens=30)
    assert (load.requests, load.prompt_tokens, load.pending_prefill_tokens, load.dispatched) == (
        2,
        130,
        90,
        2,
    )
    load.first_token(a)
    assert (load.requests, load.prompt_tokens, load.pending_prefill_tokens) == (2, 130, 30)
    load.first_token(a)  # once only
    assert load.pending_prefill_tokens == 30
    load.end(a)
    assert (load.requests, load.prompt_tokens, load.pending_prefill_tokens) == (1, 30, 30)
    load.end(b)  # ending before the first token also clears its prefill
    assert (load.requests, load.prompt_tokens, load.pending_prefill_tokens) == (0, 0, 0)
    assert load.idle and load.dispatched == 2


def test_end_is_idempotent_and_first_token_after_end_is_a_no_op():
    load = RankLoad()
    keep = load.begin(10, 10)
    t = load.begin(50, 40)
    load.end(t)
    load.end(t)
    load.first_token(t)
    assert (load.requests, load.prompt_tokens, load.pending_prefill_tokens) == (1, 10, 10)
    assert t.ended and t.prefilled
    load.end(keep)
    assert load.idle


OPS = st.lists(
    st.tuples(
        st.sampled_from(["begin", "first_token", "end"]),
        st.integers(0, 5),
        st.integers(0, 300),
        st.integers(0, 300),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(OPS)
def test_counters_return_to_zero_after_any_interleaving(ops):
    load = RankLoad()
    tickets = {}
    live = {}  # slot -> (prompt, prefill, prefilled) as a model of what the counters must hold
    begun = 0
    for op, slot, prompt, prefill in ops:
        if op == "begin":
            if slot in live:  # the old ticket leaks nowhere: end it first, as the proxy would
                load.end(tickets[slot])
                del live[slot]
            prefill = min(prefill, prompt)
            tickets[slot] = load.begin(prompt, prefill)
            live[slot] = (prompt, prefill, False)
            begun += 1
        elif slot in tickets and op == "first_token":
            load.first_token(tickets[slot])
            if slot in live:
                live[slot] = live[slot][:2] + (True,)
        elif slot in tickets:
            load.end(tickets[slot])
            live.pop(slot, None)
        assert load.requests == len(live)
        assert load.prompt_tokens == sum(p for p, _, _ in live.values())
        assert load.pending_prefill_tokens == sum(f for _, f, done in live.values() if not done)
    for ticket in tickets.values():
        load.end(ticket)
    assert load.idle
    assert (load.requests, load.prompt_tokens, load.pending_prefill_tokens) == (0, 0, 0)
    assert load.dispatched == begun


def test_recent_tokens_decay_with_the_half_life():
    clock = Clock()
    load = RankLoad(clock=clock)
    assert load.recent_tokens() == 0
    load.end(load.begin(800, 800))
    assert load.recent_tokens() == 800
    clock.now += RECENT_HALF_LIFE_S
    assert load.recent_tokens() == pytest.approx(400)
    load.begin(100, 0)
    assert load.recent_tokens() == pytest.approx(500)
    clock.now += 2 * RECENT_HALF_LIFE_S
    assert load.recent_tokens() == pytest.approx(125)
    assert load.requests == 1  # in-flight counters do not decay


def test_peers_add_to_the_totals_but_never_to_the_own_counters():
    clock = Clock()
    load = RankLoad(clock=clock)
    load.begin(100, 60, continues_session=True)
    load.set_peer("b", requests=3, prompt_tokens=900, prefill_tokens=500, sessions=2.0, recent=4.0)
    load.set_peer("c", requests=1, prompt_tokens=50, prefill_tokens=0)
    assert (load.inflight, load.inflight_tokens, load.queued_prefill_tokens) == (5, 1050, 560)
    # what is published
    assert (load.requests, load.prompt_tokens, load.pending_prefill_tokens) == (1, 100, 60)
    assert load.active_sessions() == pytest.approx(
        3.0
    ) and load.own_active_sessions() == pytest.approx(1.0)
    assert load.recent_requests() == pytest.approx(
        5.0
    ) and load.own_recent_requests() == pytest.approx(1.0)
    clock.now += RECENT_HALF_LIFE_S  # a peer's decaying figures decay here from when they arrived
    assert load.recent_requests() == pytest.approx(2.5)
    load.begin(10, 10, continues_session=True)  # a peer's sessions never become this process's own
    assert load.own_active_sessions() == pytest.approx(
        1.0 * 2 ** (-RECENT_HALF_LIFE_S / SESSION_HALF_LIFE_S) + 1
    )
    # a new snapshot replaces the old one
    load.set_peer("b", requests=0, prompt_tokens=0, prefill_tokens=0)
    load.drop_peer("c")
    load.drop_peer("never-seen")
    assert (load.inflight, load.inflight_tokens, load.queued_prefill_tokens) == (2, 110, 70)
