"""Where a router's TTFT goes: its placement, or its hop.

A router's TTFT through it is two things at once: where it sends each request (hits, balance)
and what going through it costs (its own work, its event loop's queue, one more process on the
host). This bench separates them. Each target routes the zipf workload of
``routers_under_skew`` (a fresh simulated DP N engine each pass, ``--concurrency`` at a time);
then the same requests go, in the same order and at the same concurrency, straight to a fresh
engine of the same kind, each pinned (``data_parallel_rank``) to the rank that router chose.
The direct pass has the router's placement without its hop:

* direct TTFT, compared across routers: the placement's worth, hop left out;
* via minus direct: what the hop costs, placement held equal.

Both passes use one client (``bench.client.send``, httpx, streamed) so the client's own cost is
the same on both sides::

    .venv/bin/python -m bench.runs.router_hop [--simulate h100-llama3.1-8b] [--rounds 2] \\
        [--targets dpmesh sglang]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

from bench.client import completion_body, send
from bench.runs import routers_under_skew
from bench.runs.routers_on_our_engine import router_cmd, tokenizer
from bench.summary import distribution_ms
from harness.procs import free_port, start, start_engine


async def drive(url: str, samples, concurrency: int, ranks: list | None = None) -> list:
    """Each of ``samples`` in order, ``concurrency`` at a time, streamed; pinned to ``ranks[i]``
    where given. The results in the samples' order."""
    limit = asyncio.Semaphore(concurrency)
    results: list = [None] * len(samples)
    pool = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=pool) as client:

        async def one(i: int, sample) -> None:
            async with limit:
                body = completion_body("tiny", sample.prompt, sample.output_len, {})
                if ranks is not None and ranks[i] is not None:
                    body["data_parallel_rank"] = ranks[i]
                results[i] = await send(client, "/v1/completions", body, sample.prompt_len)

        await asyncio.gather(*(one(i, s) for i, s in enumerate(samples)))
    return results


def ttft(results) -> dict:
    ok = [r for r in results if r.ok]
    out = distribution_ms(r.ttft for r in ok)
    out["failed"] = len(results) - len(ok)
    out["cached_tokens"] = sum(r.cached_tokens or 0 for r in ok)
    return out


def run_target(spec: str, args, samples, concurrency: int, workdir: Path, slug: str) -> dict:
    kind, _, policy = spec.partition(":")  # dpmesh or sglang, cache_aware unless named
    engine_args = routers_under_skew.engine_args(args)
    with start_engine(workdir, *engine_args, name=f"engine-{slug}") as engine:
        port = free_port()
        env = {"DATABASE_URL": f"sqlite:///{workdir}/{slug}.sqlite3"}
        cmd = router_cmd(kind, policy or "cache_aware", engine.url, port)
        with start(cmd, f"http://127.0.0.1:{port}", workdir / f"router-{slug}.log", env=env,
                   timeout=120) as router:  # fmt: skip
            via = asyncio.run(drive(router.url, samples, concurrency))
    ranks = [r.rank for r in via]
    if None in ranks:
        raise RuntimeError(f"{kind} did not say which rank served every request")
    with start_engine(workdir, *engine_args, name=f"direct-{slug}") as engine:
        direct = asyncio.run(drive(engine.url, samples, concurrency, ranks))
    return {"target": spec, "via": ttft(via), "direct": ttft(direct)}


def build_parser() -> argparse.ArgumentParser:
    parser = routers_under_skew.build_parser()
    parser.description = __doc__
    parser.set_defaults(targets=["dpmesh", "sglang"], simulate="h100-llama3.1-8b", rounds=2)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    tok = tokenizer()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            seed = args.seed + 100 * round_
            samples, concurrency = routers_under_skew.workload("zipf", args, tok, seed)
            for kind in args.targets:
                slug = f"{kind.replace(':', '-')}-{seed}"
                row = run_target(kind, args, samples, concurrency, Path(tmp), slug)
                rows.append({"round": round_, "seed": seed, **row})
                via, direct = row["via"], row["direct"]
                hop_p50, hop_mean = via["median"] - direct["median"], via["mean"] - direct["mean"]
                print(
                    f"round {round_} {kind:<7} via: TTFT p50 {via['median']:5.1f} mean "
                    f"{via['mean']:5.1f} ms | direct, its ranks: p50 {direct['median']:5.1f} "
                    f"mean {direct['mean']:5.1f} ms | hop p50 {hop_p50:+.1f} mean {hop_mean:+.1f}"
                    f" ms | cached {via['cached_tokens']} / {direct['cached_tokens']}",
                    flush=True,
                )
    print(f"\n{args.simulate}, zipf, {args.zipf_prompts} prompts at {args.zipf_concurrency}, "
          f"{args.rounds} round(s), means over rounds (ms):")  # fmt: skip
    print("| router | via: TTFT p50 | mean | direct at its ranks: p50 | mean | hop: p50 | mean |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for kind in args.targets:
        mine = [r for r in rows if r["target"] == kind]

        def m(side, key, mine=mine):
            return statistics.mean(r[side][key] for r in mine)

        print(f"| {kind} | {m('via', 'median'):.1f} | {m('via', 'mean'):.1f} | "
              f"{m('direct', 'median'):.1f} | {m('direct', 'mean'):.1f} | "
              f"{m('via', 'median') - m('direct', 'median'):+.1f} | "
              f"{m('via', 'mean') - m('direct', 'mean'):+.1f} |")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
