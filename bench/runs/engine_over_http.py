"""The "Engine behind HTTP" benchmarks of docs/benchmarks.md, start to finish::

    python -m bench.runs.engine_over_http --repeats 3 --out var/bench

The default workload (``random``: 64 prompts of 128 tokens, 64 output tokens, greedy, exact
lengths; ``--workload prefix_repetition``: 5 prefixes of 512 tokens, 128-token suffixes, 16
output tokens, HTTP targets only) at concurrency 1 and 16 against:

* ``inprocess``      -- ``LLMEngine`` driven in this process (``bench.runs.serving_overhead``);
* ``engine-ids``     -- ``manage.py runengine --dp-size 1``, prompts as token-id lists;
* ``engine-text``    -- the same server, prompts as text (tokenized by the server);
* ``tf-serve-text``  -- ``transformers serve --continuous-batching`` on the same model, text
  prompts (it takes no id lists). It rejects ``ignore_eos``, so exact lengths come from a
  per-request ``generation_config`` with ``eos_token_id: -1`` (its CB manager then stops only
  at ``max_tokens``).

All targets run side by side (an idle one costs next to nothing) and each gets a warm-up on other
prompts first. Repeat i runs every target at every concurrency c with seed 100 i + c (fresh
prompts: no prefix hits across runs; each target has its own server), targets back to back, so load
from other processes on a shared host hits the targets of one repeat alike: the a/b ratios are
taken repeat by repeat. The table shows the best and the median run (outside load only ever slows a
run down, so the best is the closest to the uncontended figure) and the 1-minute load average at
the start of each run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import sys
from pathlib import Path

from bench.cli import build_parser, run
from bench.runs import serving_overhead
from harness.procs import free_port, start

REPO_ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = {
    "random": [
        "--dataset-name",
        "random",
        "--random-input-len",
        "128",
        "--random-output-len",
        "64",
    ],
    # vLLM's prefix_repetition shape with short outputs: what a prefix cache saves shows in TTFT.
    "prefix_repetition": [
        "--dataset-name",
        "prefix_repetition",
        "--prefix-repetition-prefix-len",
        "512",
        "--prefix-repetition-suffix-len",
        "128",
        "--prefix-repetition-num-prefixes",
        "5",
        "--prefix-repetition-output-len",
        "16",
    ],
}
TF_BODY = json.dumps({"generation_config": json.dumps({"do_sample": False, "eos_token_id": -1})})


@contextlib.contextmanager
def server(
    cmd: list[str], url: str, log_path: Path, timeout: float = 300.0, env: dict | None = None
):
    """Run ``cmd`` until the block ends; yields once ``url/health`` answers 200. Stopped with
    SIGTERM, not SIGINT: a shell's background job passes SIGINT on ignored."""
    with start(cmd, url, log_path, timeout=timeout, env=env, stop_signal=signal.SIGTERM) as process:
        yield process.proc


def bench_once(url: str, flags: list[str], json_path: Path) -> dict:
    """One ``python -m bench`` run, in this process, its table sent to a log next to the JSON."""
    args = build_parser().parse_args(
        ["--base-url", url, *flags, "--disable-tqdm", "--json", str(json_path)]
    )
    load = os.getloadavg()[0]
    with open(json_path.with_suffix(".txt"), "w") as out, contextlib.redirect_stdout(out):
        summary = run(args)["summary"]
    return {**summary, "load_avg_1m": load}


def cpu_seconds(pid: int, children: bool = True) -> float:
    """User + system CPU time of a process and (by default) all its children (rank processes)."""
    import psutil

    root = psutil.Process(pid)
    total = 0.0
    for proc in [root, *(root.children(recursive=True) if children else [])]:
        with contextlib.suppress(psutil.NoSuchProcess):
            times = proc.cpu_times()
            total += times.user + times.system
    return total


def with_cpu(summary: dict, cpu_s: float) -> dict:
    """Server CPU per output token: moved less than wall-clock figures by other load on the host
    (not immune: torch's worker threads spin while they wait for a descheduled peer)."""
    tokens = summary["total_output_tokens"]
    return {
        **summary,
        "server_cpu_s": cpu_s,
        "cpu_ms_per_output_token": 1000 * cpu_s / tokens if tokens else None,
    }


class HttpTarget:
    """A running server plus the bench flags it needs."""

    def __init__(
        self, name: str, url: str, flags: list[str], out: Path, pid: int, workload: list[str]
    ):
        self.name, self.url, self.flags, self.out, self.pid = name, url, flags, out, pid
        self.workload = workload

    def warm_up(self) -> None:
        self.once(8, 8, 1000, "warmup")

    def once(self, num_prompts: int, conc: int, seed: int, tag: str) -> dict:
        flags = [
            *self.flags,
            *self.workload,
            "--num-prompts",
            str(num_prompts),
            "--max-concurrency",
            str(conc),
            "--seed",
            str(seed),
        ]
        before = cpu_seconds(self.pid)
        summary = bench_once(self.url, flags, self.out / f"{self.name}-{tag}.json")
        return with_cpu(summary, cpu_seconds(self.pid) - before)


