"""PrefixIndex: leading-block matches per rank, an LRU per rank bounded by its KV capacity, TTL
expiry, and removal; every number exact, on a fake clock. Each test runs on both implementations
(the native core and the pure one), and the two are compared on random operation sequences."""

import os
import random
import shutil
import sysconfig

import pytest

from apps.routing.decision import index as index_module
from apps.routing.decision.demand import PrefixDemand, ServedVolume
from apps.routing.decision.index import NativePrefixIndex, PurePrefixIndex
from tests.routing.helpers import Clock


def native_or_fail():
    """The native core must build wherever a C compiler is; a laptop without one skips its
    tests (the pure index, which it then routes with, is tested all the same); CI fails."""
    if index_module.core_module() is None:
        compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
        no_compiler = shutil.which(compiler) is None and shutil.which("cc") is None
        if no_compiler and not os.environ.get("CI"):
            pytest.skip(f"no C compiler: {index_module._core.get('error')}")
        pytest.fail(f"the native prefix index did not build: {index_module._core.get('error')}")
    return NativePrefixIndex


@pytest.fixture(params=["native", "pure"])
def PrefixIndex(request):  # noqa: N802 (the class under test)
    return native_or_fail() if request.param == "native" else PurePrefixIndex


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def index(clock, PrefixIndex):  # noqa: N803
    return PrefixIndex(ttl_s=100.0, default_capacity=1000, clock=clock)


def assert_consistent(index) -> None:
    """owners is exactly the inverse of ranks, with no empty holder sets."""
    inverse: dict[int, set[str]] = {}
    for key, lru in index.ranks.items():
        for digest in lru:
            inverse.setdefault(digest, set()).add(key)
    assert {digest: index.holders(digest) for digest in index.owners} == inverse
    assert all(index.owners.values())
    # the fan-out bookkeeping only speaks of digests some rank still holds
    assert set(index.first_child) <= set(index.owners)
    assert index.branching <= set(index.owners)


def test_match_counts_leading_blocks_per_key(index):
    index.insert("a", [1, 2, 3, 4])
    index.insert("b", [1, 2])
    index.insert("c", [9])
    assert index.match([1, 2, 3, 4, 5]) == {"a": 4, "b": 2}
    assert index.match([1, 2]) == {"a": 2, "b": 2}
    assert index.match([9, 1]) == {"c": 1}
    assert index.match([5, 1, 2]) == {}
    assert index.match([]) == {}


def test_match_stops_at_the_first_gap(index):
    index.insert("a", [10, 11, 13])  # holds blocks 0, 1 and 3 of the request, not 2
    assert index.match([10, 11, 12, 13]) == {"a": 2}
    index.insert("b", [11, 12])  # no block 0: nothing matches, whatever follows
    assert index.match([10, 11, 12]) == {"a": 2}


def test_match_is_restricted_to_the_given_keys(index):
    index.insert("a", [1, 2, 3])
    index.insert("b", [1, 2])
    assert index.match([1, 2, 3], keys=["b"]) == {"b": 2}
    assert index.match([1, 2, 3], keys=["b", "zzz"]) == {"b": 2}
    assert index.match([1, 2, 3], keys=[]) == {}
    assert index.match([1, 2, 3], keys=["a", "b"]) == {"a": 3, "b": 2}


def test_match_does_not_change_recency(index, clock):
    index.insert("a", [1, 2])
    clock.now += 99
    index.match([1, 2])
    clock.now += 2
    assert index.match([1, 2]) == {}


def test_capacity_evicts_least_recently_used(index, clock):
    index.set_capacity("a", 3)
    for digest in (1, 2, 3):  # one at a time: 1 is the least recently used
        index.insert("a", [digest])
    clock.now += 1
    index.insert("a", [1])  # 1 is now the most recently used
    index.insert("a", [4])  # over capacity: 2 (the least recently used) goes
    assert list(index.ranks["a"]) == [3, 1, 4]
    assert index.size("a") == 3
    assert 2 not in index.owners
    assert index.holders(1) == {"a"}
    assert_consistent(index)


