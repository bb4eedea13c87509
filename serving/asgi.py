"""Small ASGI helpers shared by the engine's front and the router's fast proxy path."""

from __future__ import annotations

import asyncio
import json

JSON = b"application/json"
SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class ClientGone(Exception):
    """The client disconnected before its request body arrived."""


class BodyTooLarge(Exception):
    pass


class BodyTimeout(Exception):
    """The request body did not arrive in time (a client trickling it, or gone quiet)."""


BODY_TIMEOUT_S = 30.0  # the whole body, from the first read: nginx's client_body_timeout is 60 s


async def lifespan(receive, send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


def declared_length(scope) -> int | None:
    """The request's ``Content-Length``, when it has a valid one."""
    for name, value in scope.get("headers") or ():
        if name.lower() == b"content-length":
            return int(value) if value.isdigit() else None
    return None


async def read_body(
    receive, limit: int, scope=None, timeout_s: float | None = BODY_TIMEOUT_S
) -> bytes:
    """The whole request body; ``BodyTooLarge`` past ``limit`` bytes (at once, before reading,
    when ``scope``'s ``Content-Length`` says so), ``BodyTimeout`` when it has not all arrived
    within ``timeout_s``, ``ClientGone`` on disconnect."""
    declared = declared_length(scope) if scope is not None else None
    if declared is not None and declared > limit:
        raise BodyTooLarge(f"the request body ({declared} bytes) is larger than {limit} bytes")
    direct = direct_body(scope) if scope is not None else None
    whole = direct.whole_body() if direct is not None else None
    if whole is not None:  # it has all arrived (the usual case): no timer to set
        if len(whole) > limit:
            raise BodyTooLarge(f"the request body is larger than {limit} bytes")
        return whole
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ClientGone()
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    raise BodyTooLarge(f"the request body is larger than {limit} bytes")
                chunks.append(chunk)
                if not message.get("more_body"):
                    return b"".join(chunks)
    except TimeoutError:
        raise BodyTimeout(
            f"the request body did not arrive within {timeout_s:g} s ({size} bytes came)"
        ) from None


async def until_disconnect(work, receive, direct=None):
    """Run ``work`` until it ends or the client disconnects; a disconnect cancels it (its own
    cleanup then closes whatever it holds upstream) and returns None. Re-raises what ``work``
    raised. ``work`` runs in the calling task (one task less a request than running it beside
    the watcher); the watcher cancels that task when the client goes. With ``direct`` (the
    server's ``DIRECT_BODY``) the server tells of the client leaving itself: no watcher task
    (and no coroutine between this one and ``work``: the hot path)."""
    current = asyncio.current_task()
    if direct is None:
        return await _until_received(work, receive, current)
    if direct.disconnected:  # gone already
        work.close()
        return None
    gone = False

    def lost():
        nonlocal gone
        gone = True
        current.cancel()

    direct.on_lost = lost
    try:
        return await work
    except asyncio.CancelledError:
        if not gone:
            raise
        current.uncancel()  # the client's leaving ends the work, not the request's handler
        return None
    finally:
        direct.on_lost = None


async def _until_received(work, receive, current):
    """``until_disconnect`` where the server tells of a disconnect only through ``receive``."""
    gone = False

    async def watch():
        nonlocal gone
        while (await receive())["type"] != "http.disconnect":
            pass
        gone = True
        current.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        return await work
    except asyncio.CancelledError:
        if not gone:
            raise
        current.uncancel()
        return None
    finally:
        watcher.cancel()


async def send_body(
    send, status: int, body: bytes, content_type: bytes = JSON, headers: list | None = None
):
    """A whole answer: in one write where ``send`` offers ``respond(status, content_type,
    headers, body)`` (the router's, over serving/uvicorn_server.py ``DirectBody``), else as two
    ASGI messages."""
    respond = getattr(send, "respond", None)
    if respond is not None and respond(status, content_type, headers or [], body):
        return
    all_headers = [
        (b"content-type", content_type),
        (b"content-length", str(len(body)).encode()),
    ] + (headers or [])
    await send({"type": "http.response.start", "status": status, "headers": all_headers})
    await send({"type": "http.response.body", "body": body})


async def send_json(send, status: int, payload: dict, headers: list | None = None):
    await send_body(send, status, json.dumps(payload).encode(), JSON, headers)


async def start_sse(send, headers: list | None = None):
    await send(
        {"type": "http.response.start", "status": 200, "headers": SSE_HEADERS + (headers or [])}
    )


async def send_chunk(send, data: bytes):
    await send({"type": "http.response.body", "body": data, "more_body": True})


# A server that lets the application use the request's connection directly puts an object here
# in the request's ``scope["extensions"]`` (serving/uvicorn_server.py ``DirectBody``):
# ``whole_body()`` (the body, when all of it has arrived), ``respond(status, content_type,
# headers, body)`` (a whole answer in one write), for a streamed answer ``ready()`` (it has
# started, chunked), ``write(data)`` (one chunk, callable outside the request's task),
# ``paused`` (the client's buffer is full) and ``await drain()``, ``on_lost`` (called when
# the client leaves before the answer is whole) with ``disconnected``, and ``body_at`` (the
# ``time.perf_counter()`` at which the body's last byte was parsed, or None). Where it is absent
# (daphne), the same goes through ``receive`` and ``send``.
DIRECT_BODY = "dpmesh.direct_body"


def direct_body(scope):
    """The server's direct use of the request's connection (``DIRECT_BODY``), or None."""
    extensions = scope.get("extensions")
    return extensions.get(DIRECT_BODY) if extensions else None


async def end_body(send, data: bytes = b""):
    await send({"type": "http.response.body", "body": data, "more_body": False})