class InProcessTarget:
    """``LLMEngine`` in this process, fed the same prompts as the HTTP targets."""

    name = "inprocess"

    def __init__(self, threads: int | None, out: Path):
        extra = ["--threads", str(threads)] if threads else []
        self.args = serving_overhead.build_parser().parse_args(extra)
        self.engine = serving_overhead.make_engine(self.args)
        self.out = out

    def warm_up(self) -> None:
        self.once(8, 8, 1000, "warmup")

    def once(self, num_prompts: int, conc: int, seed: int, tag: str) -> dict:
        from bench.summary import summarize

        self.args.num_prompts = num_prompts
        samples = serving_overhead.workload(self.args, self.engine.tokenizer, seed)
        # This process only: the servers are its children and must not count here.
        load, before = os.getloadavg()[0], cpu_seconds(os.getpid(), children=False)
        results, duration = serving_overhead.drive(self.engine, samples, conc)
        cpu = cpu_seconds(os.getpid(), children=False) - before
        summary = with_cpu({**summarize(results, duration), "load_avg_1m": load}, cpu)
        (self.out / f"{self.name}-{tag}.json").write_text(json.dumps(summary, indent=2))
        return summary


def measure(targets: list, args) -> dict[tuple[str, int], list[dict]]:
    """Repeat i runs every target at every concurrency, targets back to back, so a burst of load
    from elsewhere hits the targets of one repeat alike (the ratios stay paired)."""
    runs: dict[tuple[str, int], list[dict]] = {}
    for target in targets:
        target.warm_up()
    for i in range(args.repeats):
        for conc in args.concurrency:
            for target in targets:
                # A seed per (repeat, concurrency): a server never sees a prompt twice, so no run
                # is helped by the prefix cache of an earlier one (--workload prefix_repetition
                # shares within a run).
                summary = target.once(args.num_prompts, conc, 100 * i + conc, f"c{conc}-r{i}")
                runs.setdefault((target.name, conc), []).append(summary)
                print(
                    f"repeat {i} c={conc} {target.name}: {summary['output_throughput']:.0f} tok/s, "
                    f"TTFT p50 {summary['ttft_ms']['median']:.1f} ms, "
                    f"load {summary['load_avg_1m']:.2f}",
                    file=sys.stderr,
                    flush=True,
                )
    return runs


def cell(name: str, conc: int, runs: list[dict]) -> dict:
    """Best and median of the repeats for the table."""
    tput = [r["output_throughput"] for r in runs]
    ttft = [r["ttft_ms"]["median"] for r in runs]
    best = max(runs, key=lambda r: r["output_throughput"])
    return {
        "target": name,
        "concurrency": conc,
        "runs": len(runs),
        "failed": sum(r["failed"] for r in runs),
        "cached_tokens": [r["cached_tokens"] for r in runs],
        "output_tok_s": tput,
        "ttft_p50_ms": ttft,
        "output_tok_s_best": max(tput),
        "output_tok_s_median": statistics.median(tput),
        "ttft_p50_ms_best": min(ttft),
        "ttft_p50_ms_median": statistics.median(ttft),
        "ttft_p99_ms_of_best": best["ttft_ms"]["p99"],
        "tpot_p50_ms_of_best": best["tpot_ms"]["median"],
        "load_avg_1m": [round(r["load_avg_1m"], 2) for r in runs],
        "cpu_ms_per_token": [r["cpu_ms_per_output_token"] for r in runs],
        "cpu_ms_per_token_median": statistics.median(r["cpu_ms_per_output_token"] for r in runs),
    }


def ratios(rows: list[dict], a: str, b: str) -> list[dict]:
    """Per concurrency, a/b of throughput and of TTFT p50, repeat by repeat (median reported)."""
    by = {(r["target"], r["concurrency"]): r for r in rows}
    out = []
    for (name, conc), ra in by.items():
        rb = by.get((b, conc))
        if name != a or rb is None:
            continue
        tput = [x / y for x, y in zip(ra["output_tok_s"], rb["output_tok_s"], strict=True) if y]
        ttft = [x / y for x, y in zip(ra["ttft_p50_ms"], rb["ttft_p50_ms"], strict=True) if y]
        cpu = [
            x / y for x, y in zip(ra["cpu_ms_per_token"], rb["cpu_ms_per_token"], strict=True) if y
        ]
        out.append(
            {
                "a": a,
                "b": b,
                "concurrency": conc,
                "throughput_ratio_median": statistics.median(tput),
                "throughput_ratios": tput,
                "ttft_p50_ratio_median": statistics.median(ttft),
                "ttft_p50_ratios": ttft,
                "cpu_per_token_ratio_median": statistics.median(cpu),
            }
        )
    return out


