"""In-process step microbenchmark:
``python -m bench.runs.engine_step [--concurrency 16] [--dtype ...]``.

Drives one ``LLMEngine`` (no HTTP, no rank process) with random token-id prompts, closed loop:
whenever fewer than ``--concurrency`` requests are unfinished a new one is added before the next
``step()``. Greedy, ``ignore_eos``, exact output lengths. Prints steps/s, the mean and median
wall time of pure-decode steps (every scheduled item one token), the mean time of steps that
carry prefill work, and output tokens/s; then the same steps in process CPU time (all threads),
which a busy shared host disturbs far less than wall time. ``--profile`` runs cProfile over the
measured part and prints the top functions.

The first ``--warmup`` requests are run (and not measured) before the measured ones, so the
allocator and torch's kernels are warm. Prompts are random ids; with ``--shared-prefixes N
--prefix-len L`` each starts with one of N fixed prefixes of L ids (round robin), the shape of
``bench``'s prefix_repetition workload, so decode steps attend to cached shared blocks.
``--torch-profile`` prints torch's operator table for the measured part.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

VOCAB_LOW, VOCAB_HIGH = 8, 4000  # ordinary (non-special) tokens of the tiny model


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench.runs.engine_step", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--warmup", type=int, default=16, help="requests run before measuring")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--dtype", default=None, help="engine dtype (default: the engine's default)")
    p.add_argument(
        "--model-impl",
        default=None,
        help="native, transformers or auto (default: the engine's default)",
    )
    p.add_argument(
        "--attention-impl",
        default=None,
        help="decode attention: cpp, torch or auto (default: the engine's default)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, help="measured runs (fresh prompts each)")
    p.add_argument("--profile", action="store_true", help="cProfile the measured run(s)")
    p.add_argument("--torch-profile", action="store_true", help="torch.profiler op table")
    p.add_argument("--shared-prefixes", type=int, default=0, help="prefixes the prompts share")
    p.add_argument("--prefix-len", type=int, default=512, help="ids in each shared prefix")
    return p


def make_engine(args):
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    kw = {
        "model": args.model,
        "num_threads": args.threads or len(os.sched_getaffinity(0)),
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
    }
    if args.dtype:
        kw["dtype"] = args.dtype
    if args.model_impl:
        kw["model_impl"] = args.model_impl
    if args.attention_impl:
        kw["attention_impl"] = args.attention_impl
    return LLMEngine(EngineConfig(**kw))


def run(engine, prompts: list[list[int]], concurrency: int, output_len: int) -> dict:
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    pending = list(reversed(prompts))
    live = 0
    n_out = 0
    decode_ms: list[float] = []
    mixed_ms: list[float] = []
    decode_cpu: list[float] = []  # process CPU time (all threads): steadier on a busy host
    mixed_cpu: list[float] = []
    tag = f"s{time.monotonic_ns()}"
    started = time.perf_counter()
    steps = 0
    while pending or live:
        while pending and live < concurrency:
            engine.add_request(f"{tag}-{len(pending)}", pending.pop(), params)
            live += 1
        decode_only = not engine.scheduler.waiting and all(
            s.num_computed_tokens == s.num_tokens - 1 for s in engine.scheduler.running
        )
        t0, c0 = time.perf_counter(), time.process_time()
        outs = engine.step()
        dt = (time.perf_counter() - t0) * 1e3
        steps += 1
        (decode_ms if decode_only else mixed_ms).append(dt)
        (decode_cpu if decode_only else mixed_cpu).append((time.process_time() - c0) * 1e3)
        for out in outs:
            n_out += len(out.new_token_ids)
            live -= out.finished
    elapsed = time.perf_counter() - started
    return {
        "elapsed_s": elapsed,
        "steps": steps,
        "steps_per_s": steps / elapsed,
        "output_tokens": n_out,
        "output_tok_per_s": n_out / elapsed,
        "decode_steps": len(decode_ms),
        "decode_ms_mean": statistics.fmean(decode_ms) if decode_ms else float("nan"),
        "decode_ms_p50": statistics.median(decode_ms) if decode_ms else float("nan"),
        "mixed_steps": len(mixed_ms),
        "mixed_ms_mean": statistics.fmean(mixed_ms) if mixed_ms else float("nan"),
        "decode_cpu_ms_p50": statistics.median(decode_cpu) if decode_cpu else float("nan"),
        "mixed_cpu_ms_mean": statistics.fmean(mixed_cpu) if mixed_cpu else float("nan"),
    }


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    import torch

    engine = make_engine(args)
    rng = random.Random(args.seed)

    def ids(n):
        return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]

    shared = [ids(args.prefix_len) for _ in range(args.shared_prefixes)]

    def prompts(n):
        if not shared:
            return [ids(args.input_len) for _ in range(n)]
        return [shared[i % len(shared)] + ids(args.input_len) for i in range(n)]

    print(
        f"model={args.model} dtype={engine.config.dtype} impl={engine.runner.model_impl} "
        f"attention={engine.runner.attention_impl} "
        f"threads={torch.get_num_threads()} "
        f"concurrency={args.concurrency} prompts={args.num_prompts} "
        f"{args.input_len} in / {args.output_len} out"
    )
    if args.warmup:
        run(engine, prompts(args.warmup), args.concurrency, args.output_len)
    prof = None
    if args.profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    tprof = None
    if args.torch_profile:
        from torch.profiler import ProfilerActivity, profile

        tprof = profile(activities=[ProfilerActivity.CPU])
        tprof.__enter__()
    for _ in range(args.repeats):
        r = run(engine, prompts(args.num_prompts), args.concurrency, args.output_len)
        print(
            f"steps/s {r['steps_per_s']:.1f}  decode step ms mean {r['decode_ms_mean']:.2f} "
            f"p50 {r['decode_ms_p50']:.2f} ({r['decode_steps']} steps)  "
            f"prefill-carrying step ms mean {r['mixed_ms_mean']:.2f} ({r['mixed_steps']})  "
            f"output tok/s {r['output_tok_per_s']:.0f}  |  CPU ms: decode step p50 "
            f"{r['decode_cpu_ms_p50']:.2f}, prefill-carrying step mean {r['mixed_cpu_ms_mean']:.2f}"
        )
    if tprof is not None:
        tprof.__exit__(None, None, None)
        print(tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    if prof is not None:
        import pstats

        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
