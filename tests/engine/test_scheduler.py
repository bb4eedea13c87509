"""Scheduler: FCFS admission, token budget and chunked prefill, max_num_seqs, preemption, aborts in
every state; and, on the tiny model, the engine's abort path, cache statistics and prefill log
lines with exact counts.

The first half drives ``Scheduler`` + ``BlockManager`` alone with a fake model (every sampling
item appends a made-up token), so it needs no weights and can check every step exactly.
"""

from __future__ import annotations

import logging
import random

import pytest

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch, Scheduler
from engine.sequence import Sequence, SequenceStatus

BS = 4


def make_scheduler(num_blocks=64, max_num_seqs=8, budget=16, long_threshold=None) -> Scheduler:
    config = EngineConfig(
        block_size=BS,
        num_kv_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        long_prefill_token_threshold=long_threshold,
    )
    return Scheduler(config, BlockManager(num_blocks, BS))


_next_token = iter(range(10_000, 10**9))


def new_seq(prompt_len: int, max_tokens: int = 3) -> Sequence:
    """A sequence with its own distinct tokens (no accidental prefix hits)."""
    return Sequence(
        [next(_next_token) for _ in range(prompt_len)],
        SamplingParams(max_tokens=max_tokens, temperature=0),
        block_size=BS,
    )


def step(sched: Scheduler) -> ScheduledBatch:
    """One engine step with a fake model; checks the pool's bookkeeping afterwards."""
    batch = sched.schedule()
    assert batch.num_tokens <= sched.max_num_batched_tokens
    assert len(sched.running) <= sched.max_num_seqs
    for item in batch.items:
        if item.samples:
            seq = item.seq
            seq.append_token(seq.num_output_tokens)  # output i is token i: easy to check later
            if seq.num_output_tokens >= seq.params.max_tokens:
                sched.finish(seq, "length")
    sched.block_manager.check_integrity(sched.running)
    return batch


def run_all(sched: Scheduler, limit: int = 1000) -> list[ScheduledBatch]:
    batches = []
    while sched.num_unfinished:
        batches.append(step(sched))
        assert len(batches) < limit, "no progress"
    assert sched.block_manager.usage().used == 0
    return batches


def chunks(batch: ScheduledBatch) -> list[tuple[int, int, int]]:
    return [(item.seq.seq_id, item.start, item.num_tokens) for item in batch.items]


# ----- admission and budgets -------------------------------------------------------------------


def test_fcfs_admission_and_max_num_seqs():
    sched = make_scheduler(max_num_seqs=2)
    seqs = [new_seq(n, max_tokens=2 + i) for i, n in enumerate((5, 3, 7, 2, 6))]
    for s in seqs:
        sched.add(s)
    first_seen: list[int] = []
    for batch in run_all(sched):
        assert len(batch.items) <= 2
        first_seen += [item.seq.seq_id for item in batch.items if item.seq.seq_id not in first_seen]
    assert first_seen == [s.seq_id for s in seqs]
    assert all(
        s.finish_reason == "length" and s.output_token_ids == list(range(s.params.max_tokens))
        for s in seqs
    )


def test_max_num_seqs_caps_running():
    sched = make_scheduler(max_num_seqs=3, budget=64)
    seqs = [new_seq(4, max_tokens=4) for _ in range(10)]
    for s in seqs:
        sched.add(s)
    batch = step(sched)
    assert [item.seq for item in batch.items] == seqs[:3]
    assert list(sched.waiting) == seqs[3:]
    batches = [batch] + run_all(sched)
    assert max(len(b.items) for b in batches) == 3
    assert all(s.is_finished for s in seqs)


def test_token_budget_and_chunked_prefill():
    sched = make_scheduler(budget=8)
    a, b = new_seq(30, max_tokens=2), new_seq(5, max_tokens=2)
    sched.add(a)
    sched.add(b)
    got = [chunks(step(sched)) for _ in range(6)]
    assert got == [
        [(a.seq_id, 0, 8)],  # b is not admitted: the budget is spent
        [(a.seq_id, 8, 8)],
        [(a.seq_id, 16, 8)],
        [(a.seq_id, 24, 6), (b.seq_id, 0, 2)],  # a samples its first token; b gets what is left
        [(a.seq_id, 30, 1), (b.seq_id, 2, 3)],  # running first: a's decode, then b's next chunk
        [(b.seq_id, 5, 1)],  # a finished (2 tokens)
    ]
    assert a.output_token_ids == [0, 1] and b.is_finished and not sched.num_unfinished
    assert sched.block_manager.usage().used == 0


