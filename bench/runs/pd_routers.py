"""Routers in front of one prefill/decode-disaggregated fleet of our engine, in one run: ours
(``runrouter --pd-disaggregation``: ``dpmesh`` as a user runs it, ``--pd-protocol auto``, which is
SGLang's one step for our engine in both roles; ``dpmesh-vllm`` with vLLM's two steps;
``dpmesh-sglang`` names the one step explicitly), sglang-router 0.3.2
(``--pd-disaggregation``) and vllm-router 0.1.17 (``--vllm-pd-disaggregation --kv-connector
nixl``), all cache_aware.

One prefill worker and one decode worker (``--dp-size`` each, the tiny model) serve every
target; each target and concurrency gets prefixes of its own (fresh seeds: no router profits
from another's caching), targets interleaved round by round, each round starting with another,
after an unreported warm-up cell at each concurrency. Reported per run: the prefill
side's hits (its engine's cached tokens over what one unbounded cache would have had under the
engine's block rules: bench/oracle.py), the KV the decode side pulled (a decode rank that
already holds more of a prompt pulls less), TTFT mean / p50 / p99 at the client, and the run's
total time.

    .venv/bin/python -m bench.runs.pd_routers [--rounds 2] [--concurrency 1 8] [--dp-size 2]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

from bench import datasets, engine_metrics
from bench.oracle import oracle_cached
from bench.runner import RunOptions, send_samples
from bench.runs.routers_on_our_engine import tokenizer
from bench.summary import distribution_ms
from harness.procs import free_port, metrics, router_command, start, start_engine

TARGETS = ("dpmesh", "dpmesh-vllm", "dpmesh-sglang", "sglang-router", "vllm-router")
DEFAULT_TARGETS = ("dpmesh", "dpmesh-vllm", "sglang-router", "vllm-router")


def target_cmd(name: str, prefill, decode, port: int, bootstrap: int) -> list[str]:
    exe = lambda n: shutil.which(n, path=str(Path(sys.executable).parent))  # noqa: E731
    if name.startswith("dpmesh"):
        protocol = {"dpmesh": "auto", "dpmesh-vllm": "vllm", "dpmesh-sglang": "sglang"}[name]
        return router_command([], "--pd-disaggregation", "--prefill", prefill.url, "--decode",
                              decode.url, "--pd-protocol", protocol, port=port,
                              policy="cache_aware")  # fmt: skip
    if name == "sglang-router":
        return [exe("sglang-router"), "launch", "--host", "127.0.0.1", "--port", str(port),
                "--pd-disaggregation", "--prefill", prefill.url, str(bootstrap), "--decode",
                decode.url, "--policy", "cache_aware", "--log-level", "warn",
                "--prometheus-port", str(free_port())]  # fmt: skip
    return [exe("vllm-router"), "--host", "127.0.0.1", "--port", str(port),
            "--vllm-pd-disaggregation", "--kv-connector", "nixl", "--prefill", prefill.url,
            "--decode", decode.url, "--policy", "cache_aware",
            "--prometheus-port", str(free_port())]  # fmt: skip


def workload(tok, seed: int, args):
    allowed = datasets.allowed_token_ids(len(tok), tok)
    return datasets.prefix_repetition(
        num_prompts=args.num_prompts, prefix_len=args.prefix_len, suffix_len=args.suffix_len,
        num_prefixes=args.num_prefixes, output_len=args.output_len, seed=seed, allowed=allowed,
        tokenizer=tok, as_text=True,
    )  # fmt: skip


async def measure(prefill, decode, url: str, samples, conc: int):
    before = [await engine_metrics.scrape(e.url + "/metrics") for e in (prefill, decode)]
    pulled = _pulled(decode.url)
    opts = RunOptions(base_url=url, model="tiny", max_concurrency=conc, progress=False)
    run = await send_samples(opts, samples)
    await asyncio.sleep(0.5)  # the ranks report every 0.25 s
    after = [await engine_metrics.scrape(e.url + "/metrics") for e in (prefill, decode)]
    diffs = [engine_metrics.delta(b, a) for b, a in zip(before, after, strict=True)]
    return run, diffs, _pulled(decode.url) - pulled


def _pulled(url: str) -> float:
    """Bytes of KV the decode worker's ranks pulled so far."""
    found = metrics(url)
    return sum(v for (name, _), v in found.items() if name == "kv_transfer_bytes_pulled")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", nargs="+", default=list(DEFAULT_TARGETS),
                        choices=TARGETS)  # fmt: skip
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--dp-size", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--num-prefixes", type=int, default=20)
    parser.add_argument("--prefix-len", type=int, default=192)
    parser.add_argument("--suffix-len", type=int, default=48)
    parser.add_argument("--output-len", type=int, default=4)
    args = parser.parse_args(argv)
    tok = tokenizer()
    common = ("--dp-size", str(args.dp_size), "--num-kv-blocks", "2048",
              "--disaggregation-bootstrap-port", "0")  # fmt: skip
    print("| round | conc | target | prefill hits / oracle | KV pulled | TTFT mean "
          "| TTFT p50 | TTFT p99 | total | failed |")  # fmt: skip
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        tmp = Path(tmp)
        prefill, decode = (
            stack.enter_context(start_engine(tmp, *common, "--disaggregation-mode", m, name=m))
            for m in ("prefill", "decode")
        )
        bootstrap = engine_metrics_bootstrap(prefill.url)

        def cell(name: str, seed: int, conc: int):
            port = free_port()
            env = {"DATABASE_URL": f"sqlite:///{tmp}/{name}-{seed}.sqlite3"}
            cmd = target_cmd(name, prefill, decode, port, bootstrap)
            url = f"http://127.0.0.1:{port}"
            with start(cmd, url, tmp / f"{name}-{seed}.log", env=env, timeout=120):
                samples = workload(tok, seed, args)
                return samples, asyncio.run(measure(prefill, decode, url, samples, conc))

        # unreported: the engines' first batches at each concurrency (new shapes, first
        # allocations) are slower, and would be charged to whichever target came first
        for conc in args.concurrency:
            cell(args.targets[0], 900 + conc, conc)
        seed = 1000
        for rnd in range(args.rounds):
            turn = rnd % len(args.targets)  # each round starts with another target
            for conc in args.concurrency:
                for name in args.targets[turn:] + args.targets[:turn]:
                    seed += 1
                    samples, (run, (pdiff, _), pulled) = cell(name, seed, conc)
                    print(row(rnd, conc, name, run, pdiff, pulled, samples, tok), flush=True)


def engine_metrics_bootstrap(url: str) -> int:
    import httpx

    return httpx.get(url + "/server_info", timeout=10).json()["disaggregation_bootstrap_port"]


def row(rnd, conc, name, run, pdiff, pulled: float, samples, tok) -> str:
    ok = [r for r in run.results if r.ok]
    prompts = [tok.encode(s.prompt, add_special_tokens=False) for s in samples]
    oracle = sum(oracle_cached(prompts))
    p_cached = sum(pdiff.get("cached_tokens", {}).values())
    ttft = distribution_ms(r.ttft for r in ok)
    return (
        f"| {rnd + 1} | {conc} | {name} | {p_cached / max(1, oracle):.3f} | "
        f"{pulled / 2**20:.1f} MiB | {ttft['mean']:.1f} ms | {ttft['median']:.1f} ms "
        f"| {ttft['p99']:.0f} ms | {run.duration_s:.2f} s | {len(run.results) - len(ok)} |"
    )


if __name__ == "__main__":
    main()
