"""A stateful property test of BlockManager: random admissions (from a few shared prefixes, so
prefix hits, revivals and evictions all happen), chunked computes, decode appends, preemptions,
finishes and aborts on a 12-block pool.

Besides ``check_integrity`` after every step, a shadow KV pool records, for every slot, the token
prefix whose KV was written there; every computed position of a live sequence, and every
published block, must hold exactly the right prefix. A router-style mirror fed only by the KV
events must always equal the set of hittable digests.
"""

from __future__ import annotations

import copy

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.block_manager import BlockManager, BlockRemoved, BlockStored
from engine.digests import chain_digests
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

BS = 4
NUM_BLOCKS = 12
# Few distinct token values: equal blocks at different positions (same tokens, other digest) occur.
PREFIXES = [
    [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4],
    [1, 2, 3, 4, 9, 9, 9, 9, 5, 5, 5, 5],
    [5, 6, 7, 8] * 3,
]
MAX_TOKENS = 28  # 7 blocks: one sequence never needs the whole pool


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BS)
        self.live: list[Sequence] = []
        self.preempted: list[Sequence] = []
        self.kv: list[list[tuple[int, ...] | None]] = [[None] * BS for _ in range(NUM_BLOCKS)]
        self.mirror: set[int] = set()  # what a router would know from the events alone

    # ----- helpers ----------------------------------------------------------------------------
    def _state(self):
        return (
            copy.deepcopy(self.bm.blocks),
            list(self.bm.free.items()),
            dict(self.bm.by_digest),
            list(self.bm.events),
            [(list(s.block_table), s.num_computed_tokens) for s in self.live + self.preempted],
        )

    def _admit(self, s: Sequence) -> bool:
        before = self._state()
        ok = self.bm.can_allocate(s)
        assert self._state() == before, "can_allocate changed state"
        if not ok:
            return False
        hits = [b.block_id for b in self.bm.prefix_hits(s)]
        revived = sum(1 for b in hits if self.bm.blocks[b].ref_count == 0)
        free_before = self.bm.num_free_blocks
        self.bm.allocate(s)
        assert s.block_table[: len(hits)] == hits
        assert s.num_computed_tokens == len(hits) * BS
        assert len(s.block_table) == -(-s.num_tokens // BS)
        assert self.bm.num_free_blocks == free_before - revived - (len(s.block_table) - len(hits))
        self.live.append(s)
        return True

    def _compute(self, s: Sequence, n: int) -> None:
        start = s.num_computed_tokens
        for p in range(start, start + n):
            self.kv[s.block_table[p // BS]][p % BS] = tuple(s.token_ids[: p + 1])
        s.num_computed_tokens += n
        self.bm.commit_computed(s, s.num_computed_tokens)

    def _release(self, s: Sequence) -> None:
        self.bm.free_sequence(s)
        assert s.block_table == [] and s.num_computed_tokens == 0

    # ----- rules --------------------------------------------------------------------------------
    @rule(
        prefix=st.sampled_from(PREFIXES),
        keep=st.integers(0, 12),
        suffix=st.lists(st.integers(1, 9), max_size=6),
    )
    def admit(self, prefix, keep, suffix):
        tokens = prefix[:keep] + suffix
        if tokens:
            self._admit(Sequence(tokens, SamplingParams(max_tokens=4), block_size=BS))

    @precondition(lambda self: self.preempted)
    @rule(i=st.integers(0, 100))
    def readmit(self, i):
        s = self.preempted[i % len(self.preempted)]
        if self._admit(s):
            self.preempted.remove(s)

    @precondition(lambda self: any(s.num_computed_tokens < s.num_tokens for s in self.live))
    @rule(i=st.integers(0, 100), n=st.integers(1, 9))
    def compute_chunk(self, i, n):
        pending = [s for s in self.live if s.num_computed_tokens < s.num_tokens]
        s = pending[i % len(pending)]
        self._compute(s, min(n, s.num_tokens - s.num_computed_tokens))

    @precondition(lambda self: any(s.num_computed_tokens == s.num_tokens for s in self.live))
    @rule(i=st.integers(0, 100), token=st.integers(1, 9))
    def decode(self, i, token):
        done = [
            s
            for s in self.live
            if s.num_computed_tokens == s.num_tokens and s.num_tokens < MAX_TOKENS
        ]
        if not done:
            return
        s = done[i % len(done)]
        s.append_token(token)
        before = self._state()
        ok = self.bm.can_append(s)
        assert self._state() == before, "can_append changed state"
        if ok:
            self.bm.may_append(s)
            assert len(s.block_table) == -(-s.num_tokens // BS)
            self._compute(s, 1)
        else:  # the scheduler would preempt: free now, recompute (mostly from cache) later
            self.live.remove(s)
            self._release(s)
            self.preempted.append(s)

    @precondition(lambda self: any(s.num_computed_tokens == s.num_tokens for s in self.live))
    @rule(i=st.integers(0, 100))
    def finish(self, i):
        done = [s for s in self.live if s.num_computed_tokens == s.num_tokens]
        s = done[i % len(done)]
        self.live.remove(s)
        self._release(s)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100))
    def abort(self, i):
        s = self.live.pop(i % len(self.live))
        self._release(s)

    @precondition(lambda self: self.preempted)
    @rule(i=st.integers(0, 100))
    def abort_preempted(self, i):
        self.preempted.pop(i % len(self.preempted))  # holds no blocks: nothing to free

    # ----- invariants -----------------------------------------------------------------------------
    @invariant()
    def integrity(self):
        self.bm.check_integrity(self.live)
        for s in self.preempted:
            assert s.block_table == []

    @invariant()
    def computed_kv_is_right(self):
        for s in self.live:
            for p in range(s.num_computed_tokens):
                assert self.kv[s.block_table[p // BS]][p % BS] == tuple(s.token_ids[: p + 1]), (
                    s,
                    p,
                )

    @invariant()
    def published_blocks_hold_their_prefix(self):
        for digest, block_id in self.bm.by_digest.items():
            block = self.bm.blocks[block_id]
            prefix = self.kv[block_id][BS - 1]
            assert prefix is not None and len(prefix) % BS == 0
            assert chain_digests(prefix, BS)[-1] == digest
            assert tuple(prefix[-BS:]) == block.token_ids

    @invariant()
    def events_mirror_the_cache(self):
        for ev in self.bm.drain_events():
            if isinstance(ev, BlockStored):
                assert len(ev.token_ids) == len(ev.digests) * ev.block_size
                assert ev.digests == chain_digests(ev.token_ids, ev.block_size, ev.parent_digest)
                assert not self.mirror & set(ev.digests)
                self.mirror |= set(ev.digests)
            else:
                assert isinstance(ev, BlockRemoved)
                assert set(ev.digests) <= self.mirror
                self.mirror -= set(ev.digests)
        assert self.mirror == set(self.bm.by_digest)

    def teardown(self):
        for s in self.live:
            self._release(s)
        self.live = []
        usage = self.bm.usage()
        assert usage.used == 0, usage
        assert usage.cached_free == len(self.bm.by_digest)
        self.bm.check_integrity([])


BlockManagerMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
TestBlockManagerMachine = BlockManagerMachine.TestCase