def first_token_step(batches: list[ScheduledBatch], seq: Sequence) -> int:
    """The index of the step in which ``seq`` sampled its first token."""
    return next(
        i
        for i, batch in enumerate(batches)
        for it in batch.items
        if it.seq is seq and it.start + it.num_tokens == seq.num_prompt_tokens
    )


@pytest.mark.parametrize("threshold", [0, 8])
def test_a_short_prompt_jumps_a_long_prefill_unless_the_threshold_is_0(threshold):
    sched = make_scheduler(budget=16, long_threshold=threshold)
    long = new_seq(80, max_tokens=2)
    sched.add(long)
    batches = [step(sched)]
    short = new_seq(3, max_tokens=2)
    sched.add(short)
    batches += run_all(sched)
    if threshold:
        # the next step: the long prefill's chunk shrinks to the threshold, the short one fits
        assert chunks(batches[1]) == [(long.seq_id, 16, 8), (short.seq_id, 0, 3)]
        assert first_token_step(batches, short) == 1
        assert first_token_step(batches, long) == 5  # the short one's 3 + 2 tokens: one more step
    else:  # strict FCFS: the short one waits for the last chunk of the long one
        assert first_token_step(batches, long) == 4 and first_token_step(batches, short) == 5
    assert short.output_token_ids == [0, 1] and long.output_token_ids == [0, 1]


def test_a_long_waiting_prompt_stays_queued_while_short_ones_behind_it_pass():
    sched = make_scheduler(budget=16, long_threshold=8)
    a, b, c = new_seq(64, max_tokens=1), new_seq(40, max_tokens=1), new_seq(5, max_tokens=1)
    for s in (a, b, c):
        sched.add(s)
    batches = run_all(sched)
    assert chunks(batches[0]) == [(a.seq_id, 0, 16)]  # b (long) is not admitted beside a
    assert chunks(batches[1]) == [(a.seq_id, 16, 8), (c.seq_id, 0, 5)]  # c passes b
    # b starts only in the step where a's prefill ends, with the budget a leaves
    b_start = next(i for i, batch in enumerate(batches) for it in batch.items if it.seq is b)
    a_end = first_token_step(batches, a)
    assert b_start == a_end and first_token_step(batches, c) == 1
    assert all(s.finish_reason == "length" for s in (a, b, c))


def test_a_prompt_almost_wholly_cached_counts_as_short():
    sched = make_scheduler(budget=16, long_threshold=8)
    head = [next(_next_token) for _ in range(40)]
    warm = Sequence(head + [1], SamplingParams(max_tokens=1, temperature=0), block_size=BS)
    sched.add(warm)
    run_all(sched)  # head is in the prefix cache now
    long = new_seq(80, max_tokens=1)
    sched.add(long)
    batches = [step(sched)]
    cached = Sequence(head + [2, 3], SamplingParams(max_tokens=1, temperature=0), block_size=BS)
    sched.add(cached)  # 42 tokens, 40 of them cached: 2 to compute
    batches += run_all(sched)
    assert chunks(batches[1]) == [(long.seq_id, 16, 8), (cached.seq_id, 40, 2)]
    assert cached.num_cached_tokens == 40 and first_token_step(batches, cached) == 1


def test_a_prefill_chunk_leaves_a_token_for_each_running_decode():
    sched = make_scheduler(budget=8, long_threshold=0)
    a = new_seq(4, max_tokens=20)
    sched.add(a)
    step(sched)  # a decodes from now on
    b = new_seq(60, max_tokens=1)
    sched.add(b)
    step(sched)  # b is admitted behind a
    # running order is a, b; then move b ahead of a so its chunk comes first in the loop
    sched.running.reverse()
    batch = step(sched)
    assert sorted(chunks(batch)) == sorted([(b.seq_id, 7, 7), (a.seq_id, 5, 1)])
    run_all(sched)


