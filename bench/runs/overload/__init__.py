"""Issue 12's acceptance runs, on the simulated engine (``runengine --simulate``) over real HTTP
and real processes. Three parts, each printed as it ends:

* ``overload``: one engine at DP N behind a router with admission limits. The fleet's capacity is
  measured first (closed loop at ``--max-concurrent-requests`` = DP x ``--max-num-seqs``), then
  Poisson arrivals at ``--overload-factor`` (3) x that rate for ``--duration`` seconds: once per
  ``--queue-size`` (16: the queue fills, 429 ``queue_full``; 1000: requests wait out
  ``--queue-timeout-secs``, 429 ``timeout``), each on a fresh router, and once with admission off.
  Per run: sent, complete responses, 429s (and how many lacked ``Retry-After``), other errors,
  the admitted requests' TTFT against the bound (``--queue-timeout-secs`` + the closed-loop TTFT
  p99: the longest wait plus what an admitted request then takes), whether every request ended
  in a complete response or a 429, the engine's peak running / waiting, and the router's and the
  engine's in-flight / queue gauges after the run (all must be 0).
* ``streams``: ``--streams`` (1,000) concurrent streamed completions through one router to one
  engine, ``--streams-rounds`` (2) times: how many ended with ``[DONE]``, how many were open at
  once (client side, and the engine's running peak), the router's RSS before, at its peak
  (sampled every 0.1 s) and after each round (a leak grows round after round).
* ``memory``: ``--memory-workers`` (4) engines at DP ``--memory-dp-size`` (8) registered with one
  ``--dp-aware`` router; the router's RSS idle and after a few chat requests (target: 150 MB),
  and the engines' total RSS.

::

    .venv/bin/python -m bench.runs.overload [--parts overload streams memory] [--duration 30] \\
        [--dp-size 2] [--simulate a100-40gb-llama3.1-8b] [--max-num-seqs 4] [--policy P] \\
        [--queue-size 16 1000] [--no-admission-off] [--workdir DIR] [--json out.json]

Each part is its own module here (``admission``: the part ``overload``; ``streams``; ``memory``),
with what they share in ``common``.

Every process is this machine's: on a small host the client, the router and the engine's ranks
share the cores, so the capacity measured is this machine's, not the modelled GPU's (the
``--max-num-seqs`` default keeps the modelled engine, not the CPUs, the bottleneck).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
from pathlib import Path

from bench.runs.overload.admission import overload
from bench.runs.overload.memory import memory
from bench.runs.overload.streams import streams

PARTS = {"overload": overload, "streams": streams, "memory": memory}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bench.runs.overload",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS))
    parser.add_argument("--simulate", default="a100-40gb-llama3.1-8b")
    parser.add_argument("--simulate-speedup", type=float, default=1.0)
    parser.add_argument("--json", default=None, help="write every number here")
    parser.add_argument("--workdir", default=None, help="keep the servers' logs here")
    g = parser.add_argument_group("overload")
    g.add_argument("--dp-size", type=int, default=2)
    g.add_argument("--max-num-seqs", type=int, default=4, help="per rank, the engine's")
    g.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=0,
        help="the router's (default: dp-size x max-num-seqs)",
    )
    g.add_argument(
        "--queue-size",
        type=int,
        nargs="+",
        default=[16, 1000],
        help="one admission run per size (a short queue: 429 queue_full; a long one: timeouts)",
    )
    g.add_argument("--capacity-requests-per-slot", type=int, default=16)
    g.add_argument("--policy", default="cache_aware", help="the overload routers' --policy")
    g.add_argument(
        "--admission-off",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run the same load with admission off",
    )
    g.add_argument("--queue-timeout-secs", type=float, default=5.0)
    g.add_argument("--input-len", type=int, default=128)
    g.add_argument("--output-len", type=int, default=32)
    g.add_argument("--overload-factor", type=float, default=3.0)
    g.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals")
    g = parser.add_argument_group("streams")
    g.add_argument("--streams", type=int, default=1000)
    g.add_argument("--streams-dp-size", type=int, default=2)
    g.add_argument("--streams-simulate", default="h100-llama3.1-8b")
    g.add_argument("--streams-input-len", type=int, default=32)
    g.add_argument("--streams-output-len", type=int, default=256)
    g.add_argument("--streams-rounds", type=int, default=2)
    g.add_argument(
        "--streams-rate",
        type=float,
        default=float("inf"),
        help="arrivals per second (default: all at once)",
    )
    g = parser.add_argument_group("memory")
    g.add_argument("--memory-workers", type=int, default=4)
    g.add_argument("--memory-dp-size", type=int, default=8)
    g.add_argument("--memory-requests", type=int, default=32)
    g.add_argument("--memory-target-mib", type=float, default=150.0)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    results = {}
    with contextlib.ExitStack() as stack:
        if args.workdir:
            workdir = Path(args.workdir)
            workdir.mkdir(parents=True, exist_ok=True)
        else:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="overload-")))
        for part in args.parts:
            results[part] = PARTS[part](args, workdir)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))
    return 0
