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
    the watcher); ``direct``: the server's ``DIRECT_BODY``, which tells of the client leaving
    itself (``CancelOnDisconnect``)."""
    if direct is not None and direct.disconnected:  # gone already
        work.close()
        return None
    with CancelOnDisconnect(receive, direct):
        return await work
    return None  # the client left: the block's cancellation was taken back


class CancelOnDisconnect:
    """``with CancelOnDisconnect(receive, direct):`` the block's awaits are cancelled when the
    client disconnects, and the block then ends quietly (the cancellation taken back: the
    client's leaving ends the work, not the request's handler); anything else it raises goes
    on. A context of the calling task, not a coroutine around the work: no task and no frame
    a request where the server tells of the client leaving itself (``direct``, the server's
    ``DIRECT_BODY``: the hot path); without it a watcher task reads ``receive`` for the
    ``http.disconnect``."""

    __slots__ = ("task", "direct", "watcher", "gone")

    def __init__(self, receive, direct=None):
        self.task = asyncio.current_task()
        self.direct, self.watcher, self.gone = direct, None, False
        if direct is not None:
            direct.on_lost = self._lost
        else:
            self.watcher = asyncio.ensure_future(self._watch(receive))

    def _lost(self) -> None:
        self.gone = True
        self.task.cancel()

    async def _watch(self, receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self._lost()

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, traceback) -> bool:
        if self.direct is not None:
            self.direct.on_lost = None
        else:
            self.watcher.cancel()
        if self.gone and kind is not None and issubclass(kind, asyncio.CancelledError):
            self.task.uncancel()
            return True
        return False


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
