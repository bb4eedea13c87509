"""What a whole non-streamed request costs the router's event loop, in process: the OpenAI endpoint
(apps/routing/proxy/endpoint.py) from its ASGI call to its answer written, with the server and the
engine replaced by in-memory stand-ins, so no socket, kernel or other process is in the figure.

The server's side is what serving/uvicorn_server.py hands the endpoint (a scope with the request's
headers and its ``DirectBody``: the body already whole, the answer written in one call); the
engine's side is ``controlplane.http1.Pool`` answering at once with a completion's JSON (a usage
with cached tokens), after calling the dispatch's ``sent`` hook as the real pool does once the
request is written. The fleet is one worker of ``--ranks`` DP ranks with text digests, prompts
each its own ~970 characters (bench.runs.stream_relay's), ``--inflight`` requests at a time on a
uvloop loop. Its KV capacity is not reported, as the stand-in's is not (the index then holds
100,000 blocks a rank and barely evicts); ``--capacity 4096`` makes every request evict as many
blocks as it inserts, as in front of a full engine. Prints the loop thread's CPU microseconds a
request; ``--profile N`` adds cProfile's top N functions by own time (cProfile inflates Python
calls: read its shares, not its totals)::

    .venv/bin/python -m bench.runs.request_cost [--requests 20000] [--inflight 8] \\
        [--capacity 4096] [--profile 30]

What it leaves out, and bench.runs.stream_relay and router_overhead measure with it: uvicorn's
parsing and its task a request, the two connections' reads and writes, the loop's waits. The
difference between this figure and theirs is the server stack's and the kernel's share.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import random
import time

ANSWER = json.dumps({
    "id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m",
    "choices": [{"index": 0, "text": " lorem ipsum dolor sit amet", "finish_reason": "length",
                 "logprobs": None}],
    "usage": {"prompt_tokens": 321, "completion_tokens": 16, "total_tokens": 337,
              "prompt_tokens_details": {"cached_tokens": 0}},
}).encode()  # fmt: skip
HEADERS = [(b"host", b"127.0.0.1:8000"), (b"user-agent", b"python-httpx/0.28"),
           (b"accept", b"*/*"), (b"accept-encoding", b"gzip, deflate"),
           (b"connection", b"keep-alive"), (b"content-type", b"application/json")]  # fmt: skip


class Answered:
    """The engine's answer, as ``controlplane.http1.Response`` offers it."""

    status = 200
    _raw = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(ANSWER))]

    def header(self, name: bytes) -> str | None:
        for raw, value in self._raw:
            if raw.lower() == name:
                return value.decode("latin-1")
        return None

    async def read(self) -> bytes:
        return ANSWER

    def release(self) -> None:
        """Nothing to give back: no connection holds this answer."""


class Engine:
    """``http1.Pool`` answering at once: the request is 'written' (``sent``), then answered."""

    async def post(self, url, payload, headers, *, connect_timeout_s=None, read_timeout_s=None,
                   sent=None):  # fmt: skip
        if sent is not None:
            sent()
        await asyncio.sleep(0)  # the wait for the engine: the loop runs others meanwhile
        return Answered()


class Direct:
    """serving/uvicorn_server.py ``DirectBody`` for one request whose body has arrived."""

    __slots__ = ("body", "body_at", "disconnected", "on_lost", "answered")

    def __init__(self, body: bytes):
        self.body, self.body_at, self.disconnected, self.on_lost = body, None, False, None
        self.answered = None

    def whole_body(self) -> bytes:
        return self.body

    def respond(self, status, content_type, headers, body) -> bool:
        self.answered = status
        return True


def make_app(ranks: int, capacity: int | None = None):
    from apps.routing.decision.config import RouterConfig
    from apps.routing.decision.fleet import WorkerView
    from apps.routing.decision.router import Router
    from apps.routing.proxy.endpoint import OpenAIEndpoint

    router = Router(RouterConfig(policy="cache_aware"), rng=random.Random(0))
    view = WorkerView(
        worker_id=1, url="http://bench", api_key="", model="m", model_aliases={"m"},
        dp_size=ranks, dp_aware=True, block_size=None, tokenizer_path=None,
        capacity_blocks=capacity,
    )  # fmt: skip
    router.fleet.put(view)
    router.sync_capacity()
    return OpenAIEndpoint(router)


async def drive(app, requests: int, inflight: int, warmup: int, profile=None) -> float:
    """The loop thread's CPU seconds over the requests after ``warmup``."""
    from serving.asgi import DIRECT_BODY

    async def receive():  # never called: the body is whole in ``Direct``
        raise AssertionError("receive")

    async def send(message):
        raise AssertionError(f"send {message['type']}")

    async def one(i: int) -> None:
        body = json.dumps({"model": "m", "prompt": f"request {i} " + "lorem ipsum " * 80,
                           "max_tokens": 16, "stream": False}).encode()  # fmt: skip
        direct = Direct(body)
        headers = HEADERS + [(b"content-length", str(len(body)).encode())]
        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers,
                 "extensions": {DIRECT_BODY: direct}}  # fmt: skip
        await app(scope, receive, send)
        if direct.answered != 200:
            raise RuntimeError(f"request {i} answered {direct.answered}")

    async def lane(start: int, stride: int, stop: int) -> None:
        for i in range(start, stop, stride):
            await one(i)

    await asyncio.gather(*(lane(j, inflight, warmup) for j in range(inflight)))
    if profile is not None:
        profile.enable()
    began = time.thread_time()
    await asyncio.gather(*(lane(warmup + j, inflight, warmup + requests) for j in range(inflight)))
    spent = time.thread_time() - began
    if profile is not None:
        profile.disable()
    return spent


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--warmup", type=int, default=4000)
    parser.add_argument("--inflight", type=int, default=8)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--capacity", type=int, default=None, help="KV blocks a rank reports")
    parser.add_argument("--repeat", type=int, default=3, help="passes, each on a fresh router")
    parser.add_argument("--profile", type=int, default=0, help="cProfile's top N (0: none)")
    args = parser.parse_args(argv)

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    import django
    import uvloop

    django.setup()
    from controlplane import http1

    engine = Engine()
    http1.pool = lambda: engine  # the engine's side, in memory
    for _ in range(args.repeat):
        profile = cProfile.Profile(time.thread_time) if args.profile else None
        app = make_app(args.ranks, args.capacity)
        spent = uvloop.run(drive(app, args.requests, args.inflight, args.warmup, profile))
        per_request = 1e6 * spent / args.requests
        print(f"{args.ranks} ranks, capacity {args.capacity}, {args.inflight} in flight: "
              f"{per_request:.1f} us of loop CPU a request", flush=True)  # fmt: skip
        if profile is not None:
            pstats.Stats(profile).sort_stats("tottime").print_stats(args.profile)


if __name__ == "__main__":
    main()
