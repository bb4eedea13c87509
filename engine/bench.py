"""In-process benchmark of the engine core: ``python -m engine.bench [--threads 2] [--quick]``.

Three measurements, each printed as a table (docs/benchmarks.md records a run):

1. time to first token of a 640-token prompt, cold and with its first 512 tokens in the prefix
   cache (median of several runs; add_request to the first ``step()`` output of that request);
2. output tokens/s at 1, 4 and 16 concurrent requests against sequential transformers
   ``model.generate`` on the same prompts (greedy, equal output lengths);
3. resident memory of the KV pool against its configured size.

Both sides run with the same ``torch.set_num_threads``. Timings are wall-clock on whatever else
the machine is doing: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import gc
import platform
import random
import statistics
import time

import psutil
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

MIB = 2**20
VOCAB_LOW, VOCAB_HIGH = 8, 4000  # ordinary (non-special) tokens of the tiny model


def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]


def make_engine(args, **overrides) -> LLMEngine:
    kw = {
        "model": args.model,
        "block_size": 16,
        "kv_cache_memory": 256 * MIB,
        "max_num_seqs": 64,
        "max_num_batched_tokens": 2048,
        "num_threads": args.threads,
        **overrides,
    }
    return LLMEngine(EngineConfig(**kw))


def print_table(title: str, headers: list[str], rows: list[list]) -> None:
    cells = [headers] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    print(f"\n{title}")
    for i, row in enumerate(cells):  # first column left-aligned, numbers right-aligned
        print(
            "  ".join(
                c.ljust(w) if j == 0 else c.rjust(w)
                for j, (c, w) in enumerate(zip(row, widths, strict=False))
            ).rstrip()
        )
        if i == 0:
            print("  ".join("-" * w for w in widths))


# ----- 1. time to first token ---------------------------------------------------------------------


def time_to_first_token(engine: LLMEngine, request_id: str, prompt: list[int]) -> tuple[float, int]:
    """Seconds from add_request to the step that returns this request's first token, and how
    many prompt tokens came from the cache."""
    start = time.perf_counter()
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=1, temperature=0))
    while True:
        for out in engine.step():
            if out.request_id == request_id:
                return time.perf_counter() - start, out.num_cached_tokens


@torch.inference_mode()
def forward_ms(model, num_tokens: int, runs: int) -> float:
    """Median ms of one plain transformers forward over ``num_tokens`` fresh tokens (no cache):
    what a prefill of just those tokens costs without any context to attend to."""
    ids = torch.randint(
        VOCAB_LOW, VOCAB_HIGH, (1, num_tokens), generator=torch.Generator().manual_seed(num_tokens)
    )
    model(ids, use_cache=False, logits_to_keep=1)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        model(ids, use_cache=False, logits_to_keep=1)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def bench_ttft(args) -> dict:
    from transformers import AutoModelForCausalLM

    engine = make_engine(args)
    rng = random.Random(1)
    time_to_first_token(engine, "warmup", random_prompt(rng, 640))  # first-call allocations
    cold, warm, cached = [], [], set()
    for run in range(args.runs):
        seconds, hit = time_to_first_token(engine, f"cold-{run}", random_prompt(rng, 640))
        assert hit == 0, hit
        cold.append(seconds)
        prefix = random_prompt(rng, 512)
        time_to_first_token(engine, f"fill-{run}", prefix + random_prompt(rng, 128))
        seconds, hit = time_to_first_token(engine, f"warm-{run}", prefix + random_prompt(rng, 128))
        warm.append(seconds)
        cached.add(hit)
    result = {
        "cold": statistics.median(cold),
        "warm": statistics.median(warm),
        "cached": sorted(cached),
    }
    result["ratio"] = result["warm"] / result["cold"]
    model = AutoModelForCausalLM.from_pretrained(engine.model_path, dtype=torch.float32).eval()
    reference = {n: forward_ms(model, n, args.runs) for n in (1, 128, 640)}

    def ms(xs):
        return [
            f"{statistics.median(xs) * 1e3:.1f}",
            f"{min(xs) * 1e3:.1f}",
            f"{max(xs) * 1e3:.1f}",
        ]

    print_table(
        f"Time to first token, 640-token prompt (median of {args.runs} runs)",
        ["case", "cached tokens", "TTFT ms", "min ms", "max ms"],
        [
            ["engine, cold", 0, *ms(cold)],
            ["engine, 512 cached", "/".join(map(str, result["cached"])), *ms(warm)],
        ]
        + [
            [f"reference: plain HF forward, {n} new tok, no context", "-", f"{t:.1f}", "", ""]
            for n, t in reference.items()
        ],
    )
    verdict = "met" if result["ratio"] <= 0.3 else "MISSED"
    print(
        f"cached / cold = {result['ratio']:.3f}  (goal <= 0.30: {verdict}); "
        f"reference forward 128 / 640 tokens = {reference[128] / reference[640]:.3f}"
    )
    result["reference_ms"] = reference
    return result


# ----- 2. throughput ------------------------------------------------------------------------------


def engine_generate(
    engine: LLMEngine, prompts: list[list[int]], max_tokens: int
) -> tuple[float, list[list[int]]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    return time.perf_counter() - start, [o["token_ids"] for o in outs]


@torch.inference_mode()
def hf_generate(model, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    """transformers' own generate, one prompt after another (its default attention and cache)."""
    outs = []
    start = time.perf_counter()
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
        )
        outs.append(out[0, len(prompt) :].tolist())
    return time.perf_counter() - start, outs


