"""BlockManager with toy sizes (8 blocks of 4 tokens): exact hit counts, eviction order, revival,
reference counts, side-effect-free checks, KV events, integrity checks, and the digest formula."""

from __future__ import annotations

import copy
import struct

import pytest
import xxhash

from engine.block_manager import BlockManager, BlockRemoved, BlockStored, PoolUsage
from engine.digests import block_digest, chain_digests
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

BS = 4
NUM_BLOCKS = 8


def seq(tokens) -> Sequence:
    return Sequence(list(tokens), SamplingParams(max_tokens=4, temperature=0), block_size=BS)


def computed(bm: BlockManager, tokens) -> Sequence:
    """A sequence allocated and with all its full blocks published (its prefill is done)."""
    s = seq(tokens)
    bm.allocate(s)
    s.num_computed_tokens = s.num_tokens
    bm.commit_computed(s, s.num_tokens)
    return s


def snapshot(bm: BlockManager, *seqs: Sequence):
    return (
        copy.deepcopy(bm.blocks),
        list(bm.free.items()),
        dict(bm.by_digest),
        list(bm.events),
        [
            (list(s.block_table), s.num_computed_tokens, s.num_cached_tokens, list(s.token_ids))
            for s in seqs
        ],
    )


@pytest.fixture
def bm() -> BlockManager:
    return BlockManager(num_blocks=NUM_BLOCKS, block_size=BS)


A12 = list(range(100, 112))  # three full blocks
B12 = list(range(200, 212))


# ----- digests ------------------------------------------------------------------------------


def reference_digest(parent, tokens) -> int:
    data = (b"" if parent is None else struct.pack("<Q", parent)) + struct.pack(
        f"<{len(tokens)}i", *tokens
    )
    return xxhash.xxh64(data, seed=0).intdigest()


def test_digest_formula():
    first = [1, 2, 3, 4]
    d0 = block_digest(None, first)
    assert d0 == xxhash.xxh64(struct.pack("<4i", *first), seed=0).intdigest()
    d1 = block_digest(d0, [5, 6, 70000, 2**31 - 1])
    assert (
        d1
        == xxhash.xxh64(
            struct.pack("<Q", d0) + struct.pack("<4i", 5, 6, 70000, 2**31 - 1), seed=0
        ).intdigest()
    )
    # a parent digest with the top bit set still packs as unsigned little-endian
    big = 2**64 - 5
    assert block_digest(big, first) == reference_digest(big, first)
    tokens = list(range(11))  # two full blocks and a partial one: only full blocks have digests
    assert chain_digests(tokens, BS) == [
        reference_digest(None, tokens[:4]),
        reference_digest(reference_digest(None, tokens[:4]), tokens[4:8]),
    ]
    assert chain_digests(tokens, BS) == [seq(tokens).digest(0), seq(tokens).digest(1)]


# ----- allocation and hits --------------------------------------------------------------------


def test_fresh_allocation(bm):
    s = seq(range(10))
    assert bm.can_allocate(s)
    bm.allocate(s)
    assert s.block_table == [0, 1, 2]
    assert s.num_computed_tokens == 0
    assert bm.usage() == PoolUsage(total=8, used=3, cached_free=0, empty_free=5)
    assert [bm.blocks[i].ref_count for i in range(8)] == [1, 1, 1, 0, 0, 0, 0, 0]
    bm.check_integrity([s])


def test_hit_counts(bm):
    a = computed(bm, range(8))  # two full blocks, both published
    assert len(bm.by_digest) == 2
    # exactly the cached 8 tokens: the last token is recomputed, so only one block (4 tokens) hits
    b = seq(range(8))
    bm.allocate(b)
    assert b.num_computed_tokens == 4
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]
    # one more token: both blocks hit
    c = seq(list(range(8)) + [99])
    bm.allocate(c)
    assert c.num_computed_tokens == 8
    assert c.block_table[:2] == a.block_table
    # a shared first block only
    d = seq(list(range(4)) + [50, 51, 52, 53, 54])
    bm.allocate(d)
    assert d.num_computed_tokens == 4
    # a different first block: no hit even though the second block's tokens match (chained digests)
    e = seq([9, 1, 2, 3] + list(range(4, 8)) + [0])
    assert bm.prefix_hits(e) == []
    assert bm.blocks[a.block_table[0]].ref_count == 4  # a, b, c, d
    assert bm.blocks[a.block_table[1]].ref_count == 2  # a, c
    assert bm.usage().used == 6
    bm.check_integrity([a, b, c, d])


