"""serving/uvicorn_server.py's request start: a request that declares a small body starts its
application once the body is all there (a head and a body written apart, as httpx writes them),
and a slow or absent body still ends as before. A real uvicorn server on a socket, a small ASGI
app that says whether the body was whole when it started."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest

from serving import uvicorn_server
from serving.asgi import direct_body, read_body, send_body
from serving.uvicorn_server import make_server


class App:
    """Answers each request with whether its body was all there when the app started."""

    def __init__(self):
        self.calls: list[dict] = []

    async def __call__(self, scope, receive, send):
        direct = direct_body(scope)
        whole = direct.whole_body() if direct is not None else None
        body = whole if whole is not None else await read_body(receive, 1 << 20, scope, 5.0)
        self.calls.append({"whole": whole is not None, "size": len(body)})
        await send_body(send, 200, json.dumps(self.calls[-1]).encode())


@contextlib.asynccontextmanager
async def serving(**kwargs):
    app = App()
    server = make_server(app, "127.0.0.1", 0, backlog=16, graceful_s=1.0, **kwargs)
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield app, server, server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.stop()
        await asyncio.wait_for(task, 10)


@pytest.fixture
async def served(monkeypatch):
    # the deadlines' sweep every tick (0.1 s), a body's grace within it: the tests wait less
    monkeypatch.setattr(uvicorn_server, "SWEEP_S", 0.1)
    monkeypatch.setattr(uvicorn_server, "BODY_GRACE_S", 0.05)
    async with serving() as served:
        yield served


def head(length: int, *extra: bytes) -> bytes:
    lines = [b"POST /x HTTP/1.1", b"Host: x", b"Content-Type: application/json",
             b"Content-Length: %d" % length, *extra]  # fmt: skip
    return b"\r\n".join(lines) + b"\r\n\r\n"


async def answer(reader) -> tuple[bytes, dict]:
    status_and_headers = await reader.readuntil(b"\r\n\r\n")
    length = int(status_and_headers.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    return status_and_headers, json.loads(await reader.readexactly(length))


@pytest.mark.parametrize("pause_s", [0.0, 0.02])
async def test_a_small_body_sent_after_its_head_is_whole_when_the_app_starts(
    served, pause_s, monkeypatch
):
    monkeypatch.setattr(uvicorn_server, "BODY_GRACE_S", 10.0)  # the pause is well within it
    app, _, port = served
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = b'{"prompt": "' + b"x" * 3000 + b'"}'
    writer.write(head(len(body)))
    await writer.drain()
    await asyncio.sleep(pause_s)
    writer.write(body)
    status, got = await answer(reader)
    assert status.startswith(b"HTTP/1.1 200")
    assert got == {"whole": True, "size": len(body)}
    writer.close()


async def test_a_body_slower_than_the_grace_is_read_by_the_app_as_it_comes(served):
    app, _, port = served
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = b'{"prompt": "late"}'
    writer.write(head(len(body)) + body[:5])
    await asyncio.sleep(0.5)  # past the grace and the sweep after it
    writer.write(body[5:])
    _, got = await answer(reader)
    assert got == {"whole": False, "size": len(body)}
    writer.close()


async def test_a_client_expecting_100_continue_is_not_kept_waiting(served, monkeypatch):
    monkeypatch.setattr(uvicorn_server, "BODY_GRACE_S", 60.0)  # were it kept, it would wait
    app, _, port = served
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = b'{"prompt": "continue"}'
    writer.write(head(len(body), b"Expect: 100-continue"))
    interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert interim.startswith(b"HTTP/1.1 100")
    writer.write(body)
    _, got = await answer(reader)
    assert got == {"whole": False, "size": len(body)}
    writer.close()


async def test_a_client_that_leaves_before_its_body_starts_nothing(served):
    app, server, port = served
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head(100) + b'{"pro')
    await writer.drain()
    writer.close()
    await asyncio.sleep(0.5)
    assert app.calls == [] and not server.server_state.tasks


async def test_a_request_waiting_for_its_body_when_the_server_stops_is_answered_503(served):
    app, server, port = served
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head(100) + b'{"pro')
    await writer.drain()
    await asyncio.sleep(0.01)
    server.stop()
    status = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert status.startswith(b"HTTP/1.1 503"), status
    assert app.calls == []
    writer.close()


async def test_slow_headers_and_an_idle_kept_alive_connection_are_closed(monkeypatch):
    """The deadlines the sweep keeps: a request's line and headers (``header_timeout_s``), and a
    kept-alive connection's idle time (``KEEPALIVE_S``); one that keeps within them stays."""
    monkeypatch.setattr(uvicorn_server, "SWEEP_S", 0.1)
    monkeypatch.setattr(uvicorn_server, "KEEPALIVE_S", 0.6)
    async with serving(header_timeout_s=0.6) as (app, _, port):
        slow_reader, slow = await asyncio.open_connection("127.0.0.1", port)
        slow.write(b"POST /x HTTP/1.1\r\nHost: x\r\n")  # and never the rest
        idle_reader, idle = await asyncio.open_connection("127.0.0.1", port)
        body = b'{"prompt": "kept"}'
        idle.write(head(len(body)) + body)
        await answer(idle_reader)
        busy_reader, busy = await asyncio.open_connection("127.0.0.1", port)
        for _ in range(4):  # a request every 0.3 s: never idle for 0.6 s
            busy.write(head(len(body)) + body)
            await answer(busy_reader)
            await asyncio.sleep(0.3)
        assert await asyncio.wait_for(slow_reader.read(), 5) == b""  # closed
        assert await asyncio.wait_for(idle_reader.read(), 5) == b""
        busy.write(head(len(body)) + body)
        status, _ = await answer(busy_reader)
        assert status.startswith(b"HTTP/1.1 200")
        for writer in (slow, idle, busy):
            writer.close()
