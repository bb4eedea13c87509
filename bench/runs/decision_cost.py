"""What the routing decision costs the router's event loop, in process: the thread CPU a request
spends in ``Router.route`` and in its end (``Dispatch.first_token`` and ``finish``, the miss
reasons included), with no HTTP, server or event loop around it.

The fleet is one worker of ``--ranks`` DP ranks, built by hand: text digests (as in front of an
engine whose tokenizer the router does not read: the stand-in of bench.runs.stream_relay), or with
``--tokenizer`` the tiny model's token digests (then ``route`` also tokenizes each prompt, as it
does inline for a prompt shorter than ``OFF_LOOP_CHARS``). ``--inflight`` requests are begun
before the oldest ends, so the policy sees that load. Prompts are ``unique`` (each its own ~970
characters, as stream_relay sends: the index churns at its capacity) or ``shared`` (one of
``--prefixes`` prefixes of ~800 characters and a suffix of its own). Prints microseconds a
request; ``--profile N`` adds cProfile's top N functions by own time (on the thread CPU clock;
cProfile inflates Python calls, so read its shares, not its totals)::

    .venv/bin/python -m bench.runs.decision_cost [--ranks 4 16] [--prompts unique shared] \\
        [--requests 20000] [--inflight 8] [--tokenizer] [--profile 25]

It measures the piece of a non-streamed request that bench.runs.stream_relay cannot separate from
the server and the sockets (docs/benchmarks.md, "What the router itself costs").
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import random
import time
from collections import deque

WORDS = "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor".split()


def make_router(ranks: int, tokenizer_path: str | None, capacity: int):
    from apps.routing.decision.config import RouterConfig
    from apps.routing.decision.fleet import WorkerView
    from apps.routing.decision.router import Router

    router = Router(RouterConfig(policy="cache_aware"), rng=random.Random(0))
    view = WorkerView(
        worker_id=1, url="http://bench", api_key="", model="m", model_aliases={"m"},
        dp_size=ranks, dp_aware=True, block_size=16 if tokenizer_path else None,
        tokenizer_path=tokenizer_path, capacity_blocks=capacity,
    )  # fmt: skip
    router.fleet.put(view)
    router.sync_capacity()
    return router


def prompts(kind: str, count: int, prefixes: int, seed: int = 0) -> list[str]:
    if kind == "unique":
        return [f"request {i} " + "lorem ipsum " * 80 for i in range(count)]
    rng = random.Random(seed)
    heads = [" ".join(rng.choice(WORDS) for _ in range(130)) for _ in range(prefixes)]
    return [
        f"{heads[rng.randrange(prefixes)]} question {i}: "
        + " ".join(rng.choice(WORDS) for _ in range(25))
        for i in range(count)
    ]


def measure(router, texts: list[str], inflight: int, warmup: int, profile=None) -> dict:
    """Thread CPU seconds in route and in the ends, over the requests after ``warmup``."""
    clock = time.thread_time
    running: deque = deque()
    spent = {"route": 0.0, "end": 0.0}
    measured = 0

    def end(dispatch, timed: bool) -> None:
        usage = {
            "prompt_tokens": dispatch.shape.prompt_tokens,
            "completion_tokens": 5,
            "prompt_tokens_details": {"cached_tokens": dispatch.predicted_tokens},
        }
        began = clock()
        dispatch.first_token()
        dispatch.finish(ok=True, usage=usage)
        if timed:
            spent["end"] += clock() - began

    for i, text in enumerate(texts):
        timed = i >= warmup
        if timed and profile is not None and i == warmup:
            profile.enable()
        body = {"model": "m", "prompt": text, "max_tokens": 5}
        began = clock()
        dispatch = router.route(body, False, "m")
        if timed:
            spent["route"] += clock() - began
            measured += 1
        running.append(dispatch)
        if len(running) > inflight:
            end(running.popleft(), timed)
    if profile is not None:
        profile.disable()
    while running:
        end(running.popleft(), False)
    return {k: 1e6 * v / max(1, measured) for k, v in spent.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--prompts", nargs="+", default=["unique", "shared"],
                        choices=["unique", "shared"])  # fmt: skip
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--warmup", type=int, default=4000, help="requests before measuring")
    parser.add_argument("--inflight", type=int, default=8)
    parser.add_argument("--prefixes", type=int, default=32)
    parser.add_argument("--capacity", type=int, default=4096, help="KV blocks a rank holds")
    parser.add_argument("--tokenizer", action="store_true", help="the tiny model's token digests")
    parser.add_argument("--profile", type=int, default=0, help="cProfile's top N (0: none)")
    args = parser.parse_args(argv)

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    import django

    django.setup()
    tokenizer_path = None
    if args.tokenizer:
        from engine.tiny import ensure_tiny_model

        tokenizer_path = str(ensure_tiny_model())
    digests = "token" if tokenizer_path else "text"
    print("| ranks | prompts | digests | route us | end us | total us |")
    print("|---:|---|---|---:|---:|---:|")
    for ranks in args.ranks:
        for kind in args.prompts:
            router = make_router(ranks, tokenizer_path, args.capacity)
            texts = prompts(kind, args.warmup + args.requests, args.prefixes)
            profile = cProfile.Profile(time.thread_time) if args.profile else None
            cost = measure(router, texts, args.inflight, args.warmup, profile)
            print(f"| {ranks} | {kind} | {digests} | {cost['route']:.1f} | {cost['end']:.1f} | "
                  f"{cost['route'] + cost['end']:.1f} |", flush=True)  # fmt: skip
            if profile is not None:
                pstats.Stats(profile).sort_stats("tottime").print_stats(args.profile)


if __name__ == "__main__":
    main()
