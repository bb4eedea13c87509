"""The paged KV pool and its prefix cache.

Full blocks are keyed by their chained digest (engine.digests). A hit needs the digest *and*
equal token ids. Unreferenced blocks stay in an LRU map (oldest first) and keep their digest, so
a later request can revive them; a block loses its digest only when the pool reuses it. Every
method that changes state has a side-effect-free ``can_*`` twin, so the scheduler checks before
it commits.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from engine.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    digest: int | None = None
    token_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class BlockStored:
    """KV event: these full blocks now hold KV and can be hit (vLLM's BlockStored)."""

    digests: list[int]
    parent_digest: int | None
    token_ids: list[int]
    block_size: int


@dataclass(frozen=True)
class BlockRemoved:
    """KV event: these digests can no longer be hit."""

    digests: list[int]


@dataclass
class PoolUsage:
    total: int
    used: int  # referenced by at least one sequence
    cached_free: int  # unreferenced but holding a digest (revivable)
    empty_free: int = field(default=0)


class BlockManager:
    """Owns ``num_blocks`` KV blocks of ``block_size`` tokens for one engine.

    KV events wait in ``events`` until ``drain_events()``; only the newest ``MAX_PENDING_EVENTS``
    are kept, so an engine whose events nobody drains does not grow without bound.
    """

    MAX_PENDING_EVENTS = 10_000

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.by_digest: dict[int, int] = {}
        self.cached_free = 0  # free blocks still holding a digest, kept as they change
        self.events: deque[BlockStored | BlockRemoved] = deque(maxlen=self.MAX_PENDING_EVENTS)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    # ----- prefix lookup -------------------------------------------------------------------
    def _hit(self, seq: Sequence, i: int) -> Block | None:
        block_id = self.by_digest.get(seq.digest(i))
        if block_id is None:
            return None
        block = self.blocks[block_id]
        return block if block.token_ids == tuple(seq.block_tokens(i)) else None

    def prefix_hits(self, seq: Sequence) -> list[Block]:
        """The cached blocks that the head of ``seq`` can reuse. The last token is always
        recomputed, so at most ``(num_tokens - 1) // block_size`` blocks can hit."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        for i in range((seq.num_tokens - 1) // self.block_size):
            block = self._hit(seq, i)
            if block is None:
                break
            hits.append(block)
        return hits

    # ----- admission -----------------------------------------------------------------------
    def _blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, seq: Sequence) -> bool:
        """Whether ``allocate(seq)`` would succeed. No side effects."""
        hits = self.prefix_hits(seq)
        revived = sum(1 for b in hits if b.ref_count == 0)
        fresh = self._blocks_needed(seq.num_tokens) - len(hits)
        return fresh + revived <= len(self.free)

    def allocate(self, seq: Sequence) -> None:
        """Give ``seq`` blocks for all its tokens, reusing its cached prefix.
        Sets ``block_table`` and ``num_computed_tokens`` (the hit length)."""
        assert not seq.block_table, f"{seq} already has blocks"
        hits = self.prefix_hits(seq)
        for block in hits:
            if block.ref_count == 0:
                del self.free[block.block_id]
                self.cached_free -= 1  # a hit holds its digest
            block.ref_count += 1
        seq.block_table = [b.block_id for b in hits]
        seq.num_computed_tokens = len(hits) * self.block_size
        self._grow(seq, self._blocks_needed(seq.num_tokens) - len(hits))

    def can_append(self, seq: Sequence) -> bool:
        """Whether ``may_append(seq)`` would succeed. No side effects."""
        return self._blocks_needed(seq.num_tokens) - len(seq.block_table) <= len(self.free)

    def may_append(self, seq: Sequence) -> None:
        """Make room for every token of ``seq`` (a decode step needs a new block every
        ``block_size`` tokens)."""
        self._grow(seq, self._blocks_needed(seq.num_tokens) - len(seq.block_table))

    def _grow(self, seq: Sequence, count: int) -> None:
        if count > len(self.free):
            raise RuntimeError(f"KV pool exhausted: need {count}, free {len(self.free)}")
        for _ in range(count):
            seq.block_table.append(self._take_free())

    def _take_free(self) -> int:
        block_id, _ = self.free.popitem(last=False)  # least recently freed first
        block = self.blocks[block_id]
        assert block.ref_count == 0, f"free block {block_id} has ref_count {block.ref_count}"
        if block.digest is not None:
            self.cached_free -= 1
            if self.by_digest.get(block.digest) == block_id:
                del self.by_digest[block.digest]
                self.events.append(BlockRemoved([block.digest]))
            block.digest = None
            block.token_ids = None
        block.ref_count = 1
        return block_id

    # ----- caching computed blocks ------------------------------------------------------------
    def commit_computed(self, seq: Sequence, num_computed_tokens: int) -> None:
        """Publish the full blocks of ``seq`` whose KV is computed (or being computed in this
        step) up to ``num_computed_tokens``, so later requests can hit them."""
        if not self.enable_prefix_caching:
            return
        run: list[int] = []  # indices of consecutive blocks published by this call
        for i in range(min(num_computed_tokens, seq.num_tokens) // self.block_size):
            block = self.blocks[seq.block_table[i]]
            # a block already holding a digest (a hit, or published earlier) or whose digest another
            # block holds (computed twice; keep the first) is skipped
            if block.digest is None and seq.digest(i) not in self.by_digest:
                block.digest, block.token_ids = seq.digest(i), tuple(seq.block_tokens(i))
                self.by_digest[block.digest] = block.block_id
                run.append(i)
            elif run:  # one event describes one unbroken chain: close it at a gap
                self._emit_stored(seq, run)
                run = []
        if run:
            self._emit_stored(seq, run)

    def _emit_stored(self, seq: Sequence, run: list[int]) -> None:
        first, last = run[0], run[-1]
        self.events.append(
            BlockStored(
                [seq.digest(i) for i in run],
                seq.digest(first - 1) if first else None,
                seq.token_ids[first * self.block_size : (last + 1) * self.block_size],
                self.block_size,
            )
        )

    # ----- release -------------------------------------------------------------------------
    def free_sequence(self, seq: Sequence) -> None:
        """Drop ``seq``'s references, tail first, so shared heads are evicted last."""
        self.release(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0

    # ----- prefill/decode disaggregation (engine/kv_transfer.py) ---------------------------------
    def hold(self, seq: Sequence, count: int) -> list[int]:
        """One more reference on the first ``count`` blocks of ``seq``, so they outlive it: a
        prefill's blocks waiting for a decode rank to pull them. ``release`` gives them back."""
        block_ids = seq.block_table[:count]
        for block_id in block_ids:
            self.blocks[block_id].ref_count += 1
        return block_ids

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference on each of ``block_ids`` (a sequence's, ``hold``'s or ``pin``'s),
        tail first, so shared heads are evicted last."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} released twice"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
                self.cached_free += block.digest is not None

    def pin(self, block_ids: list[int]) -> None:
        """One more reference on blocks that may be free (cached): kept from eviction until
        ``release``."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
                self.cached_free -= block.digest is not None
            block.ref_count += 1

    def cached_prefix(self, seq: Sequence, count: int) -> list[int]:
        """The ids of the longest run of ``seq``'s first ``count`` full blocks cached here (with
        equal tokens), from its first block."""
        found = []
        for i in range(count):
            block = self._hit(seq, i) if self.enable_prefix_caching else None
            if block is None:
                break
            found.append(block.block_id)
        return found

    def can_import(self, count: int) -> bool:
        return count <= len(self.free)

    def import_blocks(self, count: int) -> list[int]:
        """Take ``count`` blocks for KV computed elsewhere; the caller writes it, then
        ``publish_imported``. Each is held (one reference) until then, so nothing reuses it half
        written."""
        if count > len(self.free):
            raise RuntimeError(f"KV pool exhausted: need {count}, free {len(self.free)}")
        return [self._take_free() for _ in range(count)]

    def publish_imported(self, seq: Sequence, first: int, block_ids: list[int]) -> None:
        """The imported blocks' KV is written: cache them under ``seq``'s digests (one stored
        event, as if computed here) and drop the import's references; they stay cached, most
        recently freed, for the request that asked for them. A digest already cached here (two
        imports of one prefix at once) keeps its first block; the other is freed empty."""
        run: list[int] = []
        for offset, block_id in enumerate(block_ids):
            i = first + offset
            block = self.blocks[block_id]
            if self.enable_prefix_caching and seq.digest(i) not in self.by_digest:
                block.digest, block.token_ids = seq.digest(i), tuple(seq.block_tokens(i))
                self.by_digest[block.digest] = block_id
                run.append(i)
            elif run:
                self._emit_stored(seq, run)
                run = []
        if run:
            self._emit_stored(seq, run)
        self.release(block_ids)

    # ----- observation -----------------------------------------------------------------------
    def drain_events(self) -> list[BlockStored | BlockRemoved]:
        events = list(self.events)
        self.events.clear()
        return events

    def usage(self) -> PoolUsage:
        """O(1): a rank reports it every 0.25 s while busy, and counting a pool of 250 k blocks
        took ~15 ms each time."""
        return PoolUsage(
            total=self.num_blocks,
            used=self.num_blocks - len(self.free),
            cached_free=self.cached_free,
            empty_free=len(self.free) - self.cached_free,
        )

    def check_integrity(self, sequences: list[Sequence] | None = None) -> None:
        """Raise AssertionError, with the numbers, if the pool's bookkeeping is inconsistent.
        With ``sequences`` (every live one), reference counts are checked against block tables."""
        used = [b for b in self.blocks if b.ref_count > 0]
        if len(used) + len(self.free) != self.num_blocks:
            raise AssertionError(
                f"used {len(used)} + free {len(self.free)} != total {self.num_blocks}"
            )
        cached_free = sum(1 for i in self.free if self.blocks[i].digest is not None)
        if cached_free != self.cached_free:
            raise AssertionError(f"cached_free {self.cached_free} != {cached_free} counted")
        for block_id in self.free:
            if self.blocks[block_id].ref_count != 0:
                raise AssertionError(
                    f"free block {block_id} has ref_count {self.blocks[block_id].ref_count}"
                )
        for digest, block_id in self.by_digest.items():
            if self.blocks[block_id].digest != digest:
                raise AssertionError(
                    f"digest map points {digest:#x} at block {block_id} holding another"
                )
        if sequences is not None:
            refs: dict[int, int] = {}
            for seq in sequences:
                for block_id in seq.block_table:
                    refs[block_id] = refs.get(block_id, 0) + 1
            for block in self.blocks:
                if refs.get(block.block_id, 0) != block.ref_count:
                    raise AssertionError(
                        f"block {block.block_id}: ref_count {block.ref_count}, "
                        f"held by {refs.get(block.block_id, 0)} sequences"
                    )
