"""Routers side by side at fleet scale: the simulated engine (``runengine --simulate``) at DP N,
a trace replayed on its timestamps, over real HTTP and real processes. Ours (cache_aware, round
robin) and SGLang's router (``sglang-router launch --dp-aware``, its defaults and tighter balance
thresholds), each with a fresh engine::

    .venv/bin/python -m bench.runs.routers_at_fleet_scale \\
        --trace-path bench/traces/mooncake_synthetic_trace.jsonl --num-prompts 600 \\
        --dp-size 4 --speedup 4 --simulate-speedup 4 --num-kv-blocks 250000

``--speedup`` divides the trace's times and ``--simulate-speedup`` the engine's modeled step
times: the same dynamics in less wall time, as long as this machine keeps up (the ranks log
"simulation behind its model" when it does not). A router's own wall time is not sped up, so at
``--simulate-speedup`` k it counts k times in the modelled TTFT, with a k-th of the CPU per
modelled second: to compare routers' TTFT, use ``--simulate-speedup 1`` and ``--speedup`` as the
load (docs/benchmarks.md, "SGLang's real router over HTTP in real time"). It also prints each
router's and engine's CPU ms a request. Latencies are reported in modeled seconds
(measured x simulate-speedup). It prints hit rate, hits / oracle, per-rank prompt tokens max/mean
(the engine's own /metrics) and TTFT mean/p50/p90/p99, and writes a TTFT CDF per router as SVG.

Known limits (2026-12-01): on a 2-vCPU machine the full-size trace is CPU-bound (the front, the
ranks, the router and the client share the cores: TTFT of seconds where the routing lab models
tenths). sglang-router 0.3.2 refuses token-id prompts (422: its ``prompt`` is a string or a list
of strings), so by default the trace is built from whole-word tokens and sent as text
(``--prompt-format text``; bench.datasets ``word_token_ids``): the engine tokenizes each prompt
back to the same ids, so the blocks and shared prefixes are the trace's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import httpx
import numpy as np
import psutil

from bench import engine_metrics
from bench.datasets import allowed_token_ids, word_token_ids
from bench.oracle import floor_ttft, oracle_cached
from bench.runner import RunOptions, send_samples
from bench.runs.routers_on_our_engine import router_cmd, row
from bench.trace import build, read_trace
from harness.procs import free_port, start, start_engine

ROUTERS = {
    "dpmesh cache_aware": ("dpmesh", "cache_aware", []),
    "dpmesh round_robin": ("dpmesh", "round_robin", []),
    "sglang cache_aware": ("sglang", "cache_aware", []),
    # SGLang's own knobs set to balance sooner (its defaults: 64 requests and 1.5x)
    "sglang cache_aware tuned": (
        "sglang",
        "cache_aware",
        ["--balance-abs-threshold", "4", "--balance-rel-threshold", "1.1"],
    ),
}


def quantiles(values: list[float]) -> dict:
    if not values:
        return dict.fromkeys(("mean", "p50", "p90", "p99"), float("nan"))
    arr = np.asarray(values, dtype=float)
    return {
        "mean": float(arr.mean()),
        "p50": float(np.percentile(arr, 50)),
        "p90": float(np.percentile(arr, 90)),
        "p99": float(np.percentile(arr, 99)),
    }


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and its live descendants (an engine's ranks,
    sglang-router's workers): what the process tree has burnt so far."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            times = proc.cpu_times()
            total += times.user + times.system
    return total


async def replay(engine_url: str, router_url: str, samples, speedup: float, pids: dict):
    """Send ``samples`` through the router; also the CPU seconds each of ``pids`` (name -> pid)
    spent meanwhile, so a router's own cost per request shows apart from the machine's load, and
    our router's own mean dispatch-to-first-token (None for another router)."""
    before = await engine_metrics.scrape(engine_url + "/metrics")
    cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    opts = RunOptions(base_url=router_url, model="tiny", speedup=speedup, progress=False)
    router_before = await router_ttft(router_url)
    run = await send_samples(opts, samples)
    cpu = {name: cpu_seconds(pid) - cpu_before[name] for name, pid in pids.items()}
    router_after = await router_ttft(router_url)
    after = await engine_metrics.scrape(engine_url + "/metrics")
    router_ttft_s = (
        (router_after[0] - router_before[0]) / max(1, router_after[1] - router_before[1])
        if router_after and router_before
        else None
    )
    return run.results, engine_metrics.delta(before, after), cpu, router_ttft_s


async def router_ttft(url: str) -> tuple[float, int] | None:
    """Our router's dispatch-to-first-token histogram, (sum s, count); None for another router."""
    async with httpx.AsyncClient(timeout=10) as client:
        response = await client.get(url + "/metrics")
    sums = {}
    for line in response.text.splitlines():
        for field in ("sum", "count"):
            name = f"dpmesh_router_time_to_first_token_seconds_{field} "
            if line.startswith(name):
                sums[field] = float(line.rsplit(" ", 1)[1])
    return (sums["sum"], int(sums["count"])) if len(sums) == 2 else None


