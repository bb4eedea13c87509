"""Routers in front of a simulated prefill/decode-disaggregated fleet, over real HTTP and real
processes: ``--prefill`` prefill workers and ``--decode`` decode workers of the simulated engine
(``runengine --simulate PROFILE --disaggregation-mode prefill|decode``, ``--dp-size`` ranks each),
a trace replayed on its timestamps through ours (``runrouter --pd-disaggregation``, vLLM's two
steps), sglang-router 0.3.2 (``--pd-disaggregation``) and vllm-router 0.1.17
(``--vllm-pd-disaggregation --kv-connector nixl``), all cache_aware, each with fresh engines; and
ours in front of a co-located fleet of as many workers (``--colocated``)::

    .venv/bin/python -m bench.runs.pd_at_fleet_scale \\
        --trace-path bench/traces/mooncake_synthetic_trace.jsonl --num-prompts 600 \\
        --prefill 2 --decode 2 --dp-size 2 --speedup 2 --num-kv-blocks 250000

The simulated decode rank waits out the KV transfer the profile models (its KV bytes over
``Profile.kv_link_bytes_per_s``), so a decode rank that already holds part of a prompt waits
less. Reported per router: the prefill side's hits (the prefill engines' cached tokens, and of
the block-rule oracle), TTFT mean / p50 / p90 / p99 and TPOT mean at the client, the decode
ranks' max/mean of their running requests (each decode engine's ``num_requests_running`` per
rank, sampled every 0.25 s), the KV blocks pulled, and each process tree's CPU. Latencies are
measured in real time (``--simulate-speedup 1``), as bench.runs.routers_at_fleet_scale explains;
prompts are whole-word text (sglang-router refuses token ids).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
from contextlib import ExitStack, nullcontext
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench import engine_metrics
from bench.oracle import oracle_cached
from bench.runner import RunOptions, send_samples
from bench.runs.pd_routers import engine_metrics_bootstrap
from bench.runs.routers_at_fleet_scale import cpu_seconds, quantiles, trace_samples
from harness.procs import free_port, metrics, router_command, start, start_engine

ROUTERS = ("dpmesh", "sglang-router", "vllm-router", "dpmesh co-located")


def router_cmd(name: str, prefill, decode, bootstraps, port: int, colocated=()) -> list[str]:
    """The command line of router ``name`` on ``port`` in front of the ``prefill`` and
    ``decode`` engines (``colocated``: ours in front of ordinary engines)."""
    exe = lambda n: str(Path(sys.executable).parent / n)  # noqa: E731
    if name == "dpmesh co-located":
        return router_command([e.url for e in colocated], port=port, policy="cache_aware")
    if name == "dpmesh":
        legs = [a for e in prefill for a in ("--prefill", e.url)]
        legs += [a for e in decode for a in ("--decode", e.url)]
        return router_command([], "--pd-disaggregation", *legs, port=port, policy="cache_aware")
    if name == "sglang-router":
        legs = [a for e, b in zip(prefill, bootstraps, strict=True)
                for a in ("--prefill", e.url, str(b))]  # fmt: skip
        legs += [a for e in decode for a in ("--decode", e.url)]
        return [exe("sglang-router"), "launch", "--host", "127.0.0.1", "--port", str(port),
                "--pd-disaggregation", *legs, "--policy", "cache_aware", "--log-level", "warn",
                "--prometheus-port", str(free_port())]  # fmt: skip
    legs = [a for e in prefill for a in ("--prefill", e.url)]
    legs += [a for e in decode for a in ("--decode", e.url)]
    return [exe("vllm-router"), "--host", "127.0.0.1", "--port", str(port),
            "--vllm-pd-disaggregation", "--kv-connector", "nixl", *legs,
            "--policy", "cache_aware", "--prometheus-port", str(free_port())]  # fmt: skip


async def sample_running(urls: list[str], area: dict, stop: asyncio.Event, every_s=0.25):
    """Add each decode rank's running requests x seconds into ``area`` ((url, rank) -> float)
    until ``stop``."""
    async with httpx.AsyncClient(timeout=5) as client:
        while not stop.is_set():
            for url in urls:
                with contextlib.suppress(httpx.HTTPError):
                    text = (await client.get(url + "/metrics")).text
                    for family in text_string_to_metric_families(text):
                        for s in family.samples:
                            if s.name == "dpmesh_engine_num_requests_running":
                                key = (url, s.labels.get("rank"))
                                area[key] = area.get(key, 0.0) + s.value * every_s
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), every_s)


async def replay(router_url: str, prefill_urls, decode_urls, samples, speedup: float, pids):
    before = [await engine_metrics.scrape(u) for u in prefill_urls]
    pulled = sum(_pulled(u) for u in decode_urls)
    cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    area: dict = {}
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_running(decode_urls, area, stop))
    opts = RunOptions(base_url=router_url, model="tiny", speedup=speedup, progress=False)
    run = await send_samples(opts, samples)
    stop.set()
    await sampler
    cpu = {name: cpu_seconds(pid) - cpu_before[name] for name, pid in pids.items()}
    await asyncio.sleep(0.5)  # the ranks report every 0.25 s
    after = [await engine_metrics.scrape(u) for u in prefill_urls]
    cached = sum(
        sum(engine_metrics.delta(b, a).get("cached_tokens", {}).values())
        for b, a in zip(before, after, strict=True)
    )
    return run.results, cached, area, sum(_pulled(u) for u in decode_urls) - pulled, cpu


def _pulled(url: str) -> float:
    """KV blocks the decode worker's ranks pulled so far (a simulated pull moves no bytes)."""
    return sum(v for (name, _), v in metrics(url).items() if name == "kv_transfer_blocks_pulled")