def bench_throughput(args) -> list[dict]:
    from transformers import AutoModelForCausalLM

    engine = make_engine(args)
    model = AutoModelForCausalLM.from_pretrained(engine.model_path, dtype=torch.float32).eval()
    rng = random.Random(2)
    warm = [random_prompt(rng, 128)]
    engine_generate(engine, warm, 8)
    hf_generate(model, warm, 8)
    rows, results = [], []
    for conc in (1, 4, 16):
        prompts = [random_prompt(rng, 128) for _ in range(conc)]
        e_time, e_out = engine_generate(engine, prompts, args.output_tokens)
        hf_prompts = prompts[: args.hf_prompts]
        h_time, h_out = hf_generate(model, hf_prompts, args.output_tokens)
        e_rate = conc * args.output_tokens / e_time
        h_rate = len(hf_prompts) * args.output_tokens / h_time
        same = sum(a == b for a, b in zip(e_out, h_out, strict=False))
        results.append(
            {"concurrency": conc, "engine": e_rate, "hf": h_rate, "speedup": e_rate / h_rate}
        )
        rows.append(
            [
                conc,
                f"{e_rate:.0f}",
                f"{h_rate:.0f}",
                len(hf_prompts),
                f"{e_rate / h_rate:.2f}x",
                f"{same}/{len(hf_prompts)}",
            ]
        )
    print_table(
        f"Output tokens/s, 128-token prompts, {args.output_tokens} output tokens, greedy",
        ["concurrent", "engine tok/s", "HF tok/s", "HF prompts", "speedup", "same ids"],
        rows,
    )
    verdict = "met" if results[-1]["speedup"] >= 4 else "MISSED"
    print(f"speedup at 16 concurrent = {results[-1]['speedup']:.2f}x  (goal >= 4x: {verdict})")
    return results


# ----- 3. memory ----------------------------------------------------------------------------------


def rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


def bench_memory(args) -> dict:
    """RSS growth while the engine (weights + pool) is built, and RSS released when just the
    pool is dropped: the pool's resident size."""
    configured = args.kv_memory_mib * MIB
    before = rss()
    engine = make_engine(args, kv_cache_memory=configured)
    built = rss()
    weights = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    pool = engine.runner.kv_bytes
    engine.runner.kv = torch.empty(0)
    dropped = rss()
    result = {
        "configured": configured,
        "allocated": pool,
        "resident": built - dropped,
        "engine_growth": built - before,
        "weights": weights,
    }
    print_table(
        f"KV pool memory (kv_cache_memory = {args.kv_memory_mib} MiB, "
        f"{engine.runner.num_kv_blocks} blocks x {engine.config.block_size} tokens)",
        ["quantity", "MiB"],
        [
            ["configured kv_cache_memory", f"{configured / MIB:.1f}"],
            ["allocated pool tensor", f"{pool / MIB:.1f}"],
            ["RSS released when the pool is freed", f"{result['resident'] / MIB:.1f}"],
            ["RSS before engine", f"{before / MIB:.1f}"],
            ["RSS after engine (weights + pool)", f"{built / MIB:.1f}"],
            ["  of which model weights", f"{weights / MIB:.1f}"],
        ],
    )
    return result


# ----- entry point --------------------------------------------------------------------------------


class OtherLoad:
    """Measures the CPU time other processes took while a part ran, so a number taken on a busy
    machine says so."""

    @staticmethod
    def _busy() -> float:
        t = psutil.cpu_times()
        return sum(t) - t.idle - getattr(t, "iowait", 0.0)

    @staticmethod
    def _own() -> float:
        t = psutil.Process().cpu_times()
        return t.user + t.system + t.children_user + t.children_system

    def __enter__(self):
        self.start = (time.perf_counter(), self._busy(), self._own())
        return self

    def __exit__(self, *exc):
        wall, busy, own = (
            now - then
            for now, then in zip(
                (time.perf_counter(), self._busy(), self._own()), self.start, strict=True
            )
        )
        share = max(0.0, busy - own) / wall
        print(
            f"(other processes meanwhile: {share * 100:.0f}% of one core; "
            f"{'results disturbed' if share > 0.1 else 'quiet'})"
        )


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m engine.bench", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--threads", type=int, default=2, help="torch intra-op threads, both sides (default 2)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="fewer runs and shorter outputs (a smoke run)"
    )
    parser.add_argument("--model", default="tiny", help="model directory or 'tiny' (default)")
    parser.add_argument(
        "--kv-memory-mib", type=int, default=256, help="pool size for the memory check"
    )
    parser.add_argument(
        "--only",
        choices=["ttft", "throughput", "memory"],
        action="append",
        help="run only these parts (repeatable)",
    )
    args = parser.parse_args(argv)
    args.runs = 3 if args.quick else 7
    args.output_tokens = 32 if args.quick else 128
    args.hf_prompts = 4 if args.quick else 16
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    parts = args.only or ["memory", "ttft", "throughput"]  # memory first: before other pools exist
    print(
        f"engine.bench: model={args.model} threads={args.threads} quick={args.quick} "
        f"torch={torch.__version__} python={platform.python_version()}"
    )
    for name, part in (
        ("memory", bench_memory),
        ("ttft", bench_ttft),
        ("throughput", bench_throughput),
    ):
        if name in parts:
            with OtherLoad():
                part(args)


if __name__ == "__main__":
    main()