def run_router(name: str, args, samples, workdir: Path, id_samples=None) -> dict:
    """``samples`` are sent; ``id_samples`` (the same prompts as token ids, when ``samples`` are
    texts) give the oracle."""
    id_samples = id_samples or samples
    kind, policy, extra = ROUTERS[name]
    engine_args = ["--dp-size", str(args.dp_size), "--simulate", args.simulate,
                   "--simulate-speedup", str(args.simulate_speedup)]  # fmt: skip
    if args.num_kv_blocks:
        engine_args += ["--num-kv-blocks", str(args.num_kv_blocks)]
    if args.long_prefill_token_threshold is not None:
        engine_args += ["--long-prefill-token-threshold", str(args.long_prefill_token_threshold)]
    slug = name.replace(" ", "-")
    with start_engine(workdir, *engine_args, name=f"engine-{slug}") as engine:
        port = free_port()
        env = {"DATABASE_URL": f"sqlite:///{workdir}/{slug}.sqlite3"}
        cmd = router_cmd(kind, policy, engine.url, port) + extra
        with start(cmd, f"http://127.0.0.1:{port}", workdir / f"router-{slug}.log", env=env,
                   timeout=120) as router:  # fmt: skip
            pids = {"router": router.proc.pid, "engine": engine.proc.pid}
            results, diff, cpu, router_ttft_s = asyncio.run(
                replay(engine.url, router.url, samples, args.speedup, pids)
            )
    ok = [r for r in results if r.ok]
    by_start = sorted(ok, key=lambda r: r.start)
    oracle = sum(oracle_cached([list(id_samples[r.meta["index"]].prompt) for r in by_start]))
    out = row(name, results, oracle, diff, args.dp_size)
    for key in ("ttft_p50_ms", "ttft_p99_ms"):  # measured, not modeled: replaced below
        del out[key]
    for key in ("hits_vs_oracle", "prompt_max_mean"):
        out[key] = out[key] or float("nan")
    ttft = [r.ttft * args.simulate_speedup for r in ok]  # measured seconds -> modeled seconds
    sent = max(1, len(results))
    cpu_ms = {f"{name}_cpu_ms_per_request": 1000 * s / sent for name, s in cpu.items()}
    if router_ttft_s is not None:  # measured seconds -> modeled seconds, as the client's below
        cpu_ms["router_dispatch_ttft_mean_s"] = router_ttft_s * args.simulate_speedup
    requests = [  # each request's own numbers, to compare routers request by request (--json)
        {"index": r.meta["index"], "prompt_tokens": r.prompt_tokens,
         "cached_tokens": r.cached_tokens, "rank": r.rank,
         "ttft_s": r.ttft * args.simulate_speedup}
        for r in by_start
    ]  # fmt: skip
    return {**out, **cpu_ms, "ttft_s": quantiles(ttft), "ttft_sorted": sorted(ttft),
            "requests": requests}  # fmt: skip


def cdf_svg(rows: list[dict], title: str) -> str:
    """A TTFT CDF per router (log-scaled seconds), as a small standalone SVG."""
    width, height, pad = 640, 360, 48
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"]
    rows = [r for r in rows if r["ttft_sorted"]]
    if not rows:
        return ""
    lo = max(1e-3, min(r["ttft_sorted"][0] for r in rows))
    hi = max(r["ttft_sorted"][-1] for r in rows)
    span = np.log10(hi) - np.log10(lo) or 1.0

    def x(v):
        return pad + (np.log10(max(v, lo)) - np.log10(lo)) / span * (width - 2 * pad)

    def y(p):
        return height - pad - p * (height - 2 * pad)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'font-family="sans-serif" font-size="11">',
             f'<text x="{pad}" y="20" font-size="13">{title}</text>',
             f'<line x1="{pad}" y1="{y(0)}" x2="{width - pad}" y2="{y(0)}" stroke="#888"/>',
             f'<line x1="{pad}" y1="{y(0)}" x2="{pad}" y2="{y(1)}" stroke="#888"/>']  # fmt: skip
    decade = 10 ** np.floor(np.log10(lo))
    while decade <= hi * 10:
        if lo <= decade <= hi:
            parts.append(f'<text x="{x(decade):.1f}" y="{height - pad + 14}" '
                         f'text-anchor="middle">{decade:g} s</text>')  # fmt: skip
        decade *= 10
    for p in (0.5, 0.9, 0.99):
        parts.append(f'<text x="{pad - 4}" y="{y(p) + 4:.1f}" text-anchor="end">p{int(p * 100)}'
                     f"</text>")  # fmt: skip
    for i, r in enumerate(rows):
        values = r["ttft_sorted"]
        n = len(values)
        step = max(1, n // 300)  # at most ~300 points a curve: a small file, the same picture
        keep = sorted(set(range(0, n, step)) | {n - 1})
        points = " ".join(f"{x(values[k]):.1f},{y((k + 1) / n):.1f}" for k in keep)
        color = colors[i % len(colors)]
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" '
                     f'points="{points}"/>')  # fmt: skip
        parts.append(f'<text x="{width - pad - 150}" y="{y(0.3) + 14 * i:.1f}" '
                     f'fill="{color}">{r["router"]}</text>')  # fmt: skip
    parts.append("</svg>")
    return "\n".join(parts)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trace-path", required=True)
    parser.add_argument("--num-prompts", type=int, default=600)
    parser.add_argument("--dp-size", type=int, default=4)
    parser.add_argument("--speedup", type=float, default=4.0)
    parser.add_argument("--simulate", default="h100-llama3.1-8b")
    parser.add_argument("--simulate-speedup", type=float, default=4.0)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=None,
        help="the engine's (engine.scheduler); default the profile's (GPU: 0, vLLM's default)",
    )
    parser.add_argument("--routers", nargs="*", default=list(ROUTERS))
    parser.add_argument(
        "--prompt-format",
        choices=("text", "ids"),
        default="text",
        help="text (default): prompts of whole-word tokens sent as text, which every router takes "
        "and which tokenize back to the same ids; ids: token-id prompts (sglang-router refuses "
        "them)",
    )
    parser.add_argument("--trace-block-tokens", type=int, default=512)
    parser.add_argument("--svg", default=None, help="write the TTFT CDF here")
    parser.add_argument("--json", default=None)
    parser.add_argument("--workdir", default=None, help="keep the engines' and routers' logs here")
    return parser


