"""Continuous batching: FCFS, chunked prefill under a token budget, decodes and prefills mixed,
preemption by recompute when the KV pool runs dry."""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.sequence import Sequence, SequenceStatus


class ScheduledSeq(NamedTuple):
    seq: Sequence
    start: int  # first token position computed in this step
    num_tokens: int  # how many tokens of this sequence this step computes

    @property
    def is_prefill(self) -> bool:
        """Prompt work (or recompute after preemption), as opposed to one decode token."""
        return self.num_tokens > 1 or self.start < self.seq.num_prompt_tokens

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the sequence, so a token is sampled."""
        return self.start + self.num_tokens == self.seq.num_tokens


class ScheduledBatch(NamedTuple):
    items: list[ScheduledSeq]
    preempted: list[Sequence]

    @property
    def num_tokens(self) -> int:
        return sum(item.num_tokens for item in self.items)

    @property
    def prefills(self) -> list[ScheduledSeq]:
        return [item for item in self.items if item.is_prefill]


class Scheduler:
    """Decides, each step, which tokens of which sequences to compute.

    Running sequences go first, in arrival order: each decode takes one token of the budget,
    a partially prefilled sequence takes the next chunk. Waiting sequences are then admitted in
    arrival order while budget, ``max_num_seqs`` and KV blocks allow. When a running sequence
    needs a block and none is free, the most recently arrived running sequence is preempted:
    its blocks are freed and it re-enters the head of the queue, to be recomputed (mostly from
    the prefix cache) later.
    """

    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def num_unfinished(self) -> int:
        return sum(1 for s in self.waiting if not s.is_finished) + len(self.running)

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        items: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        running: list[Sequence] = []
        queue = list(self.running)
        while queue:
            seq = queue.pop(0)
            while not self.block_manager.can_append(seq) and queue:
                victim = queue.pop()
                self._preempt(victim)
                preempted.append(victim)
            if not self.block_manager.can_append(seq):
                self._preempt(seq)
                preempted.append(seq)
                continue
            self.block_manager.may_append(seq)
            running.append(seq)
            if budget > 0:
                budget -= self._take_chunk(seq, budget, items)
        self.running = running
        if not preempted:  # the pool is short this step: admitting now would only thrash
            self._admit(budget, items)
        return ScheduledBatch(items, preempted)

    def _admit(self, budget: int, items: list[ScheduledSeq]) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.is_finished:  # aborted while waiting
                self.waiting.popleft()
                continue
            if not self.block_manager.can_allocate(seq):
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq)
            if not seq.admitted:
                seq.admitted = True
                seq.num_cached_tokens = seq.num_computed_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            budget -= self._take_chunk(seq, budget, items)

    def _take_chunk(self, seq: Sequence, budget: int, items: list[ScheduledSeq]) -> int:
        count = min(seq.num_tokens - seq.num_computed_tokens, budget)
        start = seq.num_computed_tokens
        items.append(ScheduledSeq(seq, start, count))
        seq.num_computed_tokens += count
        # KV for these tokens is written in this step before any attention reads it, so a
        # request admitted later in the same step may already hit these blocks.
        self.block_manager.commit_computed(seq, seq.num_computed_tokens)
        return count

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free_sequence(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End ``seq`` (done, stopped or aborted) and free its blocks. Safe in any state."""
        if seq.is_finished:
            return
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq.block_table:
            self.block_manager.free_sequence(seq)
        if seq in self.running:
            self.running.remove(seq)
        # a waiting sequence stays in the deque and is dropped lazily by _admit
