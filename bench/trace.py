"""Production-trace replay: the Mooncake trace format (``bench/traces/README.md``).

One JSON object a line: ``timestamp`` (ms from the start), ``input_length``, ``output_length`` and
``hash_ids``, one per 512-token block, equal ids meaning the same prefix up to that block. There
is no text: each hash id becomes a fixed block of token ids, a pure function of the id and the
seed (a splitmix64 hash of ``(seed, id, position)`` picking from the allowed ids), so the same id
gives the same tokens in every build, process and run. A prompt is its ids' blocks concatenated,
cut to ``input_length``; the last block may be partial (a prefix of that id's block), so requests
share exactly the prefixes the trace says.

``--trace-block-tokens N`` scales the trace for small-context engines: each block becomes N tokens
(the first N of the id's block) and ``input_length`` becomes ``ceil(input_length * N / 512)``, at
least 1. Output lengths are kept.

``python -m bench.trace --trace-path FILE`` prints the oracle hit rate of a trace window without
any server (the same builder the replay sends).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.datasets import SampleRequest, allowed_token_ids

TRACE_BLOCK = 512  # tokens per hash id in the Mooncake format
OVERLONG = ("skip", "clip")

_M64 = (1 << 64) - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_C1 = np.uint64(0xBF58476D1CE4E5B9)
_C2 = np.uint64(0x94D049BB133111EB)


@dataclass
class TraceRecord:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: list[int]


def read_trace(path: str | Path, limit: int | None = None) -> list[TraceRecord]:
    """The first ``limit`` records (all when None), in file order; blank lines are skipped."""
    records = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(records) >= limit:
                break
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                rec = TraceRecord(
                    float(d.get("timestamp", 0)),
                    int(d["input_length"]),
                    int(d["output_length"]),
                    [int(h) for h in d["hash_ids"]],
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: not a Mooncake trace record ({exc})") from exc
            if rec.input_length > len(rec.hash_ids) * TRACE_BLOCK:
                raise ValueError(
                    f"{path}:{lineno}: input_length {rec.input_length} needs more than its "
                    f"{len(rec.hash_ids)} hash ids of {TRACE_BLOCK} tokens"
                )
            records.append(rec)
    return records


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on uint64 arrays (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * _C1
    x = (x ^ (x >> np.uint64(27))) * _C2
    return x ^ (x >> np.uint64(31))


def block_tokens(hash_id: int, n: int, seed: int, allowed: np.ndarray) -> np.ndarray:
    """The first ``n`` tokens of hash id ``hash_id``'s block (int32): token j depends only on
    ``(seed, hash_id, j)``, so a shorter block is a prefix of a longer one."""
    key = _mix(np.array([seed & _M64], dtype=np.uint64) + _GOLDEN)
    key = _mix(key ^ np.array([hash_id & _M64], dtype=np.uint64))
    positions = np.arange(1, n + 1, dtype=np.uint64)
    picks = _mix(key + positions * _GOLDEN) % np.uint64(len(allowed))
    return allowed[picks.astype(np.int64)]


def scaled_length(input_length: int, block_tokens_: int) -> int:
    """``input_length`` at ``block_tokens_`` tokens a hash id: rounded up, at least 1."""
    return max(1, -(-input_length * block_tokens_ // TRACE_BLOCK))


class TraceBuilder:
    """Prompts from hash ids, each id's block made once and reused."""

    def __init__(self, allowed, seed: int = 0, block_tokens_: int = TRACE_BLOCK):
        if block_tokens_ < 1:
            raise ValueError("--trace-block-tokens must be at least 1")
        self.allowed = np.asarray(allowed, dtype=np.int32)
        if not len(self.allowed):
            raise ValueError("no allowed token ids")
        self.seed = seed
        self.n = block_tokens_
        self._blocks: dict[int, np.ndarray] = {}

    def block(self, hash_id: int) -> np.ndarray:
        b = self._blocks.get(hash_id)
        if b is None:
            b = self._blocks[hash_id] = block_tokens(hash_id, self.n, self.seed, self.allowed)
        return b

    def prompt(self, hash_ids: list[int], length: int) -> np.ndarray:
        """The blocks of ``hash_ids`` concatenated and cut to ``length`` tokens."""
        need = math.ceil(length / self.n)
        if need > len(hash_ids):
            raise ValueError(
                f"{length} tokens need {need} hash ids, the record has {len(hash_ids)}"
            )
        return np.concatenate([self.block(h) for h in hash_ids[:need]])[:length]


@dataclass
class TraceWorkload:
    """The requests to send (trace order) and what happened to the rest of the window."""

    samples: list[SampleRequest]
    window: int  # records read (--num-prompts)
    skipped: int
    clipped: int
    block_tokens: int
    limit: int | None  # the input limit applied (None: none)