def test_the_threshold_defaults_to_half_the_budget_and_must_not_be_negative():
    assert EngineConfig(max_num_batched_tokens=512).long_prefill_threshold() == 256
    assert EngineConfig(long_prefill_token_threshold=0).long_prefill_threshold() == 0
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        EngineConfig(long_prefill_token_threshold=-1)
    import argparse

    from engine.server import main

    parser = argparse.ArgumentParser()
    main.add_arguments(parser)
    args = parser.parse_args(["--device", "cpu", "--long-prefill-token-threshold", "0"])
    assert main.engine_config(args, "tiny").long_prefill_threshold() == 0
    # a GPU profile models vLLM's default (off); the one fitted to our engine, ours (half of 512)
    args = parser.parse_args(["--simulate", "h100-llama3.1-8b"])
    assert main.engine_config(args, "tiny").long_prefill_threshold() == 0
    args = parser.parse_args(["--simulate", "h100-llama3.1-8b", "--long-prefill-token-threshold=8"])
    assert main.engine_config(args, "tiny").long_prefill_threshold() == 8
    args = parser.parse_args(["--simulate", "cpu-tiny"])
    assert main.engine_config(args, "tiny").long_prefill_threshold() == 256


def test_budget_is_never_exceeded_with_many_requests():
    rng = random.Random(5)
    sched = make_scheduler(num_blocks=128, max_num_seqs=6, budget=12)
    seqs = [new_seq(rng.randrange(1, 40), max_tokens=rng.randrange(1, 8)) for _ in range(25)]
    for s in seqs:
        sched.add(s)
    batches = run_all(sched)  # step() asserts the budget and max_num_seqs every step
    assert all(0 < b.num_tokens <= 12 for b in batches)
    assert all(s.num_output_tokens == s.params.max_tokens for s in seqs)
    # every prompt token was computed exactly once (no preemption in a pool this large)
    assert sum(b.num_tokens for b in batches) == sum(s.num_tokens - 1 for s in seqs)


# ----- preemption ---------------------------------------------------------------------------------


def test_preemption_when_blocks_run_out_and_all_finish():
    sched = make_scheduler(num_blocks=8, budget=16)
    seqs = [
        new_seq(6, max_tokens=10) for _ in range(3)
    ]  # each ends at 16 tokens = 4 blocks; 12 > 8
    for s in seqs:
        sched.add(s)
    batches = run_all(sched)
    assert sched.num_preemptions > 0
    preempted = [s for b in batches for s in b.preempted]
    assert preempted and preempted[0] is seqs[2]  # the most recently arrived goes first
    # preemption keeps what was generated: every sequence still produced outputs 0..9 in order
    assert all(s.output_token_ids == list(range(10)) and s.finish_reason == "length" for s in seqs)
    assert sched.block_manager.usage().used == 0


def test_preemption_picks_the_latest_running_sequence_which_resumes_from_cache():
    sched = make_scheduler(num_blocks=4, budget=16)
    a, b = new_seq(8, max_tokens=2), new_seq(8, max_tokens=3)
    sched.add(a)
    sched.add(b)
    assert chunks(step(sched)) == [(a.seq_id, 0, 8), (b.seq_id, 0, 8)]  # the pool is now full
    head, tail = b.block_table
    batch = step(sched)  # a needs a third block: b is preempted, its tail block goes to a
    assert batch.preempted == [b]
    assert chunks(batch) == [(a.seq_id, 8, 1)]
    assert a.is_finished  # (and freed: its tail block was b's, now without a digest)
    assert (
        sched.block_manager.blocks[tail].digest is None
        and sched.block_manager.blocks[head].digest is not None
    )
    assert b.status is SequenceStatus.WAITING and b.block_table == [] and b.num_preemptions == 1
    assert list(sched.waiting) == [b] and b.output_token_ids == [0]
    # b comes back with its prompt and its one output token; its head block is still cached
    assert chunks(step(sched)) == [(b.seq_id, 4, 5)]
    assert b.block_table[0] == head and b.num_cached_tokens == 0  # stats count first admission only
    run_all(sched)
    assert a.output_token_ids == [0, 1] and b.output_token_ids == [0, 1, 2]
    assert a.num_preemptions == 0 and sched.num_preemptions == 1


# ----- aborts -------------------------------------------------------------------------------------