def test_short_prompts_never_hit(bm):
    computed(bm, range(4))
    for n in (1, 3, 4):  # (n - 1) // 4 == 0 full blocks may hit
        s = seq(range(n))
        assert bm.prefix_hits(s) == []


def test_hit_needs_equal_token_ids(bm):
    a = computed(bm, range(8))
    head = bm.blocks[a.block_table[0]]
    head.token_ids = (0, 1, 2, 5)  # a digest collision: same digest, other tokens
    b = seq(list(range(8)) + [42])
    assert bm.prefix_hits(b) == []
    bm.allocate(b)
    assert b.num_computed_tokens == 0
    assert head.ref_count == 1
    assert set(b.block_table).isdisjoint(a.block_table)


def test_prefix_caching_disabled():
    bm = BlockManager(NUM_BLOCKS, BS, enable_prefix_caching=False)
    computed(bm, range(9))
    assert bm.by_digest == {} and bm.drain_events() == []
    b = seq(range(9))
    bm.allocate(b)
    assert b.num_computed_tokens == 0


# ----- eviction --------------------------------------------------------------------------------


def test_tail_evicted_before_head(bm):
    a = computed(bm, A12)
    d = [a.digest(i) for i in range(3)]
    bm.drain_events()
    bm.free_sequence(a)
    assert a.block_table == [] and a.num_computed_tokens == 0
    assert bm.usage().cached_free == 3 and bm.usage().used == 0
    filler = seq(range(1000, 1020))  # 5 blocks: exactly the never-used ones
    bm.allocate(filler)
    assert bm.drain_events() == [] and set(bm.by_digest) == set(d)
    removed = []
    for _ in range(3):
        one = seq([7])
        bm.allocate(one)
        removed += bm.drain_events()
    assert removed == [BlockRemoved([d[2]]), BlockRemoved([d[1]]), BlockRemoved([d[0]])]
    assert bm.by_digest == {}


def test_older_freed_sequence_evicted_first(bm):
    a = computed(bm, A12[:8])
    b = computed(bm, B12[:8])
    da, db = [a.digest(0), a.digest(1)], [b.digest(0), b.digest(1)]
    bm.free_sequence(a)
    bm.free_sequence(b)
    bm.drain_events()
    bm.allocate(seq(range(1000, 1016)))  # the four never-used blocks
    assert bm.drain_events() == []
    gone = []
    for expected_left in (3, 2, 1, 0):
        bm.allocate(seq([5]))
        gone += [ev.digests[0] for ev in bm.drain_events()]
        assert len(bm.by_digest) == expected_left
    assert gone == [da[1], da[0], db[1], db[0]]


def test_revival_of_freed_cached_block(bm):
    a = computed(bm, range(8))
    table = list(a.block_table)
    bm.free_sequence(a)
    assert bm.usage() == PoolUsage(total=8, used=0, cached_free=2, empty_free=6)
    assert all(bm.blocks[i].ref_count == 0 and i in bm.free for i in table)
    bm.drain_events()
    b = seq(list(range(8)) + [99])
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert b.num_computed_tokens == 8
    assert b.block_table[:2] == table
    for i in table:
        assert bm.blocks[i].ref_count == 1 and i not in bm.free
    # only the third block was taken from the empty ones; nothing was evicted
    assert bm.usage() == PoolUsage(total=8, used=3, cached_free=0, empty_free=5)
    assert bm.drain_events() == []
    bm.check_integrity([b])


def test_revived_block_counts_against_free_space(bm):
    a = computed(bm, range(8))
    bm.free_sequence(a)
    bm.allocate(seq(range(500, 520)))  # 5 blocks: 1 empty block and the 2 cached ones stay free
    assert bm.num_free_blocks == 3
    too_big = seq(list(range(8)) + [1, 2, 3, 4, 5])  # 4 blocks: 2 revived + 2 fresh > 3 free
    assert not bm.can_allocate(too_big)
    fits_exactly = seq(list(range(8)) + [1, 2, 3, 4])  # 3 blocks: 2 revived + 1 fresh == 3 free
    assert bm.can_allocate(fits_exactly)
    bm.allocate(fits_exactly)
    assert fits_exactly.num_computed_tokens == 8 and bm.num_free_blocks == 0


