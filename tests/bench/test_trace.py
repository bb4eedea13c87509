"""Mooncake trace replay (bench/trace.py): the prompt builder (fixed blocks per hash id, shared
prefixes exactly as the trace says, scaled lengths, limits), the open-loop schedule, the oracle on
a hand-written trace, and one replay against the real tiny engine."""

import json
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

from bench import datasets, trace
from bench.cli import build_parser, run
from bench.oracle import oracle_cached, sample_oracle
from bench.report import format_report
from bench.runner import RunOptions, send_samples
from harness.procs import REPO_ROOT, metrics, start_engine

SHARED_TRACE = REPO_ROOT / "bench" / "traces" / "mooncake_synthetic_trace.jsonl"
ALLOWED = datasets.allowed_token_ids(4096)

# Hand-written: r1 shares r0's first two blocks, r2 shares r0's first one and then differs, r3 is
# r0 again cut inside its third block (a prefix of block 2), r4 shares nothing.
HAND = [
    {"timestamp": 0, "input_length": 1500, "output_length": 3, "hash_ids": [0, 1, 2]},
    {"timestamp": 100, "input_length": 1100, "output_length": 4, "hash_ids": [0, 1, 3]},
    {"timestamp": 250, "input_length": 1024, "output_length": 5, "hash_ids": [0, 4]},
    {"timestamp": 250, "input_length": 1200, "output_length": 6, "hash_ids": [0, 1, 2]},
    {"timestamp": 900, "input_length": 300, "output_length": 7, "hash_ids": [5]},
]


@pytest.fixture
def hand_trace(tmp_path):
    path = tmp_path / "hand.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in HAND) + "\n")
    return path


def _build(path, n=16, seed=0, limit=None, **kw):
    return trace.build(
        trace.read_trace(path, limit), allowed=ALLOWED, seed=seed, block_tokens_=n, **kw
    )


def _common_prefix(a, b) -> int:
    m = min(len(a), len(b))
    diff = np.nonzero(np.asarray(a[:m]) != np.asarray(b[:m]))[0]
    return int(diff[0]) if len(diff) else m


# ----- the builder -------------------------------------------------------------------------------
def test_hand_trace_shares_exactly_the_prefixes_it_says(hand_trace):
    work = _build(hand_trace, n=16)
    p = [s.prompt for s in work.samples]
    # scaled lengths: ceil(L * 16 / 512)
    assert [s.prompt_len for s in work.samples] == [47, 35, 32, 38, 10]
    assert [len(x) for x in p] == [47, 35, 32, 38, 10]
    assert [s.output_len for s in work.samples] == [3, 4, 5, 6, 7]
    assert [s.timestamp_ms for s in work.samples] == [0, 100, 250, 250, 900]
    assert _common_prefix(p[0], p[1]) == 32  # two shared ids, then 2 vs 3
    assert _common_prefix(p[0], p[2]) == 16  # one shared id, then 1 vs 4
    assert p[3].tolist() == p[0][:38].tolist()  # the same ids: a prefix of the longer prompt
    assert _common_prefix(p[0], p[4]) == 0
    assert p[0].dtype == np.int32 and set(np.concatenate(p).tolist()) <= set(ALLOWED)
    assert (work.window, work.skipped, work.clipped) == (5, 0, 0)


def test_same_id_same_tokens_across_builds_and_block_sizes(hand_trace):
    a = trace.TraceBuilder(ALLOWED, seed=3, block_tokens_=16)
    b = trace.TraceBuilder(ALLOWED, seed=3, block_tokens_=512)
    assert a.block(7).tolist() == trace.TraceBuilder(ALLOWED, 3, 16).block(7).tolist()
    assert b.block(7)[:16].tolist() == a.block(7).tolist()  # a smaller block is a prefix
    assert a.block(7).tolist() != a.block(8).tolist()
    assert a.block(7).tolist() != trace.TraceBuilder(ALLOWED, 4, 16).block(7).tolist()
    one, two = _build(hand_trace, seed=1), _build(hand_trace, seed=1)
    assert [s.prompt.tolist() for s in one.samples] == [s.prompt.tolist() for s in two.samples]
    other = _build(hand_trace, seed=2)
    assert one.samples[0].prompt.tolist() != other.samples[0].prompt.tolist()


def test_blocks_are_the_same_in_another_process():
    code = (
        "from bench import trace, datasets;"
        "print(trace.block_tokens(12345, 8, 9, __import__('numpy').asarray("
        "datasets.allowed_token_ids(4096), dtype='int32')).tolist())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "123", "PATH": "/usr/bin:/bin"},
    ).stdout
    here = trace.block_tokens(12345, 8, 9, np.asarray(ALLOWED, dtype=np.int32)).tolist()
    assert json.loads(out) == here