@pytest.mark.parametrize("when", ["waiting", "mid_prefill", "decoding", "preempted"])
def test_abort_in_any_state_frees_blocks(when):
    sched = make_scheduler(num_blocks=16, max_num_seqs=2, budget=8)
    victim = new_seq(20 if when == "mid_prefill" else 4, max_tokens=50)
    others = [new_seq(6, max_tokens=4) for _ in range(3)]
    if when == "waiting":
        for s in others[:2] + [victim] + others[2:]:
            sched.add(s)  # max_num_seqs=2: the victim waits behind two running requests
        step(sched)
        assert victim.status is SequenceStatus.WAITING
    else:
        for s in [victim] + others:
            sched.add(s)
        step(sched)
        if when == "mid_prefill":
            assert 0 < victim.num_computed_tokens < victim.num_prompt_tokens
        else:
            while victim.num_output_tokens < 3:
                step(sched)
            if when == "preempted":
                sched._preempt(victim)
                sched.running.remove(victim)
                assert victim.block_table == [] and victim in sched.waiting
    held = len(victim.block_table)
    used = sched.block_manager.usage().used
    sched.finish(victim, "abort")
    assert victim.is_finished and victim.finish_reason == "abort" and victim.block_table == []
    assert sched.block_manager.usage().used == used - held
    sched.finish(victim, "abort")  # a second abort is a no-op
    run_all(sched)
    assert all(s.finish_reason == "length" and s.output_token_ids == [0, 1, 2, 3] for s in others)
    assert victim not in sched.running and victim not in sched.waiting
    assert sched.block_manager.usage().used == 0


# ----- the engine on the tiny model ---------------------------------------------------------------


def tiny_engine(**kw) -> LLMEngine:
    kw = {
        "block_size": BS,
        "num_kv_blocks": 128,
        "max_num_batched_tokens": 16,
        "max_num_seqs": 4,
        **kw,
    }
    return LLMEngine(EngineConfig(model="tiny", **kw))


def random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(8, 4000) for _ in range(n)]


def test_engine_abort_waiting_mid_prefill_and_decoding():
    engine = tiny_engine(num_kv_blocks=64, max_num_seqs=2)
    rng = random.Random(7)
    keep_going = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    engine.add_request("decoding", random_ids(rng, 5), keep_going)
    long = engine.add_request(
        "long", random_ids(rng, 60), SamplingParams(max_tokens=5, temperature=0)
    )
    waiting = engine.add_request("waiting", random_ids(rng, 10), keep_going)
    engine.add_request(
        "other", random_ids(rng, 7), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    )
    engine.step()
    engine.step()
    assert 0 < long.num_computed_tokens < long.num_prompt_tokens  # chunked prefill in progress
    assert waiting.block_table == [] and not waiting.admitted
    assert engine.abort_request("waiting") and engine.abort_request("long")
    assert engine.block_manager.usage().used == 2  # "decoding": 7 tokens in two blocks
    finished: dict[str, str] = {}
    seen: set[str] = set()
    decoded = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.add(out.request_id)
            if out.request_id == "decoding":
                decoded += 1
                if decoded == 3:
                    assert engine.abort_request("decoding")
            if out.finished:
                finished[out.request_id] = out.finish_reason
    assert finished == {"other": "length"}
    assert seen == {"decoding", "other"}
    assert not engine.abort_request("decoding") and not engine.abort_request("nope")
    assert engine.block_manager.usage().used == 0
    engine.block_manager.check_integrity([])


def test_engine_preemption_everything_finishes():
    engine = tiny_engine(num_kv_blocks=12, max_num_batched_tokens=32)
    rng = random.Random(8)
    outs = engine.generate(
        [random_ids(rng, 10) for _ in range(4)],
        SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
    )
    assert engine.scheduler.num_preemptions > 0
    assert [(len(o["token_ids"]), o["finish_reason"]) for o in outs] == [(20, "length")] * 4
    assert engine.block_manager.usage().used == 0


def engine_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "engine"]


def test_cache_stats_lines_with_exact_counts(caplog):
    caplog.set_level(logging.INFO, logger="engine")
    engine = tiny_engine(stats_interval=2)
    rng = random.Random(9)
    p1 = random_ids(rng, 20)
    prompts = [p1, p1[:16] + random_ids(rng, 4), random_ids(rng, 20), p1[:12] + random_ids(rng, 8)]
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    cached = [
        engine.generate([p], params)[0]["num_cached_tokens"] for p in prompts
    ]  # one at a time
    assert cached == [0, 16, 0, 12]
    stats = [line for line in engine_lines(caplog) if line.startswith("[Cache Stats")]
    assert stats == [
        "[Cache Stats Interval] Reqs: 2, Cached/Total tokens: 16/40, Hit rate: 40.00%",
        "[Cache Stats         ] Reqs: 2, Cached/Total tokens: 16/40, Hit rate: 40.00%",
        "[Cache Stats Interval] Reqs: 2, Cached/Total tokens: 12/40, Hit rate: 30.00%",
        "[Cache Stats         ] Reqs: 4, Cached/Total tokens: 28/80, Hit rate: 35.00%",
    ]
    assert (engine.cache_stats.total.requests, engine.cache_stats.window.requests) == (4, 0)