def markdown(rows: list[dict], pairs: list[dict]) -> str:
    lines = [
        "| target | conc | output tok/s best (median) | TTFT p50 ms best (median) | TTFT p99 ms* "
        "| TPOT p50 ms* | server CPU ms / output token (median) | cached tokens per run | failed "
        "| load avg 1m per run |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['target']} | {r['concurrency']} | {r['output_tok_s_best']:.0f} "
            f"({r['output_tok_s_median']:.0f}) | {r['ttft_p50_ms_best']:.1f} "
            f"({r['ttft_p50_ms_median']:.1f}) "
            f"| {r['ttft_p99_ms_of_best']:.1f} | {r['tpot_p50_ms_of_best']:.1f} "
            f"| {r['cpu_ms_per_token_median']:.2f} | {', '.join(map(str, r['cached_tokens']))} "
            f"| {r['failed']} | {', '.join(map(str, r['load_avg_1m']))} |"
        )
    lines += [
        "",
        "*: of the best-throughput run.",
        "",
        "| a / b | conc | throughput a/b (per repeat) "
        "| TTFT p50 a/b (per repeat) | CPU per token a/b |",
        "|---|---|---|---|---|",
    ]
    for p in pairs:
        lines.append(
            f"| {p['a']} / {p['b']} | {p['concurrency']} | {p['throughput_ratio_median']:.2f} "
            f"({', '.join(f'{x:.2f}' for x in p['throughput_ratios'])}) "
            f"| {p['ttft_p50_ratio_median']:.2f} "
            f"({', '.join(f'{x:.2f}' for x in p['ttft_p50_ratios'])}) "
            f"| {p['cpu_per_token_ratio_median']:.2f} |"
        )
    return "\n".join(lines)


def start_targets(stack: contextlib.ExitStack, args, out: Path, model: str) -> list:
    targets, workload = [], WORKLOADS[args.workload]
    if "inprocess" in args.targets:
        if args.workload != "random":
            raise SystemExit("the in-process target runs the random workload only")
        targets.append(InProcessTarget(args.threads, out))
    # one server per prompt format: the two must not warm each other's cache
    if "engine" in args.targets:
        threads = ["--threads-per-rank", str(args.threads)] if args.threads else []
        for name, flags in (("engine-ids", []), ("engine-text", ["--prompt-format", "text"])):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            proc = stack.enter_context(
                server(
                    [
                        sys.executable,
                        "manage.py",
                        "runengine",
                        "--dp-size",
                        "1",
                        "--port",
                        str(port),
                        *threads,
                    ],
                    url,
                    out / f"{name}.log",
                )
            )
            targets.append(HttpTarget(name, url, flags, out, proc.pid, workload))
    if "tf-serve" in args.targets:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        # Its CB cache takes 60 % of free RAM on a CPU by default (11 GB RSS here); give it our KV
        # capacity instead: 2730 blocks of 16 tokens, what runengine's default 256 MiB pool holds
        # for this model.
        cmd = [
            str(Path(sys.executable).with_name("transformers")),
            "serve",
            "--continuous-batching",
            "--cb-block-size",
            "16",
            "--cb-num-blocks",
            "2730",
            "--device",
            "cpu",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            model,
        ]
        # torch's intra-op pool size
        env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else None
        proc = stack.enter_context(server(cmd, url, out / "tf-serve.log", env=env))
        flags = [
            "--model",
            model,
            "--tokenizer",
            model,
            "--prompt-format",
            "text",
            "--no-ignore-eos",
            "--extra-body",
            TF_BODY,
        ]
        targets.append(HttpTarget("tf-serve-text", url, flags, out, proc.pid, workload))
    return targets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bench.runs.engine_over_http", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--workload", default="random", choices=sorted(WORKLOADS))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--targets", nargs="+", default=["inprocess", "engine", "tf-serve"])
    parser.add_argument("--out", default="var/bench")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads for every target (default: each its own default, all cores)",
    )
    args = parser.parse_args(argv)
    # unwind, so the servers it started are stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from engine.tiny import ensure_tiny_model

    with contextlib.ExitStack() as stack:
        runs = measure(start_targets(stack, args, out, str(ensure_tiny_model())), args)
    rows = [cell(name, conc, r) for (name, conc), r in runs.items()]
    pairs = ratios(rows, "engine-ids", "inprocess") + ratios(rows, "engine-text", "tf-serve-text")
    (out / "suite.json").write_text(json.dumps({"rows": rows, "pairs": pairs}, indent=2))
    print(markdown(rows, pairs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