def run_router(name: str, args, samples, id_samples, workdir: Path) -> dict:
    common = ["--dp-size", str(args.dp_size), "--simulate", args.simulate,
              "--simulate-speedup", "1", "--num-kv-blocks", str(args.num_kv_blocks)]  # fmt: skip
    slug = name.replace(" ", "-")
    with ExitStack() as stack:
        if name == "dpmesh co-located":
            colocated = [stack.enter_context(start_engine(workdir, *common, name=f"{slug}-{i}"))
                         for i in range(args.prefill + args.decode)]  # fmt: skip
            prefill, decode, bootstraps = colocated, [], []
        else:
            colocated = []
            pd = ["--disaggregation-bootstrap-port", "0", "--disaggregation-mode"]
            prefill = [stack.enter_context(start_engine(workdir, *common, *pd, "prefill",
                                                        name=f"{slug}-prefill-{i}"))
                       for i in range(args.prefill)]  # fmt: skip
            decode = [stack.enter_context(start_engine(workdir, *common, *pd, "decode",
                                                       name=f"{slug}-decode-{i}"))
                      for i in range(args.decode)]  # fmt: skip
            bootstraps = [engine_metrics_bootstrap(e.url) for e in prefill]
        port = free_port()
        env = {"DATABASE_URL": f"sqlite:///{workdir}/{slug}.sqlite3"}
        cmd = router_cmd(name, prefill, decode, bootstraps, port, colocated)
        log = workdir / f"router-{slug}.log"
        router = stack.enter_context(
            start(cmd, f"http://127.0.0.1:{port}", log, env=env, timeout=120)
        )
        engines = (*prefill, *decode)
        pids = {"router": router.proc.pid, **{f"e{i}": e.proc.pid for i, e in enumerate(engines)}}
        results, cached, area, pulled, cpu = asyncio.run(
            replay(
                router.url,
                [e.url for e in prefill],
                [e.url for e in decode or prefill],
                samples,
                args.speedup,
                pids,
            )  # fmt: skip
        )
    ok = [r for r in results if r.ok]
    by_start = sorted(ok, key=lambda r: r.start)
    oracle = sum(oracle_cached([list(id_samples[r.meta["index"]].prompt) for r in by_start]))
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    ttft = [r.ttft for r in ok]
    tpot = [sum(r.itl) / len(r.itl) for r in ok if r.itl]  # each request's mean gap
    ranks = list(area.values())
    sent = max(1, len(results))
    return {
        "router": name,
        "ok": len(ok),
        "failed": len(results) - len(ok),
        "hit_rate": cached / max(1, prompt),
        "of_oracle": cached / oracle if oracle else float("nan"),
        "ttft_s": quantiles(ttft),
        "tpot_mean_s": sum(tpot) / len(tpot) if tpot else float("nan"),
        "decode_max_mean": max(ranks) / (sum(ranks) / len(ranks)) if sum(ranks) else float("nan"),
        "pulled_blocks": pulled,
        "router_cpu_ms": 1000 * cpu["router"] / sent,
        "engines_cpu_ms": 1000 * sum(v for k, v in cpu.items() if k != "router") / sent,
    }


def print_row(r: dict) -> None:
    t = r["ttft_s"]
    print(f"| {r['router']} | {r['ok']} / {r['failed']} | {r['hit_rate']:.3f} | "
          f"{r['of_oracle']:.3f} | {t['mean']:.3f} | {t['p50']:.3f} | {t['p90']:.3f} | "
          f"{t['p99']:.3f} | {r['tpot_mean_s'] * 1000:.1f} ms | {r['decode_max_mean']:.2f} | "
          f"{r['pulled_blocks']:.0f} | {r['router_cpu_ms']:.1f} | {r['engines_cpu_ms']:.1f} |",
          flush=True)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trace-path", required=True)
    parser.add_argument("--num-prompts", type=int, default=600)
    parser.add_argument("--prefill", type=int, default=2)
    parser.add_argument("--decode", type=int, default=2)
    parser.add_argument("--dp-size", type=int, default=2)
    parser.add_argument("--speedup", type=float, default=2.0)
    parser.add_argument("--simulate", default="h100-llama3.1-8b")
    parser.add_argument("--num-kv-blocks", type=int, default=250000)
    parser.add_argument("--routers", nargs="*", default=list(ROUTERS), choices=ROUTERS)
    parser.add_argument("--rounds", type=int, default=1, help="the routers interleaved, N times")
    parser.add_argument("--prompt-format", choices=("text",), default="text")
    parser.add_argument("--trace-block-tokens", type=int, default=512)
    parser.add_argument("--workdir", default=None, help="keep the engines' and routers' logs")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from engine.tiny import ensure_tiny_model
    from engine.tokenizer import load_tokenizer

    tok = load_tokenizer(str(ensure_tiny_model()))
    samples, id_samples = trace_samples(args, tok)
    print(f"{len(samples)} requests, {args.prefill} prefill + {args.decode} decode workers x DP "
          f"{args.dp_size}, simulated {args.simulate}, speedup {args.speedup}")  # fmt: skip
    print(
        "| router | ok / failed | prefill hit | of oracle | TTFT mean s | p50 | p90 | p99 | "
        "TPOT mean | decode max/mean | KV blocks pulled | router CPU ms/req | engines CPU ms/req |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() if not args.workdir else nullcontext(args.workdir) as tmp:
        for rnd in range(args.rounds):
            for name in args.routers:
                workdir = Path(tmp) / f"round-{rnd}"
                workdir.mkdir(exist_ok=True)
                print_row(run_router(name, args, samples, id_samples, workdir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
