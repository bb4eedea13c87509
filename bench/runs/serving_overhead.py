"""The in-process baseline: the same ``random`` workload driven straight into one ``LLMEngine``.

Measures what the HTTP bench measures (TTFT, TPOT, ITL, throughput) without the HTTP front, the
rank process and the IPC, so the difference is the serving overhead::

    python -m bench.runs.serving_overhead --num-prompts 64 --random-input-len 128 \\
        --random-output-len 64 --max-concurrency 16

The prompts are those of ``python -m bench --dataset-name random`` with the same flags and seed
(ids drawn from the model tokenizer's non-special ids). Requests are admitted between engine
steps whenever fewer than ``--max-concurrency`` are unfinished; TTFT runs from admission to the
step that produced the first token.
"""

from __future__ import annotations

import argparse
import time

from bench import datasets
from bench.client import RequestResult
from bench.report import format_report, write_json
from bench.summary import summarize


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bench.runs.serving_overhead", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--random-input-len", type=int, default=128)
    parser.add_argument("--random-output-len", type=int, default=64)
    parser.add_argument("--max-concurrency", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: all cores, as dp 1 gets)"
    )
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--json", dest="json_path", default=None, metavar="PATH")
    return parser


def make_engine(args):
    import os

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    threads = args.threads or len(os.sched_getaffinity(0))
    return LLMEngine(
        EngineConfig(
            model=args.model,
            num_threads=threads,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
        )
    )


def workload(args, tokenizer, seed: int) -> list[datasets.SampleRequest]:
    allowed = datasets.allowed_token_ids(len(tokenizer), tokenizer)
    return datasets.random_prompts(
        num_prompts=args.num_prompts,
        input_len=args.random_input_len,
        output_len=args.random_output_len,
        seed=seed,
        allowed=allowed,
    )


def drive(engine, samples, concurrency: int) -> tuple[list[RequestResult], float]:
    """Run ``samples`` through ``engine`` keeping at most ``concurrency`` unfinished."""
    from engine.sampling_params import SamplingParams

    pending = list(reversed(samples))
    live: dict[str, tuple[RequestResult, list[float]]] = {}
    done: list[RequestResult] = []
    started = time.perf_counter()
    n = 0
    while pending or live:
        while pending and len(live) < concurrency:
            s, rid = pending.pop(), f"bench-{n}"
            n += 1
            engine.add_request(
                rid,
                s.prompt,
                SamplingParams(max_tokens=s.output_len, temperature=0, ignore_eos=True),
            )
            live[rid] = (RequestResult(start=time.perf_counter(), prompt_tokens=s.prompt_len), [])
        for out in engine.step():
            _record(live, done, out, time.perf_counter())
    return done, time.perf_counter() - started


def _record(live, done, out, now: float) -> None:
    result, stamps = live[out.request_id]
    stamps.append(now)
    if not out.finished:
        return
    result.ok = True
    result.ttft = stamps[0] - result.start
    result.itl = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    result.latency = now - result.start
    result.output_tokens, result.cached_tokens = out.num_output_tokens, out.num_cached_tokens
    done.append(result)
    del live[out.request_id]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    engine = make_engine(args)
    # Warm-up on other prompts (first-call allocations, kernel choice) that share no cached prefix.
    drive(engine, workload(args, engine.tokenizer, args.seed + 1)[:2], 2)
    samples = workload(args, engine.tokenizer, args.seed)
    results, duration = drive(engine, samples, args.max_concurrency)
    report = {
        "config": {**vars(args), "base_url": "in-process LLMEngine", "dataset_name": "random"},
        "summary": summarize(results, duration),
        "engine_metrics": None,
    }
    print(format_report(report), flush=True)
    if args.json_path:
        write_json(report, args.json_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