def test_shrinking_capacity_trims_at_once_and_keeps_other_keys(index):
    for digest in (1, 2, 3, 4, 5):
        index.insert("a", [digest])
    index.insert("b", [1, 2])
    index.set_capacity("a", 2)
    assert list(index.ranks["a"]) == [4, 5]
    assert index.holders(1) == {"b"} and index.holders(2) == {"b"}
    assert 3 not in index.owners
    assert index.match([1, 2]) == {"b": 2}
    assert_consistent(index)


def test_capacity_none_means_the_default(index):
    index.set_capacity("a", None)
    assert index.capacity["a"] == 1000
    index.insert("a", list(range(1200)))
    assert index.size("a") == 1000
    assert_consistent(index)


def test_eviction_keeps_a_matchable_prefix(index):
    """The engine frees a sequence's tail blocks first, so its prefix cache keeps a chain's head
    longest. The index must evict the same way: a chain whose head is gone matches nothing, and
    its surviving tail entries only take room."""
    index.set_capacity("a", 4)
    index.insert("a", [1, 2, 3])  # one request's chain
    index.insert("a", [7, 8])  # another: one entry must go, and it is 3, not 1
    assert index.match([1, 2, 3]) == {"a": 2}
    assert index.match([7, 8]) == {"a": 2}
    index.insert("a", [10, 11, 12, 13, 14, 15])  # longer than the capacity: its head survives
    assert index.match([10, 11, 12, 13, 14, 15]) == {"a": 4}
    assert_consistent(index)


def test_ttl_expires_entries_for_match(index, clock):
    index.insert("a", [1, 2])
    clock.now += 50
    index.insert("a", [1])  # refreshes block 0 only
    clock.now += 50  # block 1 is exactly ttl old: still alive
    assert index.match([1, 2]) == {"a": 2}
    clock.now += 0.5  # block 1 expired, block 0 is 50.5 s old
    assert index.match([1, 2]) == {"a": 1}
    clock.now += 50
    assert index.match([1, 2]) == {}


def test_expired_entries_of_one_key_do_not_hide_another(index, clock):
    index.insert("a", [1, 2])
    clock.now += 60
    index.insert("b", [1, 2])
    clock.now += 60
    assert index.match([1, 2]) == {"b": 2}


def test_insert_trims_expired_heads(index, clock):
    index.insert("a", [1, 2])
    clock.now += 101
    index.insert("a", [3])
    assert list(index.ranks["a"]) == [3]
    assert 1 not in index.owners and 2 not in index.owners
    assert_consistent(index)


def test_remove_rank(index):
    index.set_capacity("a", 10)
    index.insert("a", [1, 2, 3])
    index.insert("b", [1, 2])
    index.remove_rank("a")
    assert "a" not in index.ranks and "a" not in index.capacity
    assert set(index.owners) == {1, 2} and index.holders(1) == index.holders(2) == {"b"}
    assert index.match([1, 2, 3]) == {"b": 2}
    assert index.size("a") == 0
    index.remove_rank("a")  # removing twice is harmless
    index.remove_rank("never-seen")
    assert_consistent(index)


def test_shared_blocks_end_at_the_deepest_branch_point(index):
    index.insert("a", [1, 2, 3, 4])
    assert index.shared_blocks([1, 2, 3, 4]) == 0  # one chain: all of it private
    index.insert("b", [1, 2, 7])  # a second request branches after block 1
    assert index.shared_blocks([1, 2, 3, 4]) == 2
    assert index.shared_blocks([1, 2, 7]) == 2
    assert index.shared_blocks([1, 9]) == 1  # this request itself branches off after block 0
    assert index.shared_blocks([1]) == 0  # ends inside the chain: a continuation, not a branch
    index.insert("a", [1, 5])  # another branch, at block 0
    assert index.shared_blocks([1, 9]) == 1
    assert index.shared_blocks([1, 2, 3]) == 2
    assert index.shared_blocks([8, 1, 2]) == 0  # not held: nothing shared
    assert_consistent(index)