def test_cache_stats_count_a_request_once_despite_chunks_and_preemption(caplog):
    caplog.set_level(logging.INFO, logger="engine")
    engine = tiny_engine(num_kv_blocks=12, max_num_batched_tokens=8, stats_interval=4)
    rng = random.Random(10)
    engine.generate(
        [random_ids(rng, 10) for _ in range(4)],
        SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
    )
    assert engine.scheduler.num_preemptions > 0
    stats = [line for line in engine_lines(caplog) if line.startswith("[Cache Stats")]
    assert stats == [
        "[Cache Stats Interval] Reqs: 4, Cached/Total tokens: 0/40, Hit rate: 0.00%",
        "[Cache Stats         ] Reqs: 4, Cached/Total tokens: 0/40, Hit rate: 0.00%",
    ]


def test_scheduled_prefill_batch_lines(caplog):
    caplog.set_level(logging.INFO, logger="engine")
    engine = tiny_engine()
    rng = random.Random(11)
    p1 = random_ids(rng, 20)
    params = SamplingParams(max_tokens=1, temperature=0)
    first = engine.add_request("p1", p1, params)
    while engine.has_unfinished_requests():
        engine.step()
    caplog.clear()
    hit = engine.add_request("hit", p1 + random_ids(rng, 3), params)  # 23 tokens: 5 blocks hit
    fresh = engine.add_request("fresh", random_ids(rng, 10), params)
    engine.step()
    long_ids = random_ids(rng, 40)
    long = engine.add_request("long", long_ids, params)
    while engine.has_unfinished_requests():
        engine.step()
    assert [line for line in engine_lines(caplog) if line.startswith("Scheduled")] == [
        f"Scheduled prefill batch: 2 reqs, 13 new tokens (cached: [20, 0], new: [3, 10]), "
        f"req_ids: ({hit.seq_id}, {fresh.seq_id})",
        # chunked under the 16-token budget: "cached" is the prefix-cache hit, so the continuation
        # chunks (whose earlier tokens were computed in earlier steps, not found cached) show 0
        f"Scheduled prefill batch: 1 reqs, 16 new tokens (cached: [0], new: [16]), "
        f"req_ids: ({long.seq_id},)",
        f"Scheduled prefill batch: 1 reqs, 16 new tokens (cached: [0], new: [16]), "
        f"req_ids: ({long.seq_id},)",
        f"Scheduled prefill batch: 1 reqs, 8 new tokens (cached: [0], new: [8]), "
        f"req_ids: ({long.seq_id},)",
    ]
    assert first.num_cached_tokens == 0 and hit.num_cached_tokens == 20
    caplog.clear()
    again = engine.add_request(
        "again", long_ids[:32] + random_ids(rng, 20), params
    )  # 2 blocks hit, then 20 new
    while engine.has_unfinished_requests():
        engine.step()
    assert [line for line in engine_lines(caplog) if line.startswith("Scheduled")] == [
        f"Scheduled prefill batch: 1 reqs, 16 new tokens (cached: [32], new: [16]), "
        f"req_ids: ({again.seq_id},)",
        f"Scheduled prefill batch: 1 reqs, 4 new tokens (cached: [0], new: [4]), "
        f"req_ids: ({again.seq_id},)",
    ]


def test_log_prefix_names_the_rank(caplog):
    caplog.set_level(logging.INFO, logger="engine")
    engine = LLMEngine(
        EngineConfig(model="tiny", block_size=BS, num_kv_blocks=32), log_prefix="[DP3]"
    )
    seq = engine.add_request("r", [11, 12, 13], SamplingParams(max_tokens=1, temperature=0))
    engine.step()
    assert (
        f"[DP3] Scheduled prefill batch: 1 reqs, 3 new tokens (cached: [0], new: [3]), "
        f"req_ids: ({seq.seq_id},)" in engine_lines(caplog)
    )