def test_shared_block_reference_counts(bm):
    a = computed(bm, list(range(8)) + [1])
    b = seq(list(range(8)) + [2, 3])
    bm.allocate(b)
    shared = a.block_table[:2]
    assert b.block_table[:2] == shared
    assert [bm.blocks[i].ref_count for i in shared] == [2, 2]
    assert bm.usage().used == 4  # two shared + one tail each
    bm.free_sequence(a)
    assert [bm.blocks[i].ref_count for i in shared] == [1, 1]
    assert bm.usage().used == 3 and not any(i in bm.free for i in shared)
    bm.check_integrity([b])
    bm.free_sequence(b)
    assert [bm.blocks[i].ref_count for i in shared] == [0, 0]
    assert bm.usage().used == 0
    bm.check_integrity([])


# ----- checks before commits ----------------------------------------------------------------------


def test_can_allocate_and_can_append_have_no_side_effects(bm):
    a = computed(bm, range(9))
    bm.free_sequence(a)  # two revivable blocks in the free map
    running = computed(bm, range(300, 308))
    running.append_token(1)  # needs a third block on the next may_append
    candidates = [seq(list(range(8)) + [5]), seq(range(40)), seq(range(300, 309)), seq([1])]
    before = snapshot(bm, running, *candidates)
    answers = [bm.can_allocate(c) for c in candidates] + [bm.can_append(running)]
    assert answers == [True, False, True, True, True]
    assert snapshot(bm, running, *candidates) == before
    # and a False answer from can_append leaves everything alone too
    bm.allocate(seq(range(700, 724)))  # takes the 6 remaining free blocks (evicts the cached ones)
    assert bm.num_free_blocks == 0
    before = snapshot(bm, running)
    assert not bm.can_append(running)
    assert snapshot(bm, running) == before
    with pytest.raises(RuntimeError, match="need 1, free 0"):
        bm.may_append(running)