def test_fan_out_is_forgotten_with_the_blocks(index):
    index.insert("a", [1, 2])
    index.insert("b", [1, 3])
    assert index.shared_blocks([1, 2]) == 1
    index.remove_rank("a")
    index.remove_rank("b")
    assert index.owners == {} and index.first_child == {} and index.branching == set()
    index.insert("a", [1, 4])
    assert index.shared_blocks([1, 4]) == 0


def test_remove_forgets_what_the_engine_evicted(index):
    index.insert("a", [1, 2, 3])
    index.insert("b", [1, 2])
    assert index.remove("a", [2, 3, 99]) == 2
    assert index.remove("nobody", [1]) == 0
    assert index.match([1, 2, 3]) == {"a": 1, "b": 2}
    assert_consistent(index)


def test_replace_makes_a_rank_hold_exactly_the_snapshot(index, clock):
    index.insert("a", [1, 2, 3])
    index.insert("b", [1, 2])
    index.replace("a", [1, 2, 7, 8])
    assert index.match([1, 2, 3]) == {"a": 2, "b": 2}
    assert index.match([7, 8]) == {"a": 2}
    assert index.size("a") == 4
    index.replace("c", [5])  # a rank the index had not heard of
    assert index.match([5]) == {"c": 1}
    index.replace("a", [])
    assert index.size("a") == 0 and index.match([1, 2]) == {"b": 2}
    assert_consistent(index)


def test_prefix_demand_is_each_prefix_share_of_the_recent_requests():
    clock = Clock()
    demand = PrefixDemand(half_life_s=10.0, clock=clock)
    assert demand.share(7) == 0.0
    for _ in range(3):
        demand.add(7)
    demand.add(None)  # a request with no shared prefix counts in the total only
    assert demand.share(7) == pytest.approx(0.75)
    clock.now += 10.0  # a half-life later, the old requests weigh half
    for _ in range(2):
        demand.add(8)
    assert demand.share(7) == pytest.approx(1.5 / 4)
    assert demand.share(8) == pytest.approx(2 / 4)


def reference_match(index: PrefixIndex, digests, keys=None) -> dict[str, int]:
    """Match by its definition: each rank's leading run of digests it holds within the TTL."""
    now = index.clock()
    out = {}
    for key in keys if keys is not None else list(index.ranks):
        lru = index.ranks.get(key, {})
        n = 0
        while n < len(digests) and now - lru.get(digests[n], -1e18) <= index.ttl_s:
            n += 1
        if n:
            out[key] = n
    return out


