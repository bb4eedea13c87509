"""The OpenAI proxy endpoints as a plain ASGI app, in front of Django.

``/v1/completions`` and ``/v1/chat/completions`` are the router's hot path. Django's middleware
stack runs its hooks through thread hops (measured: ~13 per request, ~5 ms added at p50), which
these two endpoints do not need: they have no session, no CSRF, no templates. So
``controlplane.asgi`` sends exactly these paths here and everything else to Django.

Their access control is checked here, from the scope's headers before the body is read: when API
keys are configured (apps/replicas/auth.py) a request without one of them is answered 401.
"""

from __future__ import annotations

import asyncio
import json
import logging

from apps.replicas.auth import INVALID_API_KEY_BODY, api_key_allowed, scope_authorization
from apps.routing.proxy import ProxyError, open_upstream, relay
from apps.routing.router import get_router
from engine.server.asgi import (
    SSE_HEADERS,
    BodyTooLarge,
    ClientGone,
    end_body,
    read_body,
    send_body,
    send_chunk,
    until_disconnect,
)

logger = logging.getLogger(__name__)

PATHS = {"/v1/completions": False, "/v1/chat/completions": True}  # path -> chat?
MAX_BODY_BYTES = 16 * 2**20


async def send_error(send, exc: ProxyError) -> None:
    await send_body(send, exc.status, exc.body())


def route_headers(routed, response) -> list:
    headers = [(b"x-routed-target", routed.target.key.encode())]
    rank = routed.target.rank
    if rank is None:
        rank = response.headers.get("x-data-parallel-rank")
    if rank is not None:
        headers.append((b"x-data-parallel-rank", str(rank).encode()))
    return headers


def parse(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProxyError(400, f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ProxyError(400, "the request body must be a JSON object")
    return body


async def openai_proxy(scope, receive, send) -> None:
    path = scope["path"]
    stats = get_router().stats

    async def send(message, send=send):  # counts every answer by status for /metrics
        if message["type"] == "http.response.start":
            stats.responded(path, message["status"])
        await send(message)

    if not api_key_allowed(scope_authorization(scope)):
        await send_body(send, 401, INVALID_API_KEY_BODY, headers=[(b"www-authenticate", b"Bearer")])
        return
    if scope["method"] != "POST":
        await send_error(send, ProxyError(405, f"{scope['method']} {path} is not served here"))
        return
    try:
        body = parse(await read_body(receive, MAX_BODY_BYTES))
    except ClientGone:
        return
    except BodyTooLarge as exc:
        await send_error(send, ProxyError(413, str(exc)))
        return
    except ProxyError as exc:
        await send_error(send, exc)
        return
    await until_disconnect(forward(body, PATHS[path], path, send), receive)


async def forward(body: dict, chat: bool, path: str, send) -> None:
    """Route and relay one request. Cancelled when the client disconnects: every branch below
    ends the request's load and closes the upstream response on the way out."""
    stream = body.get("stream") is True
    options = body.get("stream_options")
    wants_usage = stream and isinstance(options, dict) and options.get("include_usage") is True
    router = get_router()
    try:
        routed, response = await open_upstream(router, body, chat=chat, path=path, stream=stream)
    except ProxyError as exc:
        await send_error(send, exc)
        return
    headers = route_headers(routed, response)
    content_type = response.headers.get("content-type", "application/json")
    if response.status_code == 200 and stream and content_type.startswith("text/event-stream"):
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS + headers})
        events = relay(router, routed, response, wants_usage)
        try:
            async for event in events:
                await send_chunk(send, event)
        finally:
            await events.aclose()
        await end_body(send)
        return
    ok, aborted, content = False, False, b""
    try:
        content = await response.aread()
        ok = response.status_code < 400
    except asyncio.CancelledError:  # the client left while the answer was being read
        aborted = True
        raise
    finally:
        await response.aclose()
        router.finish(routed, ok=ok, usage=_usage(content) if ok else None, aborted=aborted)
    await send_body(send, response.status_code, content, content_type.encode(), headers)


def _usage(content: bytes) -> dict | None:
    try:
        return json.loads(content).get("usage")
    except (ValueError, AttributeError):
        return None