def test_shared_trace_prefixes_and_lengths():
    records = trace.read_trace(SHARED_TRACE, 300)
    assert len(records) == 300 and records[0].timestamp_ms == 0
    for n in (16, 512):
        work = trace.build(records, allowed=ALLOWED, seed=0, block_tokens_=n)
        assert len(work.samples) == 300
        for rec, s in zip(records, work.samples, strict=True):
            assert len(s.prompt) == s.prompt_len == max(1, -(-rec.input_length * n // 512))
        # every pair sharing k leading ids (k < both lengths' blocks) shares exactly k * n tokens
        checked = 0
        for i in range(len(records)):
            for j in range(i):
                a, b = records[i].hash_ids, records[j].hash_ids
                k = 0
                while k < min(len(a), len(b)) and a[k] == b[k]:
                    k += 1
                pa, pb = work.samples[i].prompt, work.samples[j].prompt
                if k and k * n < min(len(pa), len(pb)):
                    assert _common_prefix(pa, pb) == k * n, (i, j, k)
                    checked += 1
        assert checked > 0


def test_limits_skip_or_clip(hand_trace):
    skip = _build(hand_trace, n=16, max_input_len=36)
    assert [s.group for s in skip.samples] == [1, 2, 4]  # the trace records kept
    assert (skip.skipped, skip.clipped, skip.limit) == (2, 0, 36)
    clip = _build(hand_trace, n=16, max_input_len=36, overlong="clip")
    full = _build(hand_trace, n=16)
    assert [s.prompt_len for s in clip.samples] == [36, 35, 32, 36, 10]
    assert clip.samples[0].prompt.tolist() == full.samples[0].prompt[:36].tolist()
    assert (clip.skipped, clip.clipped) == (0, 2)
    # prompt + output within max_model_len; an output that fills it is cut too
    ctx = _build(hand_trace, n=16, max_model_len=40, overlong="clip")
    assert all(s.prompt_len + s.output_len <= 40 for s in ctx.samples)
    assert [s.prompt_len for s in ctx.samples] == [37, 35, 32, 34, 10]
    tiny = _build(hand_trace, n=16, max_model_len=5, overlong="clip")
    assert all(s.prompt_len >= 1 and s.prompt_len + s.output_len <= 5 for s in tiny.samples)
    assert len(_build(hand_trace, n=16, max_model_len=40).samples) == 3
    short = _build(hand_trace, n=16, max_output_len=5, max_model_len=40)
    assert [s.group for s in short.samples] == [1, 2, 4]  # r0, r3: prompt + output over 40
    assert [s.output_len for s in short.samples] == [4, 5, 5]


def test_bad_records_are_refused(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 1100, "output_length": 1, "hash_ids": [1]}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        trace.read_trace(path)
    path.write_text('{"timestamp": 0}\n')
    with pytest.raises(ValueError, match="not a Mooncake"):
        trace.read_trace(path)


# ----- timing ------------------------------------------------------------------------------------
def test_send_offsets_follow_the_timestamps():
    assert trace.send_offsets([1000, 1000, 1500, 4000], 2.0) == [0.0, 0.0, 0.25, 1.5]
    assert trace.send_offsets([0, 100], 0.5) == pytest.approx([0.0, 0.2])  # slowed down
    assert trace.send_offsets([], 3.0) == []
    with pytest.raises(ValueError):
        trace.send_offsets([0], 0)


def _fake(request):
    usage = {"prompt_tokens": 1, "completion_tokens": 1}
    body = b'data: {"choices": [{"text": "x"}]}\n\ndata: ' + json.dumps({"usage": usage}).encode()
    return httpx.Response(200, content=body + b"\n\ndata: [DONE]\n\n")


async def test_speedup_sends_on_the_trace_times_open_loop(hand_trace):
    samples = _build(hand_trace).samples  # times 0, 100, 250, 250, 900 ms
    opts = RunOptions(
        base_url="http://fake",
        model="m",
        progress=False,
        speedup=2.0,
        transport=httpx.MockTransport(_fake),
    )
    t0 = time.perf_counter()
    result = await send_samples(opts, samples)
    starts = sorted(r.start - t0 for r in result.results)
    assert [r.meta["index"] for r in result.results] == [0, 1, 2, 3, 4]
    want = [0.0, 0.05, 0.125, 0.125, 0.45]
    for got, expect in zip(starts, want, strict=True):
        assert expect - 0.005 <= got <= expect + 0.5  # never early; late only by scheduling
    assert starts[-1] - starts[0] >= 0.44
    # without speedup: trace order, all at once (a cap of 2 lets at most 2 run together)
    fast = await send_samples(
        RunOptions(
            base_url="http://fake", model="m", progress=False, transport=httpx.MockTransport(_fake)
        ),
        samples,
    )
    assert [r.meta["index"] for r in fast.results] == [0, 1, 2, 3, 4]
    assert fast.results[-1].start - fast.results[0].start < 0.4


# ----- the oracle --------------------------------------------------------------------------------
def test_oracle_on_the_hand_trace(hand_trace):
    p = [s.prompt for s in _build(hand_trace, n=16).samples]
    # r1: 2 shared blocks; r2: 1 (then a new id); r3: 38 tokens, all of r0's, 2 full usable blocks
    # ((38 - 1) // 16); r4: nothing
    assert oracle_cached(p, 16) == [0, 32, 16, 32, 0]
    assert oracle_cached(p, 8) == [0, 32, 16, 32, 0]
    assert oracle_cached(p, 32) == [0, 32, 0, 32, 0]
    full = [s.prompt for s in _build(hand_trace, n=512).samples]
    assert oracle_cached(full, 512) == [0, 1024, 512, 1024, 0]
    assert oracle_cached(full, 16) == [0, 1024, 512, 1184, 0]  # (1200 - 1) // 16 blocks of r0

    results = [
        datasets_result(i, ok=i != 1)
        for i in (0, 1, 2, 3, 4)  # r1 failed: it left nothing in any cache
    ]
    samples = _build(hand_trace, n=16).samples
    o = sample_oracle(results, samples, 16)
    assert (o["requests"], o["cached_tokens"], o["prompt_tokens"]) == (
        4,
        16 + 32,
        47 + 32 + 38 + 10,
    )


def datasets_result(index, ok=True):
    from bench.client import RequestResult

    return RequestResult(ok=ok, meta={"index": index})


def test_oracle_command_prints_the_trace_oracle(hand_trace, capsys):
    assert trace.main(["--trace-path", str(hand_trace), "--trace-block-tokens", "16"]) == 0
    out = capsys.readouterr().out
    assert "5 records" in out and "oracle block 16: cached 80 of 162" in out


# ----- against the simulated engine --------------------------------------------------------------
@pytest.mark.slow
def test_replay_the_shared_trace_at_full_size_on_the_simulated_engine(tmp_path):
    """The trace's first 50 records at full size (512 tokens a hash id, prompts up to 40 k
    tokens: the simulated H100 engine takes them; the first prefix the trace shares is record
    49's, 57 blocks of record 42), outputs cut to 4 tokens; the engine's counters agree with the
    client's and with the oracle."""
    records = trace.read_trace(SHARED_TRACE, 50)
    engine_args = ("--simulate", "h100-llama3.1-8b", "--num-kv-blocks", "60000")
    with start_engine(tmp_path, *engine_args) as engine:
        before = metrics(engine.url)
        args = build_parser().parse_args(
            [
                "--base-url",
                engine.url,
                "--dataset-name",
                "mooncake_trace",
                "--trace-path",
                str(SHARED_TRACE),
                "--trace-max-output-len",
                "4",
                "--num-prompts",
                "50",
                "--max-concurrency",
                "4",
                "--engine-metrics-url",
                engine.url,
                "--disable-tqdm",
            ]
        )
        report = run(args)
        after = metrics(engine.url)
    s, o, t = report["summary"], report["oracle"], report["trace"]
    assert (t["records"], t["sent"], t["skipped"]) == (50, 50, 0)  # all fit in 128 k tokens
    assert s["completed"] == 50 and s["failed"] == 0
    assert s["total_input_tokens"] == sum(r.input_length for r in records)
    assert s["total_output_tokens"] == sum(min(r.output_length, 4) for r in records)
    engine_cached = after[("cached_tokens", 0)] - before.get(("cached_tokens", 0), 0)
    assert engine_cached > 0 and s["cached_tokens"] == engine_cached
    assert s["per_rank"]["ranks"]["0"]["cached_tokens"] == engine_cached
    assert o["block_size"] == 16 and o["cached_tokens"] == 57 * 512  # the oracle's own count
    assert engine_cached == o["cached_tokens"]  # one engine, a big pool: it gets the oracle
    text = format_report(report)
    assert "Hit rate" in text and "Oracle hit rate" in text and "Trace replay" in text