def test_match_agrees_with_its_definition_under_random_churn(clock, PrefixIndex):  # noqa: N803
    rng = random.Random(7)
    index = PrefixIndex(ttl_s=30.0, default_capacity=60, clock=clock)
    heads = [[rng.randrange(1, 40) for _ in range(rng.randrange(1, 6))] for _ in range(6)]
    for step in range(600):
        key = f"r{rng.randrange(4)}"
        chain = rng.choice(heads) + [rng.randrange(40, 400) for _ in range(rng.randrange(0, 5))]
        action = rng.random()
        if action < 0.6:
            index.insert(key, chain)
        elif action < 0.7:
            index.remove(key, rng.sample(chain, max(1, len(chain) // 2)))
        elif action < 0.75:
            index.replace(key, chain)
        clock.now += rng.choice((0.0, 0.5, 3.0, 12.0))
        probe = rng.choice(heads) + chain[len(chain) // 2 :]
        keys = rng.choice((None, ["r0", "r2"], ["r1", "nope"]))
        assert index.match(probe, keys) == reference_match(index, probe, keys), step
    assert_consistent(index)


def test_served_volume_is_each_target_s_recent_prompt_tokens_against_the_mean():
    clock = Clock()
    volume = ServedVolume(half_life_s=100.0, clock=clock)
    assert volume.excess(["a", "b"]) == {"a": 0.0, "b": 0.0}  # nothing sent yet: no excess
    volume.add("a", 300)
    volume.add("b", 100)
    assert volume.excess(["a", "b"]) == pytest.approx({"a": 0.5, "b": -0.5})
    assert volume.excess(["a", "b", "c"]) == pytest.approx({"a": 1.25, "b": -0.25, "c": -1.0})
    clock.now += 100.0  # a half-life later the old tokens weigh half
    volume.add("b", 250)
    assert volume.excess(["a", "b"]) == pytest.approx({"a": -1 / 3, "b": 1 / 3})
    volume.forget("b")
    assert volume.excess(["a", "b"]) == pytest.approx({"a": 1.0, "b": -1.0})


def test_served_volume_keeps_peers_shares_theirs_and_decays_over_hours():
    """A process's own volume is what it sent: adding to a target its peers also serve does not
    fold their shares into its own (which it publishes to them: they would count theirs twice,
    and again each round). Hours on, the values have decayed as they should (the scaled values
    are rebased instead of overflowing)."""
    clock = Clock()
    a = ServedVolume(half_life_s=100.0, clock=clock)
    b = ServedVolume(half_life_s=100.0, clock=clock)
    a.add("x", 400)
    b.set_peer("a", {"x": a.own("x")})
    b.add("x", 100)
    assert b.own("x") == pytest.approx(100)
    a.set_peer("b", {"x": b.own("x")})
    a.add("y", 500)
    assert a.excess(["x", "y"]) == pytest.approx({"x": 0.0, "y": 0.0})  # 400 + 100 against 500
    clock.now += 100 * 70  # 70 half-lives: past the rebase
    a.add("y", 1000)
    assert a.own("y") == pytest.approx(1000 + 500 * 0.5**70)
    assert a.excess(["x", "y"]) == pytest.approx({"x": -1.0, "y": 1.0}, abs=1e-9)
    clock.now += 100
    assert a.own("y") == pytest.approx(500)


def test_inserting_the_rank_s_latest_blocks_again_is_a_no_op_until_they_need_renewing(
    clock,
    PrefixIndex,  # noqa: N803
):
    from apps.routing.decision.index import RENEW_AFTER_S

    index = PrefixIndex(ttl_s=100.0, default_capacity=6, clock=clock)
    index.insert("r0", [1, 2, 3])
    index.insert("r0", [7, 8])
    clock.now += 10.0
    index.insert("r0", [1, 2, 3])  # not its latest: renewed, now the most recent
    renewed_at = clock.now
    assert list(index.ranks["r0"]) == [8, 7, 3, 2, 1]
    clock.now += RENEW_AFTER_S / 2
    index.insert("r0", [1, 2, 3])  # its latest, just now: left as it is
    assert set(index.ranks["r0"].values()) == {renewed_at, renewed_at - 10.0}
    clock.now += RENEW_AFTER_S
    index.insert("r0", [1, 2, 3])  # older than that: its timestamps move (the TTL counts from them)
    assert index.ranks["r0"][1] == clock.now

    # a block the engine evicted comes back with the next insert of the same blocks
    index.remove("r0", [2])
    index.insert("r0", [1, 2, 3])
    assert index.match([1, 2, 3]) == {"r0": 3}
    # so does one the LRU evicted: [4, 5, 6, 9] pushes the oldest out
    index.insert("r0", [4, 5, 6, 9])
    assert index.size("r0") == 6 and index.match([1, 2, 3]) != {"r0": 3}
    index.insert("r0", [1, 2, 3])
    assert index.match([1, 2, 3]) == {"r0": 3}
    # and after a snapshot replaced the rank's set
    index.replace("r0", [1])
    index.insert("r0", [1, 2, 3])
    assert index.match([1, 2, 3]) == {"r0": 3}
    assert_consistent(index)


def test_lost_digests_are_remembered_within_a_bounded_memory(index):
    """What a rank held and lost (its LRU, its engine's evictions) is told by ``evicted_run``:
    the recent losses always, the oldest forgotten in halves once ``lost_cap`` is reached, never
    more than ``lost_cap`` remembered."""
    index.lost_cap = 10
    index.set_capacity("a", 4)
    index.insert("a", [1, 2, 3, 4])
    index.insert("a", [5, 6, 7, 8])  # 1-4 evicted by the LRU
    assert index.evicted_run("a", [1, 2, 3, 4, 5], 0) == 4
    assert index.evicted_run("b", [1, 2], 0) == 0  # another rank lost nothing
    index.remove("a", [5])  # its engine evicted 5
    assert index.evicted_run("a", [5, 6], 0) == 1
    for start in range(100, 140, 4):  # 40 more evictions
        index.insert("a", list(range(start, start + 4)))
        assert len(index.lost) + len(index.lost_before) <= index.lost_cap
    assert index.evicted_run("a", [132, 133, 134, 135], 0) == 4  # the latest lost are known
    assert index.evicted_run("a", [1, 2, 3, 4], 0) == 0  # the oldest are forgotten


def snapshot(index) -> tuple:
    """Everything either implementation holds, in the pure one's terms."""
    return (
        {key: list(lru.items()) for key, lru in index.ranks.items()},
        index.owners,
        index.first_child,
        index.branching,
        index.lost,
        index.lost_before,
        index.capacity,
        index._expires_at,
        index._latest,
    )


@pytest.mark.parametrize("seed", range(5))
def test_native_and_pure_agree_operation_by_operation(seed):
    """Random inserts (shared prefixes, repeats, small and 64-bit digests), removals, snapshots,
    ranks leaving, capacities changing, TTL expiry and the lost digests' halves turning over, on
    up to 90 ranks (more than one word of holders): every answer and all state equal."""
    native_or_fail()
    rng = random.Random(seed)
    clock = Clock()
    pure = PurePrefixIndex(ttl_s=40.0, default_capacity=30, clock=clock)
    native = NativePrefixIndex(ttl_s=40.0, default_capacity=30, clock=clock)
    pure.lost_cap = native.lost_cap = 24
    keys = [f"w{w}@{r}" for w in range(3) for r in range(rng.choice((2, 30)))]
    chains = [[rng.randrange(1, 20)] for _ in range(4)]

    def chain() -> list[int]:
        if rng.random() < 0.15:
            return list(rng.choice(chains))  # the same blocks again
        head = rng.choice(chains)[: rng.randrange(0, 6)]
        new = [
            rng.choice((rng.randrange(1, 60), rng.getrandbits(64)))
            for _ in range(rng.randrange(0, 8))
        ]
        chains.append(head + new)
        return chains[-1]

    for step in range(700):
        key, action = rng.choice(keys), rng.random()
        if action < 0.45:
            args = ("insert", key, chain())
        elif action < 0.55:
            held = list(pure.ranks.get(key, {}))
            args = ("remove", key, rng.sample(held, min(len(held), 3)) + [rng.randrange(1, 60)])
        elif action < 0.6:
            args = ("replace", key, chain())
        elif action < 0.62:
            args = ("remove_rank", key)
        elif action < 0.66:
            args = ("set_capacity", key, rng.choice((None, 3, 10, 50)))
        elif action < 0.85:
            subset = rng.choice((None, rng.sample(keys, min(4, len(keys))) + ["gone"], []))
            args = ("lookup", chain(), subset)
        elif action < 0.92:
            args = ("evicted_run", key, chain(), rng.randrange(0, 3))
        else:
            args = ("holders", rng.choice(rng.choice(chains) or [1]))
        name, *rest = args
        assert getattr(native, name)(*rest) == getattr(pure, name)(*rest), (step, args)
        assert native.size(key) == pure.size(key) and native.room(key) == pure.room(key)
        clock.now += rng.choice((0.0, 0.0, 0.4, 2.0, 9.0))
        if step % 10 == 0:
            assert snapshot(native) == snapshot(pure), (step, args)
    assert snapshot(native) == snapshot(pure)
    assert_consistent(native)


def test_the_native_core_refuses_what_is_not_a_64_bit_digest():
    index = native_or_fail()(clock=Clock())
    with pytest.raises(OverflowError):
        index.insert("a", [1 << 64])
    with pytest.raises(TypeError):
        index.insert("a", ["1"])
    index.insert("a", [1, 2])  # and stays whole after refusing
    assert index.match([1, 2]) == {"a": 2}