def test_may_append_grows_every_block_size_tokens(bm):
    s = computed(bm, range(4))
    assert len(s.block_table) == 1
    for n in range(5, 14):
        s.append_token(n)
        assert bm.can_append(s)
        bm.may_append(s)
        assert len(s.block_table) == -(-n // BS)
    assert bm.usage().used == 4


# ----- release and events ----------------------------------------------------------------------


def test_free_after_abort_returns_every_block(bm):
    s = seq(range(30))  # 8 blocks: the whole pool
    bm.allocate(s)
    s.num_computed_tokens = 13  # aborted mid-prefill
    bm.commit_computed(s, 13)
    assert bm.usage().used == 8 and bm.num_free_blocks == 0
    bm.free_sequence(s)
    assert bm.usage() == PoolUsage(total=8, used=0, cached_free=3, empty_free=5)
    assert all(b.ref_count == 0 for b in bm.blocks)
    bm.check_integrity([])


def test_commit_computed_emits_block_stored(bm):
    s = seq(A12 + [1])
    bm.allocate(s)
    bm.commit_computed(s, 5)  # one full block computed
    assert bm.drain_events() == [BlockStored([s.digest(0)], None, A12[:4], BS)]
    bm.commit_computed(s, 5)  # nothing new
    assert bm.drain_events() == []
    bm.commit_computed(s, 13)  # the rest; the partial block gets no digest
    assert bm.drain_events() == [BlockStored([s.digest(1), s.digest(2)], s.digest(0), A12[4:], BS)]
    for i, block_id in enumerate(s.block_table[:3]):
        assert bm.blocks[block_id].digest == s.digest(i)
        assert bm.blocks[block_id].token_ids == tuple(A12[i * 4 : (i + 1) * 4])
    assert bm.blocks[s.block_table[3]].digest is None
    # a second sequence computing the same blocks in its own copies publishes nothing
    t = seq(A12[:8])
    bm.allocate(t)  # hits block 0 only (last token recomputed)
    bm.commit_computed(t, 8)
    assert bm.drain_events() == []
    assert bm.by_digest[t.digest(1)] == s.block_table[1]


def test_stored_events_split_at_gaps(bm):
    """Regression: a block skipped in the middle (its digest held by another block) used to be
    folded into one event whose digests no longer matched its token ids."""
    prefix = list(range(1, 9))
    s = seq(prefix + [9])
    bm.allocate(s)
    r = seq(prefix + [10])
    bm.allocate(r)  # admitted before s published anything: its own copies of both blocks
    s.num_computed_tokens = 4
    bm.commit_computed(s, 4)  # s publishes block 0
    r.num_computed_tokens = 8
    bm.commit_computed(r, 8)  # r: block 0 is a duplicate, block 1 is published from r's copy
    bm.free_sequence(s)
    filler = seq(range(100, 120))
    bm.allocate(filler)  # evicts s's blocks: block 0's digest is gone, block 1's stays (r's copy)
    assert set(bm.by_digest) == {r.digest(1)}
    bm.free_sequence(filler)
    bm.drain_events()
    b = seq(prefix + [11, 12, 13, 14, 15])
    bm.allocate(b)  # the head is gone, so nothing hits
    assert b.num_computed_tokens == 0
    bm.commit_computed(b, 12)  # publishes blocks 0 and 2; block 1 is r's
    assert bm.drain_events() == [
        BlockStored([b.digest(0)], None, prefix[:4], BS),
        BlockStored([b.digest(2)], b.digest(1), [11, 12, 13, 14], BS),
    ]


def test_stored_event_chains_from_parent(bm):
    computed(bm, A12)
    events = bm.drain_events()
    assert len(events) == 1
    ev = events[0]
    assert ev.digests == chain_digests(ev.token_ids, BS, ev.parent_digest)


def test_undrained_events_are_bounded(monkeypatch):
    monkeypatch.setattr(BlockManager, "MAX_PENDING_EVENTS", 3)
    bm = BlockManager(NUM_BLOCKS, BS)
    for start in range(0, 50, 10):  # five single-block publications, nobody draining
        s = computed(bm, range(start, start + 4))
        bm.free_sequence(s)
    assert len(bm.events) == 3
    events = bm.drain_events()
    assert [type(e) for e in events] == [BlockStored] * 3 and events[-1].token_ids == [
        40,
        41,
        42,
        43,
    ]
    assert bm.drain_events() == []


# ----- integrity ----------------------------------------------------------------------------------


def test_check_integrity_passes_on_consistent_state(bm):
    a = computed(bm, range(9))
    b = seq(range(9))
    bm.allocate(b)
    bm.check_integrity([a, b])
    bm.check_integrity()


def test_check_integrity_counts(bm):
    computed(bm, range(8))
    bm.blocks[5].ref_count = 1  # a free block that claims a user
    with pytest.raises(AssertionError, match=r"used 3 \+ free 6 != total 8"):
        bm.check_integrity()


def test_check_integrity_lost_block(bm):
    computed(bm, range(8))
    del bm.free[7]  # a block neither used nor free
    with pytest.raises(AssertionError, match=r"used 2 \+ free 5 != total 8"):
        bm.check_integrity()


def test_check_integrity_free_block_with_references(bm):
    s = computed(bm, range(4))
    bm.blocks[s.block_table[0]].ref_count = 0
    bm.blocks[3].ref_count = 1  # totals still add up, but a free block is referenced
    with pytest.raises(AssertionError, match="free block 3 has ref_count 1"):
        bm.check_integrity()


def test_check_integrity_cached_free_counter(bm):
    """usage() reads a counter kept as blocks come and go; a drift is caught, not reported."""
    s = computed(bm, range(8))
    bm.free_sequence(s)
    assert bm.usage().cached_free == 2
    bm.check_integrity()
    bm.cached_free += 1
    with pytest.raises(AssertionError, match="cached_free 3 != 2 counted"):
        bm.check_integrity()


def test_check_integrity_digest_map(bm):
    s = computed(bm, range(8))
    d0 = s.digest(0)
    bm.by_digest[d0] = s.block_table[1]
    with pytest.raises(
        AssertionError, match=f"digest map points {d0:#x} at block {s.block_table[1]}"
    ):
        bm.check_integrity()


def test_check_integrity_reference_counts_against_sequences(bm):
    a = computed(bm, range(9))
    b = seq(range(9))
    bm.allocate(b)
    shared = a.block_table[0]
    with pytest.raises(AssertionError, match=rf"block {shared}: ref_count 2, held by 1 sequences"):
        bm.check_integrity([a])
    bm.blocks[shared].ref_count = 3
    with pytest.raises(AssertionError, match=rf"block {shared}: ref_count 3, held by 2 sequences"):
        bm.check_integrity([a, b])
