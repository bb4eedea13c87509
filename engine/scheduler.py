"""Continuous batching: FCFS, chunked prefill under a token budget, decodes and prefills mixed,
preemption by recompute when the KV pool runs dry."""

from __future__ import annotations

import itertools
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
    a partially prefilled sequence takes the next chunk, less a token for each decode still to
    come (a prefill chunk never stalls a running sequence's decode). Waiting sequences are then
    admitted in arrival order while budget, ``max_num_seqs`` and KV blocks allow. When a running
    sequence needs a block and none is free, the most recently arrived running sequence is
    preempted: its blocks are freed and it re-enters the head of the queue, to be recomputed
    (mostly from the prefix cache) later.

    Short prompts jump a long prefill (``long_prefill_token_threshold``, vLLM's name: a prefill
    with more tokens than that left to compute, its cache hits excluded, is long). Only one long
    prefill runs at a time; while it does, a long waiting sequence stays queued and the short
    ones behind it are admitted: while a short one waits, the long prefill's chunk is at most
    ``threshold`` tokens, which leaves it the rest of the step and makes the step shorter. Plain
    FCFS makes a 40-token prompt, or one almost wholly cached, wait for every chunk of a
    40 k-token prefill ahead of it: about 1.5 s on the H100 profile for a prompt whose own
    prefill takes one step. 0 turns it off (strict FCFS).
    """

    SCAN = 64  # waiting sequences looked at past a queued long one

    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.long_prefill_token_threshold = config.long_prefill_threshold()
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self._uncached_estimates: dict[int, int] = {}  # seq_id -> _uncached(), while waiting
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def num_unfinished(self) -> int:
        return sum(1 for s in self.waiting if not s.is_finished) + len(self.running)

    def schedule(self) -> ScheduledBatch:
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
        self.running = running
        budget = self._run_chunks(items, admitting=not preempted)
        if not preempted:  # the pool is short this step: admitting now would only thrash
            self._admit(budget, items)
        return ScheduledBatch(items, preempted)

    def _run_chunks(self, items: list[ScheduledSeq], admitting: bool) -> int:
        """Give the running sequences this step's tokens; returns the budget left."""
        budget = self.max_num_batched_tokens
        threshold = self.long_prefill_token_threshold
        decodes = sum(1 for seq in self.running if self._left(seq) == 1)
        long_prefill = False
        for seq in self.running:
            left = self._left(seq)
            if left == 1:
                if budget > 0:
                    budget -= self._take_chunk(seq, 1, items)
                decodes -= 1
                continue
            room = budget - decodes  # a token for each decode still to come
            if threshold and left > threshold:
                if long_prefill:  # one long prefill at a time: this one waits its turn
                    continue
                long_prefill = True
                if admitting and self._short_waiting(room - threshold):
                    room = min(room, threshold)  # a shorter step: the short ones' first token
            if room > 0:
                budget -= self._take_chunk(seq, room, items)
        return budget

    def _left(self, seq: Sequence) -> int:
        return seq.num_tokens - seq.num_computed_tokens

    def _uncached(self, seq: Sequence) -> int:
        """Tokens a waiting sequence will compute once admitted (its cache hits excluded), looked
        up once per sequence: the cache changes meanwhile, and an estimate is all it steers."""
        left = self._left(seq)
        if seq.num_computed_tokens or left <= self.long_prefill_token_threshold:
            return left
        if seq.seq_id not in self._uncached_estimates:
            hits = len(self.block_manager.prefix_hits(seq)) * self.block_manager.block_size
            self._uncached_estimates[seq.seq_id] = left - hits
        return self._uncached_estimates[seq.seq_id]

    def _is_long(self, seq: Sequence) -> bool:
        threshold = self.long_prefill_token_threshold
        return bool(threshold) and self._uncached(seq) > threshold

    def _short_waiting(self, room: int) -> bool:
        """Whether a short waiting sequence could be admitted into ``room`` tokens now."""
        if room <= 0 or len(self.running) >= self.max_num_seqs:
            return False
        for seq in itertools.islice(self.waiting, self.SCAN):
            if not seq.is_finished and self._uncached(seq) <= self.long_prefill_token_threshold:
                return True
        return False

    def _admit(self, budget: int, items: list[ScheduledSeq]) -> None:
        # a long prefill still running after this step: a long waiting sequence stays queued, the
        # short ones behind it (up to SCAN) are admitted
        threshold = self.long_prefill_token_threshold
        long_running = bool(threshold) and any(self._left(s) > threshold for s in self.running)
        index = skipped = 0
        while index < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[index]
            if seq.is_finished:  # aborted while waiting
                del self.waiting[index]
                self._uncached_estimates.pop(seq.seq_id, None)
                continue
            if long_running and self._is_long(seq):
                index, skipped = index + 1, skipped + 1
                if skipped > self.SCAN:
                    break
                continue
            if not self.block_manager.can_allocate(seq):
                break
            del self.waiting[index]
            self._uncached_estimates.pop(seq.seq_id, None)
            self.block_manager.allocate(seq)
            if not seq.admitted:
                seq.admitted = True
                seq.num_cached_tokens = seq.num_computed_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            budget -= self._take_chunk(seq, budget, items)
            long_running = long_running or (bool(threshold) and self._left(seq) > threshold)

    def _take_chunk(self, seq: Sequence, budget: int, items: list[ScheduledSeq]) -> int:
        count = min(self._left(seq), budget)
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
        self._uncached_estimates.pop(seq.seq_id, None)
        if seq.block_table:
            self.block_manager.free_sequence(seq)
        if seq in self.running:
            self.running.remove(seq)
        # a waiting sequence stays in the deque and is dropped lazily by _admit
