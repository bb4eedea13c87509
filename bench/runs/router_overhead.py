"""Router overhead: what a request pays for going through a router, with no model behind it.

A zero-work stand-in upstream (harness/standin.py: fixed small JSON, instantly; dp_size 4)
is measured directly, through our router (``runrouter --dp-aware``, cache_aware and round_robin)
and through SGLang's router (``sglang-router launch --dp-aware --policy round_robin``), with ``wrk``
sending non-streaming ``/v1/completions`` at a few connection counts. Reported: p50 / p99 latency
and requests/s; goals: <= 1 ms added p50 over direct, >= 0.5x sglang-router's requests/s.

    python bench/runs/router_overhead.py [--duration 10] [--connections 1 32] [--json out.json]
        [--tokenizer-path DIR]  # also run our cache_aware router tokenizing every prompt (as it
                                # does for our own engines; the stand-in alone gets text digests)
        [--profile DIR]         # record py-spy flame graphs of our router under the largest load
        [--processes N]         # also N cache_aware router processes sharing index and load through
                                # Redis (--redis-url) and one database, each driven by its own wrk
                                # with connections/N; reported as their sum
        [--workers N]           # also one runrouter --workers N (needs Redis)
        [--bare]                # also a bare proxy on the router's own server stack and HTTP client
                                # (harness/bare_proxy.py: no JSON, no decision): the stack's floor
        [--rounds N]            # the whole pass N times, interleaved (the order reversed every
                                # other round); each figure the median of its N

Each server under test also reports its CPU per request (user + system of its process tree
over a wrk run, over the requests it served). Only one server under test runs at a time (the
stand-in runs throughout), started afresh in each round. With ``--rounds`` a run's figures hold
up better against the host's drift (at one connection the routers add a tenth of a
millisecond, and a single pass moved sglang-router's figure by ±10 % between runs). Needs
``wrk`` on PATH; ``--profile`` needs ``py-spy`` (and no ``--rounds``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import NamedTuple

import httpx

if __package__ in (None, ""):  # run as a script: python bench/runs/router_overhead.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.runs.routers_at_fleet_scale import cpu_seconds  # noqa: E402
from harness.procs import REPO_ROOT as REPO
from harness.procs import free_port, router_command, sglang_router_command, start  # noqa: E402  # noqa: E402

MODEL = "standin"
PROMPT = ("You are a helpful assistant. Summarise the following notes in two sentences. " * 13)[
    :1000
]

WRK_SCRIPT = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = %(body)s

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRK_JSON {"requests": %%d, "duration_us": %%d, ' ..
    '"p50_us": %%d, "p90_us": %%d, "p99_us": %%d, ' ..
    '"mean_us": %%.1f, "errors": %%d, "non_2xx": %%d}\\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(90),
    latency:percentile(99), latency.mean, e.connect + e.read + e.write + e.timeout, e.status))
end
"""


@contextmanager
def server(cmd: list[str], ready_url: str, log: Path, env: dict | None = None):
    """Run ``cmd`` until the block ends; yields once ``ready_url`` answers 200 (for a router: it
    has discovered the stand-in)."""
    with start(cmd, ready_url, log, health="", timeout=60.0, env=env) as process:
        yield process.proc


def wrk_command(url: str, connections: int, duration: int, script: Path) -> list[str]:
    """One wrk thread, ``connections`` connections, non-streamed completions from ``script``."""
    return ["wrk", "-t1", f"-c{connections}", f"-d{duration}s", "--timeout", "10s",
            "-s", str(script), url + "/v1/completions"]  # fmt: skip


def wrk(url: str, connections: int, duration: int, script: Path) -> dict:
    cmd = wrk_command(url, connections, duration, script)
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    line = next(ln for ln in out.splitlines() if ln.startswith("WRK_JSON "))
    result = json.loads(line.removeprefix("WRK_JSON "))
    result["rps"] = result["requests"] / (result["duration_us"] / 1e6)
    return result