def trace_samples(args, tok) -> tuple[list, list]:
    """(what is sent, the same prompts as token ids): the trace's requests, as text unless
    ``--prompt-format ids`` (sglang-router takes only text)."""
    records = read_trace(args.trace_path, args.num_prompts)
    text = args.prompt_format == "text"
    allowed = word_token_ids(tok) if text else allowed_token_ids(len(tok), tok)
    id_samples = build(
        records, allowed=allowed, block_tokens_=args.trace_block_tokens, max_model_len=131072
    ).samples
    samples = id_samples
    if text:
        samples = [replace(s, prompt=tok.decode(list(s.prompt))) for s in id_samples]
    return samples, id_samples


def floor_quantiles(args, id_samples) -> dict:
    """The TTFT no router can beat: each request alone on a rank holding the oracle's cache."""
    from engine.sim.profiles import get_profile

    profile = get_profile(args.simulate)
    prompts = [list(s.prompt) for s in id_samples]
    return quantiles(floor_ttft(prompts, profile.cost, profile.max_num_batched_tokens))


def print_row(args, name: str, r: dict) -> None:
    t = r["ttft_s"]
    print(f"dp {args.dp_size} {name:<26} ok {r['ok']} hit {r['hit_rate']:.3f} "
          f"vs-oracle {r['hits_vs_oracle']:.3f} max/mean {r['prompt_max_mean']:.2f} "
          f"TTFT mean {t['mean']:.3f} p50 {t['p50']:.3f} p90 {t['p90']:.3f} "
          f"p99 {t['p99']:.3f} s; CPU ms a request: router "
          f"{r['router_cpu_ms_per_request']:.1f} engine "
          f"{r['engine_cpu_ms_per_request']:.1f}"
          + (f"; router's own dispatch-to-first-token mean "
             f"{r['router_dispatch_ttft_mean_s']:.3f} s"
             if "router_dispatch_ttft_mean_s" in r else ""), flush=True)  # fmt: skip


def write_outputs(args, rows: list[dict], floor: dict) -> None:
    """The TTFT CDF (``--svg``) and every row with the floor beside it (``--json``)."""
    if args.svg:
        title = (f"TTFT CDF, {args.num_prompts} Mooncake requests, simulated {args.simulate} "
                 f"DP {args.dp_size}")  # fmt: skip
        Path(args.svg).write_text(cdf_svg(rows, title))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                [
                    {**{k: v for k, v in r.items() if k != "ttft_sorted"}, "floor_ttft_s": floor}
                    for r in rows
                ],
                indent=1,
            )  # fmt: skip
        )


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from engine.tiny import ensure_tiny_model
    from engine.tokenizer import load_tokenizer

    tok = load_tokenizer(str(ensure_tiny_model()))
    samples, id_samples = trace_samples(args, tok)
    floor = floor_quantiles(args, id_samples)
    print(f"dp {args.dp_size} {'floor (alone, the oracle cache)':<26} TTFT mean "
          f"{floor['mean']:.3f} p50 {floor['p50']:.3f} p90 {floor['p90']:.3f} "
          f"p99 {floor['p99']:.3f} s", flush=True)  # fmt: skip
    rows = []
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() if not args.workdir else nullcontext(args.workdir) as tmp:
        for name in args.routers:
            rows.append(run_router(name, args, samples, Path(tmp), id_samples))
            print_row(args, name, rows[-1])
    write_outputs(args, rows, floor)
    return 0


if __name__ == "__main__":
    sys.exit(main())