def build(
    records: list[TraceRecord],
    *,
    allowed,
    seed: int = 0,
    block_tokens_: int = TRACE_BLOCK,
    max_input_len: int | None = None,
    max_model_len: int | None = None,
    overlong: str = "skip",
    max_output_len: int | None = None,
) -> TraceWorkload:
    """Samples for ``records``. A request is overlong when its scaled prompt exceeds
    ``max_input_len`` or its prompt + output exceed ``max_model_len``; ``skip`` drops it, ``clip``
    cuts the prompt to fit (still a prefix of the full one) and, when the output alone leaves no
    room, the output to ``max_model_len - 1``. ``max_output_len`` cuts every longer output first
    (a cheap replay on a slow engine: the prompts, hence the cache hits, stay as the trace's)."""
    if overlong not in OVERLONG:
        raise ValueError(f"overlong policy must be one of {OVERLONG}")
    builder = TraceBuilder(allowed, seed, block_tokens_)
    samples, skipped, clipped = [], 0, 0
    for i, rec in enumerate(records):
        length, output = scaled_length(rec.input_length, block_tokens_), rec.output_length
        if max_output_len is not None:
            output = max(1, min(output, max_output_len))
        limit = max_input_len if max_input_len is not None else length
        if max_model_len is not None:
            limit = min(limit, max_model_len - output)
        if length > limit:
            if overlong == "skip":
                skipped += 1
                continue
            clipped += 1
            if limit < 1:
                output = max(1, max_model_len - 1)
            length = max(1, limit)
        ids = builder.prompt(rec.hash_ids, length)
        samples.append(SampleRequest(ids, length, output, group=i, timestamp_ms=rec.timestamp_ms))
    return TraceWorkload(samples, len(records), skipped, clipped, block_tokens_, max_input_len)


def send_offsets(timestamps_ms: list[float], speedup: float) -> list[float]:
    """Seconds after the run starts at which each request goes out: the trace's times relative to
    its first request, divided by ``speedup``."""
    if speedup <= 0:
        raise ValueError("--speedup must be positive")
    if not timestamps_ms:
        return []
    t0 = timestamps_ms[0]
    return [max(0.0, (t - t0) / 1000.0 / speedup) for t in timestamps_ms]


# ----- flags -----------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "mooncake_trace",
        "replay a Mooncake-format trace (--num-prompts: its first N records; default all)",
    )
    group.add_argument("--trace-path", default=None, metavar="FILE", help="the trace (JSONL)")
    group.add_argument(
        "--trace-block-tokens",
        type=int,
        default=TRACE_BLOCK,
        metavar="N",
        help="tokens per hash id (default 512, the trace's own size); input lengths scale by "
        "N/512 (rounded up, at least 1), output lengths stay",
    )
    group.add_argument(
        "--trace-max-input-len",
        type=int,
        default=None,
        metavar="N",
        help="longest prompt to send (after scaling); default no limit other than the target's "
        "max_model_len (from /server_info), which also bounds prompt + output",
    )
    group.add_argument(
        "--trace-overlong",
        choices=OVERLONG,
        default="skip",
        help="a request over a limit: skip it (default; counted in the report) or clip its prompt "
        "to fit (a prefix of the full one, so the shared prefixes survive up to the cut)",
    )
    group.add_argument(
        "--trace-max-output-len",
        type=int,
        default=None,
        metavar="N",
        help="cut longer outputs to N tokens (default: as the trace says); prompts stay",
    )
    group.add_argument(
        "--speedup",
        type=float,
        default=None,
        metavar="X",
        help="open loop on the trace's timestamps divided by X (each request goes out at its time, "
        "whatever is still running; --max-concurrency, when given, still caps requests in "
        "flight; not with --request-rate). Without it: trace order, as fast as "
        "--max-concurrency (or --request-rate) allows",
    )


def build_from_args(args, allowed, max_model_len: int | None = None) -> TraceWorkload:
    if not args.trace_path:
        raise SystemExit("bench: --dataset-name mooncake_trace needs --trace-path FILE")
    records = read_trace(args.trace_path, args.num_prompts)
    return build(
        records,
        allowed=allowed,
        seed=args.seed,
        block_tokens_=args.trace_block_tokens,
        max_input_len=args.trace_max_input_len,
        max_model_len=max_model_len,
        overlong=args.trace_overlong,
        max_output_len=args.trace_max_output_len,
    )


# ----- the oracle of a trace window, offline ------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    from bench.oracle import oracle_cached

    parser = argparse.ArgumentParser(
        prog="python -m bench.trace",
        description="oracle hit rate (one unbounded prefix cache, trace order) of a trace window",
    )
    add_arguments(parser)
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--block-size", type=int, nargs="+", default=[16], help="oracle blocks")
    args = parser.parse_args(argv)
    work = build_from_args(args, allowed_token_ids(args.vocab_size), args.max_model_len)
    prompts = [s.prompt for s in work.samples]
    total = sum(len(p) for p in prompts)
    print(
        f"{args.trace_path}: {work.window} records, {len(prompts)} sent ({work.skipped} skipped, "
        f"{work.clipped} clipped), {total} prompt tokens at {work.block_tokens} tokens a hash id"
    )
    for bs in args.block_size:
        cached = sum(oracle_cached(prompts, bs))
        print(f"oracle block {bs}: cached {cached} of {total} = {cached / max(total, 1):.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