def wrk_many(urls: list[str], connections: int, duration: int, script: Path) -> dict:
    """One wrk per URL at once (the connections split between them), summed: requests/s add up,
    and the latency reported is the worst of the runs' percentiles (they cannot be merged)."""
    share = [
        connections // len(urls) + (1 if i < connections % len(urls) else 0)
        for i in range(len(urls))
    ]
    cmds = [
        wrk_command(url, max(1, c), duration, script) for url, c in zip(urls, share, strict=True)
    ]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) for cmd in cmds]
    runs = []
    for proc in procs:
        out, _ = proc.communicate()
        line = next(ln for ln in out.splitlines() if ln.startswith("WRK_JSON "))
        runs.append(json.loads(line.removeprefix("WRK_JSON ")))
    result = {
        key: max(r[key] for r in runs) for key in ("p50_us", "p90_us", "p99_us", "duration_us")
    }
    result.update({key: sum(r[key] for r in runs) for key in ("requests", "errors", "non_2xx")})
    result["mean_us"] = sum(r["mean_us"] * r["requests"] for r in runs) / max(1, result["requests"])
    result["rps"] = sum(r["requests"] / (r["duration_us"] / 1e6) for r in runs)
    return result


def check_once(url: str) -> None:
    r = httpx.post(
        url + "/v1/completions",
        json={"model": MODEL, "prompt": PROMPT, "max_tokens": 8},
        timeout=10,
    )
    r.raise_for_status()
    assert r.json()["choices"], r.text


def report(name: str, connections: int, r: dict) -> dict:
    """Print one measurement's line and return it labelled."""
    r.update(target=name, connections=connections)
    cpu = f"  CPU {r['cpu_us']:6.1f} us/req" if r.get("cpu_us") is not None else ""
    print(
        f"{name:28s} c={connections:<3d} p50 {r['p50_us'] / 1000:7.2f} ms  "
        f"p99 {r['p99_us'] / 1000:7.2f} ms  "
        f"{r['rps']:8.0f} req/s{cpu}  errors {r['errors']} non-2xx {r['non_2xx']}",
        flush=True,
    )
    return r


class Target(NamedTuple):
    """One server under test: its label, its URL (or the URLs of several processes, each driven
    by its own wrk), the process whose tree's CPU is counted, and the one py-spy records."""

    name: str
    url: str | list[str]
    pid: int | None = None
    profile_pid: int | None = None


def warm(target: Target, script: Path) -> None:
    """One request checked, then a short run: connections, the tokenizer and index paths."""
    for one in [target.url] if isinstance(target.url, str) else target.url:
        check_once(one)
        wrk(one, 1, 2, script)


