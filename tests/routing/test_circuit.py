"""CircuitBreaker on a fake clock: closed -> open (N failures within the window) -> half-open
(after open_s) -> closed (success_threshold successes) or open again (one failure)."""

import pytest

from apps.routing.decision.circuit import CircuitBreaker
from tests.routing.helpers import Clock


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def breaker(clock):
    return CircuitBreaker(
        failure_threshold=3, window_s=10.0, open_s=30.0, success_threshold=2, clock=clock
    )


def fail(breaker, clock, *offsets):
    """Record failures at ``offsets`` seconds after the clock's current time."""
    start = clock.now
    for offset in offsets:
        clock.now = start + offset
        breaker.record_failure()


def test_defaults_are_sglangs():
    b = CircuitBreaker()
    assert (b.failure_threshold, b.window_s, b.open_s, b.success_threshold) == (10, 120.0, 60.0, 3)
    assert b.state == "closed" and b.allows()


def test_opens_after_n_failures_within_the_window(breaker, clock):
    fail(breaker, clock, 0, 5)
    assert breaker.state == "closed" and breaker.allows()
    fail(breaker, clock, 5)  # 10 s after the first: still inside the window
    assert breaker.state == "open" and not breaker.allows()


def test_failures_spread_beyond_the_window_do_not_open(breaker, clock):
    fail(breaker, clock, 0, 5, 10.5, 20, 30.6, 40)
    assert breaker.state == "closed" and breaker.allows()
    assert len(breaker.failures) == 2


def test_successes_while_closed_change_nothing(breaker, clock):
    fail(breaker, clock, 0, 1)
    breaker.record_success()
    fail(breaker, clock, 1)
    assert breaker.state == "open"


def test_stays_open_for_open_s_then_half_open_allows(breaker, clock):
    fail(breaker, clock, 0, 1, 2)
    opened = clock.now
    clock.now = opened + 29.9
    assert breaker.state == "open" and not breaker.allows()
    clock.now = opened + 30.0
    assert breaker.state == "half_open" and breaker.allows()


def test_a_failure_in_half_open_reopens_for_a_full_period(breaker, clock):
    fail(breaker, clock, 0, 1, 2)
    clock.now += 30
    assert breaker.state == "half_open"
    breaker.record_success()
    breaker.record_failure()  # one failure is enough, whatever the threshold
    assert breaker.state == "open"
    reopened = clock.now
    clock.now = reopened + 29
    assert not breaker.allows()
    clock.now = reopened + 30
    assert breaker.state == "half_open"
    assert breaker.successes == 0  # the earlier trial success does not count again


def test_success_threshold_successes_close(breaker, clock):
    fail(breaker, clock, 0, 1, 2)
    clock.now += 30
    breaker.record_success()
    assert breaker.state == "half_open"
    breaker.record_success()
    assert breaker.state == "closed" and breaker.allows()
    # closed again with a clean slate: it takes a full threshold to reopen
    fail(breaker, clock, 0, 1)
    assert breaker.state == "closed"
    fail(breaker, clock, 1)
    assert breaker.state == "open"


def test_half_open_lets_one_trial_through_at_a_time(breaker, clock):
    fail(breaker, clock, 0, 1, 2)
    clock.now += 30.0
    assert breaker.allows() and breaker.dispatched()  # the trial
    assert breaker.state == "half_open" and not breaker.allows()  # everyone else waits for it
    breaker.record_success()
    breaker.trial_done()
    assert breaker.allows() and breaker.dispatched()  # the next trial
    breaker.record_success()
    breaker.trial_done()
    # closed: no trials
    assert breaker.state == "closed" and breaker.allows() and not breaker.dispatched()
    assert breaker.allows()


def test_a_failed_trial_opens_again_and_a_trial_without_outcome_frees_the_slot(breaker, clock):
    fail(breaker, clock, 0, 1, 2)
    clock.now += 30.0
    assert breaker.dispatched()
    breaker.trial_done()  # e.g. the client went away: neither success nor failure
    assert breaker.state == "half_open" and breaker.allows()
    assert breaker.dispatched()
    breaker.record_failure()
    assert breaker.state == "open" and not breaker.allows() and not breaker.trial_in_flight
