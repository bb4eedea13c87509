"""Balance against hits, routers side by side: skewed prefix sharing (a zipf over many prefixes)
and multi-turn chat, on a DP N engine whose ranks each keep an LRU prefix cache of their own and
prefill one batch at a time: by default the simulated engine with our CPU engine's step times
(``--simulate cpu-tiny``) and a KV pool too small for every rank to hold every prefix, so where
each prefix lives matters and a rank that takes too much of the traffic queues it.

Each target gets a fresh engine per workload, the targets interleaved ``--rounds`` times:

* zipf: ``--zipf-prompts`` prompts over ``--zipf-prefixes`` prefixes drawn with weight
  1 / (k + 1) ** ``--zipf-s``, fresh suffixes, at ``--zipf-concurrency``;
* multi_turn: ``--sessions`` conversations x ``--turns`` turns sharing one system prompt,
  streamed, at ``--chat-concurrency``.

Per row: hits / the block-rule oracle, per-rank prompt tokens max/mean (the engine's own
/metrics), TTFT p50 / mean / p99 and the run's total time::

    .venv/bin/python -m bench.runs.routers_under_skew [--rounds 2] \\
        [--targets dpmesh:cache_aware sglang:cache_aware dpmesh:round_robin]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

from bench import datasets
from bench.oracle import chat_prompts, oracle_cached
from bench.runs.routers_on_our_engine import measure, router_cmd, row, tokenizer
from bench.summary import distribution_ms
from harness.procs import free_port, start, start_engine

TARGETS = ["dpmesh:cache_aware", "sglang:cache_aware", "dpmesh:round_robin"]
WORKLOADS = ("zipf", "multi_turn")


def workload(name: str, args, tok, seed: int):
    """(what is sent, its concurrency)."""
    if name == "zipf":
        samples = datasets.zipf_prefixes(
            num_prompts=args.zipf_prompts,
            prefix_len=args.prefix_len,
            suffix_len=args.suffix_len,
            num_prefixes=args.zipf_prefixes,
            zipf_s=args.zipf_s,
            output_len=args.output_len,
            seed=seed,
            allowed=datasets.word_token_ids(tok),
            tokenizer=tok,
            as_text=True,
        )
        return samples, args.zipf_concurrency
    convs = datasets.multi_turn(
        num_conversations=args.sessions,
        num_turns=args.turns,
        system_len=args.system_len,
        user_len=args.user_len,
        output_len=args.output_len,
        seed=seed,
        tokenizer=tok,
    )
    return convs, args.chat_concurrency


def oracle(name: str, results, sent, tok) -> int:
    by_start = sorted((r for r in results if r.ok), key=lambda r: r.start)
    if name == "zipf":
        prompts = [tok.encode(sent[r.meta["index"]].prompt, add_special_tokens=False)
                   for r in by_start]  # fmt: skip
    else:
        prompts = chat_prompts(by_start, sent, tok)
    return sum(oracle_cached(prompts))


def engine_args(args) -> list[str]:
    """``runengine``'s flags for the engine these runs use (DP N, its KV pool, the simulation)."""
    out = ["--dp-size", str(args.dp_size), "--num-kv-blocks", str(args.num_kv_blocks)]
    if args.simulate != "none":
        out += ["--simulate", args.simulate, "--simulate-speedup", "1"]
    return out


def run_target(spec: str, name: str, args, tok, workdir: Path, seed: int) -> dict:
    kind, _, policy = spec.partition(":")
    slug = f"{spec.replace(':', '-')}-{name}-{seed}"
    sent, concurrency = workload(name, args, tok, seed)
    with start_engine(workdir, *engine_args(args), name=f"engine-{slug}") as engine:
        port = free_port()
        env = {"DATABASE_URL": f"sqlite:///{workdir}/{slug}.sqlite3"}
        with start(router_cmd(kind, policy, engine.url, port), f"http://127.0.0.1:{port}",
                   workdir / f"router-{slug}.log", env=env, timeout=120) as router:  # fmt: skip
            results, duration, diff = asyncio.run(
                measure(engine.url, router.url, sent, concurrency)
            )
    out = row(spec, results, oracle(name, results, sent, tok), diff, args.dp_size)
    ttft = distribution_ms(r.ttft for r in results if r.ok)
    return {"workload": name, **out, "ttft_mean_ms": ttft["mean"], "total_s": duration}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--targets", nargs="*", default=TARGETS, help="kind:policy, kind dpmesh "
                        "or sglang")  # fmt: skip
    parser.add_argument("--workloads", nargs="*", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=1, help="the targets in turn, this often")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dp-size", type=int, default=4)
    parser.add_argument("--simulate", default="cpu-tiny", help="a profile, or none: our engine")
    parser.add_argument("--num-kv-blocks", type=int, default=1024, help="per rank")
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--zipf-prompts", type=int, default=600)
    parser.add_argument("--zipf-prefixes", type=int, default=48)
    parser.add_argument("--zipf-s", type=float, default=1.1)
    parser.add_argument("--zipf-concurrency", type=int, default=32)
    parser.add_argument("--prefix-len", type=int, default=512, help="tokens")
    parser.add_argument("--suffix-len", type=int, default=64, help="tokens")
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-len", type=int, default=400, help="tokens")
    parser.add_argument("--user-len", type=int, default=60, help="tokens")
    parser.add_argument("--chat-concurrency", type=int, default=16)
    parser.add_argument("--json", default=None)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    tok = tokenizer()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for name in args.workloads:
                seed = args.seed + 100 * round_ + WORKLOADS.index(name)
                for spec in args.targets:
                    r = run_target(spec, name, args, tok, Path(tmp), seed)
                    rows.append({"round": round_, **r})
                    print(
                        f"round {round_} {name:<10} {spec:<20} ok {r['ok']:>3} vs-oracle "
                        f"{r['hits_vs_oracle'] or 0:.3f} max/mean {r['prompt_max_mean']:.2f} "
                        f"TTFT p50 {r['ttft_p50_ms']:.0f} mean {r['ttft_mean_ms']:.0f} ms, "
                        f"{r['total_s']:.1f} s",
                        flush=True,
                    )
    print("\n| round | workload | router | hits / oracle | prompt tokens max/mean | TTFT p50 ms "
          "| TTFT mean ms | TTFT p99 ms | total s |")  # fmt: skip
    print("|---:|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['round']} | {r['workload']} | {r['router']} | {r['hits_vs_oracle'] or 0:.3f} "
              f"| {r['prompt_max_mean']:.2f} | {r['ttft_p50_ms']:.0f} | {r['ttft_mean_ms']:.0f} "
              f"| {r['ttft_p99_ms']:.0f} | {r['total_s']:.1f} |")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