def measure_once(target: Target, connections: int, args, script: Path) -> dict | None:
    """One wrk run against ``target`` at ``connections`` (None: a multi-process target with
    fewer connections than processes); its CPU per request when it has a ``pid``."""
    urls = [target.url] if isinstance(target.url, str) else target.url
    if len(urls) > 1:
        if connections < len(urls):
            return None
        return wrk_many(urls, connections, args.duration, script)
    spy = None
    if target.profile_pid and connections == max(args.connections):
        raw = args.profile_format == "raw"  # collapsed stacks, for reading off self time
        out = Path(args.profile) / f"{target.name.replace(' ', '_')}.{'txt' if raw else 'svg'}"
        spy = subprocess.Popen(
            ["py-spy", "record", "--pid", str(target.profile_pid), "--duration",
             str(args.duration), "--rate", "200",
             *(["--native"] if args.profile_native else ["--nonblocking"]),
             "--format", "raw" if raw else "flamegraph", "--output", str(out)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
    cpu = cpu_seconds(target.pid) if target.pid else None
    r = wrk(urls[0], connections, args.duration, script)
    if cpu is not None:
        r["cpu_us"] = 1e6 * (cpu_seconds(target.pid) - cpu) / max(1, r["requests"])
    if spy:
        spy.wait(60)
    return r


def measure(target: Target, args, script: Path, results: list) -> None:
    """wrk against ``target`` at each connection count, one after the other."""
    warm(target, script)
    for c in args.connections:
        r = measure_once(target, c, args, script)
        if r is not None:
            results.append(report(target.name, c, r))


FIGURES = ("p50_us", "p90_us", "p99_us", "mean_us", "rps", "cpu_us")


def medians(runs: list[dict]) -> dict:
    """One result from several rounds' runs of the same target and connection count: the median
    of each figure (each on its own), the requests and errors summed."""
    out = {key: statistics.median(r[key] for r in runs) for key in FIGURES if key in runs[0]}
    out.update({key: sum(r[key] for r in runs) for key in ("requests", "errors", "non_2xx")})
    out["rounds"] = len(runs)
    return out


def run(args) -> list[dict]:
    tmp = Path(tempfile.mkdtemp(prefix="router_overhead-"))
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    script = tmp / "post.lua"
    script.write_text(WRK_SCRIPT % {"body": json.dumps(json.dumps(body))})
    standin_port = free_port()
    standin_url = f"http://127.0.0.1:{standin_port}"
    standin = [sys.executable, "-m", "harness.standin", "--port", str(standin_port),
               "--dp-size", "4", "--model", MODEL]  # fmt: skip
    groups = [ours_targets]
    if args.processes > 1:
        groups.append(processes_targets)
    if args.workers > 1:
        groups.append(workers_targets)
    if args.bare:
        groups.append(bare_targets)
    groups.append(sglang_targets)
    with server(
        standin, standin_url + "/health", tmp / "standin.log", env={"PYTHONPATH": str(REPO)}
    ):
        direct = Target("direct (stand-in)", standin_url)
        if args.rounds > 1:
            return interleaved(args, [direct], groups, standin_url, tmp, script)
        results: list[dict] = []
        measure(direct, args, script, results)
        for group in groups:  # one server under test at a time
            with ExitStack() as stack:
                for target in group(args, standin_url, tmp, stack):
                    measure(target, args, script, results)
        return results


def interleaved(args, targets, groups, standin_url: str, tmp: Path, script: Path) -> list[dict]:
    """``--rounds``: each round starts each server under test in turn (one at a time, as a single
    pass does; the order reversed every other round) and runs it at each connection count, so
    that the host's drift over the minutes falls on all of them alike; each figure reported is
    its median over the rounds."""
    runs: dict[tuple[str, int], list[dict]] = {}
    names: list[str] = []

    def measured(target: Target, round_: int) -> None:
        warm(target, script)
        if target.name not in names:
            names.append(target.name)
        for c in args.connections:
            r = measure_once(target, c, args, script)
            if r is not None:
                runs.setdefault((target.name, c), []).append(r)
                report(f"{target.name} [{round_ + 1}]", c, dict(r))

    steps = [None, *groups]  # None: the stand-in direct (it runs throughout)
    for round_ in range(args.rounds):
        for step in steps if round_ % 2 == 0 else steps[::-1]:
            if step is None:
                for target in targets:
                    measured(target, round_)
                continue
            with ExitStack() as stack:
                for target in step(args, standin_url, tmp, stack):
                    measured(target, round_)
    print(f"medians over {args.rounds} rounds:", flush=True)
    return [report(name, c, medians(runs[(name, c)]))
            for c in args.connections for name in names if (name, c) in runs]  # fmt: skip


def ours_targets(args, standin_url: str, tmp: Path, stack: ExitStack) -> list[Target]:
    """One router process per policy and ASGI server (``--servers``), then (``--tokenizer-path``)
    cache_aware tokenizing."""
    targets = []
    for policy in args.policies:
        for name in args.servers:
            port = free_port()
            cmd = router_command(standin_url, "--server", name, port=port, policy=policy)
            env = {"DATABASE_URL": f"sqlite:///{tmp / f'router-{policy}-{name}.sqlite3'}"}
            url = f"http://127.0.0.1:{port}"
            log = tmp / f"router-{policy}-{name}.log"
            label = f"dpmesh router {policy}" + (f" ({name})" if len(args.servers) > 1 else "")
            proc = stack.enter_context(server(cmd, url + "/health", log, env=env))
            targets.append(Target(label, url, proc.pid, proc.pid if args.profile else None))
    if args.tokenizer_path:
        port = free_port()
        cmd = router_command(
            standin_url, "--tokenizer-path", args.tokenizer_path, port=port, policy="cache_aware"
        )
        env = {"DATABASE_URL": f"sqlite:///{tmp / 'router-tokenizer.sqlite3'}"}
        url = f"http://127.0.0.1:{port}"
        stack.enter_context(server(cmd, url + "/health", tmp / "router-tokenizer.log", env=env))
        targets.append(Target("dpmesh router cache_aware+tok", url))
    return targets


def sglang_targets(args, standin_url: str, tmp: Path, stack: ExitStack) -> list[Target]:
    """SGLang's router, one process per ``--sglang-policies`` policy (none when not installed)."""
    exe = shutil.which("sglang-router", path=str(Path(sys.executable).parent)) or shutil.which(
        "sglang-router"
    )
    targets = []
    for policy in args.sglang_policies if exe else []:
        port = free_port()
        cmd = sglang_router_command(standin_url, port=port, policy=policy, exe=exe)
        url = f"http://127.0.0.1:{port}"
        proc = stack.enter_context(server(cmd, url + "/health", tmp / f"sglang-{policy}.log"))
        targets.append(Target(f"sglang-router {policy}", url, proc.pid))
    return targets


def workers_targets(args, standin_url: str, tmp: Path, stack: ExitStack) -> list[Target]:
    """One ``runrouter --workers N`` (cache_aware): N processes on one port, sharing through
    Redis."""
    import redis

    redis.Redis.from_url(args.redis_url).flushdb()
    env = {
        "DATABASE_URL": args.database_url or f"sqlite:///{tmp / 'router-workers.sqlite3'}",
        "REDIS_URL": args.redis_url,
    }
    port = free_port()
    cmd = router_command(
        standin_url, "--workers", str(args.workers), port=port, policy="cache_aware"
    )
    url = f"http://127.0.0.1:{port}"
    label = f"dpmesh router cache_aware --workers {args.workers}"
    proc = stack.enter_context(server(cmd, url + "/health", tmp / "router-workers.log", env=env))
    return [Target(label, url, proc.pid)]  # the workers are its children


def bare_targets(args, standin_url: str, tmp: Path, stack: ExitStack) -> list[Target]:
    """harness/bare_proxy.py: the router's server stack and HTTP client, none of its work."""
    port = free_port()
    cmd = [sys.executable, "-m", "harness.bare_proxy", "--port", str(port),
           "--upstream", standin_url]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    env = {"PYTHONPATH": str(REPO)}
    proc = stack.enter_context(server(cmd, url + "/health", tmp / "bare.log", env=env))
    return [Target("bare proxy (router's stack)", url, proc.pid)]


def processes_targets(args, standin_url: str, tmp: Path, stack: ExitStack) -> list[Target]:
    """``args.processes`` cache_aware routers on one database and one Redis (index and load
    shared)."""
    import redis

    redis.Redis.from_url(args.redis_url).flushdb()
    env = {
        "DATABASE_URL": args.database_url or f"sqlite:///{tmp / 'router-processes.sqlite3'}",
        "REDIS_URL": args.redis_url,
    }
    subprocess.run(
        [sys.executable, "manage.py", "migrate", "--noinput"],
        cwd=REPO,
        env={**os.environ, **env},
        check=True,
        capture_output=True,
    )
    urls = []
    for i in range(args.processes):
        port = free_port()
        cmd = router_command(standin_url, port=port, policy="cache_aware")
        url = f"http://127.0.0.1:{port}"
        stack.enter_context(server(cmd, url + "/health", tmp / f"router-process-{i}.log", env=env))
        urls.append(url)
    return [Target(f"dpmesh router cache_aware x{args.processes} processes", urls)]


def summary(results: list[dict]) -> str:
    """A markdown table with the added p50 over direct (to the microsecond: at one connection
    the routers add a tenth of a millisecond) and its ratio, the throughput and CPU ratios to
    sglang-router (its cache_aware run, else its round_robin one)."""
    direct = {r["connections"]: r for r in results if r["target"].startswith("direct")}
    sglang = {}
    for policy in ("round_robin", "cache_aware"):  # cache_aware wins where both ran
        sglang.update(
            {r["connections"]: r for r in results if r["target"] == f"sglang-router {policy}"}
        )
    lines = [
        "| target | conns | p50 ms | p99 ms | req/s | added p50 ms | added p50 vs sglang-router "
        "| req/s vs sglang-router | CPU us/req | CPU vs sglang-router |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    nan = float("nan")
    for r in results:
        c = r["connections"]
        added = (r["p50_us"] - direct[c]["p50_us"]) / 1000 if c in direct else nan
        peer = (sglang[c]["p50_us"] - direct[c]["p50_us"]) / 1000 if c in sglang else nan
        added_ratio = added / peer if peer and peer > 0 else nan
        ratio = r["rps"] / sglang[c]["rps"] if c in sglang else nan
        cpu = r.get("cpu_us")
        theirs = sglang[c].get("cpu_us") if c in sglang else None
        cpu_ratio = cpu / theirs if cpu is not None and theirs else nan
        lines.append(
            f"| {r['target']} | {c} | {r['p50_us'] / 1000:.2f} | {r['p99_us'] / 1000:.2f} "
            f"| {r['rps']:.0f} | {added:+.3f} | {added_ratio:.2f}x | {ratio:.2f}x "
            f"| {'' if cpu is None else f'{cpu:.1f}'} | {cpu_ratio:.2f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=int, default=10, help="seconds per wrk run")
    parser.add_argument("--connections", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--policies", nargs="+", default=["cache_aware", "round_robin"])
    parser.add_argument(
        "--servers", nargs="+", default=["uvicorn"], choices=["uvicorn", "daphne"],
        help="the ASGI servers to run our router under (runrouter --server)",
    )  # fmt: skip
    parser.add_argument("--sglang-policies", nargs="*", default=["round_robin", "cache_aware"])
    parser.add_argument(
        "--tokenizer-path",
        help="a tokenizer directory (e.g. the tiny model's) for an extra "
        "cache_aware run with token digests",
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        help="also run this many cache_aware router processes sharing index and load (Redis)",
    )
    parser.add_argument(
        "--redis-url", default="redis://127.0.0.1:6379/14", help="for --processes (flushed)"
    )
    parser.add_argument("--database-url", help="for --processes (default: a shared SQLite file)")
    parser.add_argument(
        "--workers", type=int, default=1, help="also one runrouter --workers N (needs Redis)"
    )
    parser.add_argument(
        "--bare",
        action="store_true",
        help="also a bare proxy on the router's own stack (harness/bare_proxy.py): its floor",
    )
    parser.add_argument(
        "--rounds", type=int, default=1,
        help="the whole pass this many times, interleaved; each figure's median reported",
    )  # fmt: skip
    parser.add_argument("--json", help="write the raw results here")
    parser.add_argument(
        "--profile", help="directory for py-spy flame graphs of our router (largest load)"
    )
    parser.add_argument(
        "--profile-format",
        choices=["flamegraph", "raw"],
        default="flamegraph",
        help="py-spy's output: an SVG, or collapsed stacks (one line per stack, with its count)",
    )
    parser.add_argument(
        "--profile-native",
        action="store_true",
        help="py-spy --native: C frames too (uvloop's, httptools'), the process paused per sample",
    )
    args = parser.parse_args(argv)
    if not shutil.which("wrk"):
        print("wrk is not installed (apt-get install wrk)", file=sys.stderr)
        return 2
    if args.profile and args.rounds > 1:
        print("--profile records one pass: leave out --rounds", file=sys.stderr)
        return 2
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    results = run(args)
    print()
    print(summary(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
