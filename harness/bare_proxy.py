"""A bare proxy on the router's own server stack: what a request costs before any of the router's
work (bench.runs.router_overhead ``--bare``).

The same server as ``runrouter`` (serving/uvicorn_server.py ``make_server``: uvicorn with uvloop
and httptools, the guarded protocol, the request's connection used directly) and the same HTTP
client to the engine (controlplane/http1.py), forwarding every POST's body as it is to one fixed
upstream URL and its answer back: no JSON, no routing decision, no admission, no headers of its
own (a GET is answered ``{}`` here: its health). Not a router: a floor to measure the router
against.

    python -m harness.bare_proxy --port 8100 --upstream http://127.0.0.1:8001 [--server granian]

``--server granian``: the same app under granian's embedded server (``granian.server.embed``,
its Rust HTTP server calling the app on this process's loop; ``pip install granian``, not one of
the project's requirements): what that server would cost the router, whose upstream client and
background loops run on the event loop (docs/benchmarks-history.md, "--workers 2: a socket a
worker, and the peers' inserts").
"""

from __future__ import annotations

import argparse
import asyncio

import uvloop

from controlplane import http1
from serving.asgi import direct_body, lifespan, read_body, send_body
from serving.uvicorn_server import make_server


def make_app(upstream: str):
    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        if scope["method"] != "POST":  # /health, for whoever waits for it to start
            await send_body(send, 200, b"{}")
            return
        body = await read_body(receive, 2**24, scope)
        response = await http1.pool().post(
            upstream + scope["path"],
            body,
            {"content-type": "application/json"},
            connect_timeout_s=5.0,
            read_timeout_s=60.0,
        )
        try:
            content = await response.read()
        finally:
            response.release()
        answer = direct_body(scope)
        if answer is None or not answer.respond(response.status, b"application/json", [], content):
            await send_body(send, response.status, content)

    return app


async def serve_granian(app, port: int) -> None:
    from granian.constants import HTTPModes, Interfaces
    from granian.server.embed import Server

    async def with_lifespan(scope, receive, send):
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
        elif scope["type"] == "http":
            await app(scope, receive, send)

    server = Server(with_lifespan, address="127.0.0.1", port=port, interface=Interfaces.ASGI,
                    http=HTTPModes.http1, backlog=2048, log_enabled=False)  # fmt: skip
    await server.serve()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="a bare proxy on the router's server stack")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="e.g. http://127.0.0.1:8001")
    parser.add_argument("--server", choices=("uvicorn", "granian"), default="uvicorn")
    args = parser.parse_args(argv)
    loop = uvloop.new_event_loop()
    asyncio.set_event_loop(loop)
    if args.server == "granian":
        loop.run_until_complete(serve_granian(make_app(args.upstream.rstrip("/")), args.port))
        return
    server = make_server(
        make_app(args.upstream.rstrip("/")), "127.0.0.1", args.port, backlog=2048, graceful_s=1.0
    )
    loop.run_until_complete(server.serve())


if __name__ == "__main__":
    main()
