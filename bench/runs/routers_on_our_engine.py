"""Routers side by side on the same dp-N engine and workloads: ours (cache_aware, round_robin) and
SGLang's (``sglang-router launch --dp-aware``, cache_aware and round_robin).

Each router gets a fresh engine (cold caches) and runs two workloads:
* prefix_repetition (vLLM's: 5 prefixes x 512 tokens, 128-token suffixes, 100 prompts,
  concurrency 1), sent as text so every router sees the same thing;
* multi_turn chat (16 conversations x 5 turns, one shared ~400-token system prompt, streaming,
  concurrency 8).
It prints hit rate, hits / oracle (bench/oracle.py), per-rank prompt-token max/mean from the
engine's own /metrics, and TTFT p50/p99.

    .venv/bin/python -m bench.runs.routers_on_our_engine [--dp-size 4] [--output-len 16] \\
        [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

from bench import datasets, engine_metrics
from bench.oracle import chat_prompts, oracle_cached
from bench.runner import RunOptions, send_conversations, send_samples
from bench.summary import balance, distribution_ms
from harness.procs import free_port, router_command, sglang_router_command, start, start_engine

ROUTERS = [
    ("dpmesh", "cache_aware"),
    ("dpmesh", "round_robin"),
    ("sglang", "cache_aware"),
    ("sglang", "round_robin"),
]


def router_cmd(kind: str, policy: str, engine_url: str | list[str], port: int) -> list[str]:
    """The command line of a router on ``port`` in front of one engine URL or several."""
    urls = [engine_url] if isinstance(engine_url, str) else list(engine_url)
    if kind == "dpmesh":
        return router_command(urls, port=port, policy=policy)
    return sglang_router_command(urls, port=port, policy=policy)


def tokenizer():
    from transformers import AutoTokenizer

    from engine.tiny import ensure_tiny_model

    return AutoTokenizer.from_pretrained(ensure_tiny_model())


async def measure(
    engine_url: str, router_url: str, workload, conc: int
) -> tuple[list, float, dict]:
    before = await engine_metrics.scrape(engine_url + "/metrics")
    opts = RunOptions(base_url=router_url, model="tiny", max_concurrency=conc, progress=False)
    if isinstance(workload[0], datasets.Conversation):
        run = await send_conversations(opts, workload)
    else:
        run = await send_samples(opts, workload)
    after = await engine_metrics.scrape(engine_url + "/metrics")
    return run.results, run.duration_s, engine_metrics.delta(before, after)


def row(name: str, results, oracle: int, diff: dict, dp: int) -> dict:
    ok = [r for r in results if r.ok]
    prompt = diff.get("prompt_tokens", {})
    cached = sum(diff.get("cached_tokens", {}).values())
    per_rank = {r: prompt.get(r, 0.0) for r in range(dp)}
    ttft = distribution_ms(r.ttft for r in ok)
    return {
        "router": name,
        "ok": len(ok),
        "failed": len(results) - len(ok),
        "hit_rate": cached / max(1.0, sum(per_rank.values())),
        "hits_vs_oracle": cached / oracle if oracle else None,
        "prompt_max_mean": balance(per_rank),
        "ttft_p50_ms": ttft["median"],
        "ttft_p99_ms": ttft["p99"],
        "per_rank_prompt_tokens": per_rank,
    }


def run_one(kind: str, policy: str, args, tok, workdir: Path) -> list[dict]:
    name = f"{kind} {policy}"
    out = []
    with start_engine(
        workdir,
        "--dp-size",
        str(args.dp_size),
        "--num-kv-blocks",
        "2048",
        name=f"engine-{kind}-{policy}",
    ) as engine:
        port = free_port()
        env = {"DATABASE_URL": f"sqlite:///{workdir}/{kind}-{policy}.sqlite3"}
        with start(
            router_cmd(kind, policy, engine.url, port),
            f"http://127.0.0.1:{port}",
            workdir / f"router-{kind}-{policy}.log",
            env=env,
            timeout=120,
        ) as router:
            allowed = datasets.allowed_token_ids(len(tok), tok)
            samples = datasets.prefix_repetition(
                num_prompts=100,
                prefix_len=512,
                suffix_len=128,
                num_prefixes=5,
                output_len=args.output_len,
                seed=args.seed,
                allowed=allowed,
                tokenizer=tok,
                as_text=True,
            )
            results, _, diff = asyncio.run(measure(engine.url, router.url, samples, 1))
            prompts = [tok.encode(s.prompt, add_special_tokens=False) for s in samples]
            out.append(
                {
                    "workload": "prefix_repetition",
                    **row(name, results, sum(oracle_cached(prompts)), diff, args.dp_size),
                }
            )
            convs = datasets.multi_turn(
                num_conversations=16,
                num_turns=5,
                system_len=400,
                user_len=60,
                output_len=args.output_len,
                seed=args.seed + 1,
                tokenizer=tok,
            )
            results, _, diff = asyncio.run(measure(engine.url, router.url, convs, 8))
            oracle = sum(
                oracle_cached(chat_prompts(sorted(results, key=lambda r: r.start), convs, tok))
            )
            out.append({"workload": "multi_turn", **row(name, results, oracle, diff, args.dp_size)})
    for r in out:
        print(
            f"{r['workload']:<18} {r['router']:<20} ok {r['ok']:>3} hit {r['hit_rate']:.3f} "
            f"vs-oracle {r['hits_vs_oracle']:.3f} max/mean {r['prompt_max_mean']:.2f} "
            f"TTFT p50 {r['ttft_p50_ms']:.0f} ms p99 {r['ttft_p99_ms']:.0f} ms",
            flush=True,
        )
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dp-size", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--routers", nargs="*", default=[f"{k}:{p}" for k, p in ROUTERS])
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    tok = tokenizer()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for spec in args.routers:
            kind, policy = spec.split(":")
            rows += run_one(kind, policy, args, tok, Path(tmp))
    print(
        "\n| workload | router | hit rate | hits / oracle | prompt tokens max/mean "
        "| TTFT p50 ms | TTFT p99 ms |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['workload']} | {r['router']} | {r['hit_rate']:.3f} "
            f"| {r['hits_vs_oracle']:.3f} | "
            f"{r['prompt_max_mean']:.2f} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
