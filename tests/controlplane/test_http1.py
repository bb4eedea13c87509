"""The proxy's HTTP/1.1 client (controlplane/http1.py) against real sockets: small asyncio
servers that answer as engines do (a length, chunked, until close) and misbehave on purpose."""

from __future__ import annotations

import asyncio

import pytest

from controlplane import http1
from harness.procs import free_port


class Server:
    """An asyncio TCP server answering each request with ``answer(reader, writer, n)``; counts the
    connections it accepted and notes when a connection ended before its answer did."""

    def __init__(self, answer):
        self.answer = answer
        self.connections = 0
        self.requests: list[bytes] = []
        self.client_left = asyncio.Event()

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc):
        http1.close_pool()
        self.server.close()

    async def _serve(self, reader, writer):
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                self.requests.append(head + await reader.readexactly(length))
                if await self.answer(reader, writer, len(self.requests)) is False:
                    break
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()


def fixed(body: bytes, status: bytes = b"200 OK"):
    async def answer(reader, writer, n):
        writer.write(b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                     b"x-data-parallel-rank: 1\r\n\r\n%s" % (status, len(body), body))  # fmt: skip
        await writer.drain()

    return answer


def chunked(parts: list[bytes], pause_s: float = 0.0, then_hang: bool = False):
    async def answer(reader, writer, n):
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")  # fmt: skip
        for part in parts:
            writer.write(b"%x\r\n%s\r\n" % (len(part), part))
            await writer.drain()
            await asyncio.sleep(pause_s)
        if then_hang:
            try:
                await reader.read(1)  # until the client closes
            finally:
                server_seen_close.set()
            return False
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    server_seen_close = asyncio.Event()
    answer.closed = server_seen_close
    return answer


async def post(url, body=b"{}", read_timeout_s=5.0, headers=None):
    return await http1.pool().post(
        url + "/v1/completions",
        body,
        headers or {"content-type": "application/json"},
        connect_timeout_s=2.0,
        read_timeout_s=read_timeout_s,
    )


async def test_a_whole_answer_and_its_headers_and_the_connection_is_kept_alive():
    async with Server(fixed(b'{"ok": 1}')) as server:
        for _ in range(3):
            response = await post(server.url, b'{"prompt": "x"}', headers={"x-a": "b"})
            assert response.status == 200
            assert response.headers["content-type"] == "application/json"
            assert response.headers["x-data-parallel-rank"] == "1"
            assert await response.read() == b'{"ok": 1}'
            response.release()
        assert server.connections == 1
        first = server.requests[0]
        assert first.startswith(b"POST /v1/completions HTTP/1.1\r\n")
        assert b"\r\nx-a: b\r\n" in first and first.endswith(b'\r\n\r\n{"prompt": "x"}')
        assert b"Host: 127.0.0.1:" in first


async def test_an_error_status_is_an_answer_not_an_exception():
    async with Server(fixed(b'{"error": {}}', b"429 Too Many Requests")) as server:
        response = await post(server.url)
        assert response.status == 429 and await response.read() == b'{"error": {}}'
        response.release()


async def test_a_chunked_stream_arrives_as_it_is_sent_and_ends():
    parts = [b"data: %d\n\n" % i for i in range(5)]
    async with Server(chunked(parts, pause_s=0.01)) as server:
        response = await post(server.url)
        got = [chunk async for chunk in response.chunks()]
        response.release()
        assert b"".join(got) == b"".join(parts)
        assert len(got) >= 3  # paced parts come one read at a time, not all at the end
        again = await post(server.url)  # the whole answer was read: the connection is reused
        assert b"".join([c async for c in again.chunks()]) == b"".join(parts)
        again.release()
        assert server.connections == 1


async def test_a_stream_given_up_closes_its_connection_so_the_engine_sees_the_client_leave():
    answer = chunked([b"data: 1\n\n"], then_hang=True)
    async with Server(answer) as server:
        response = await post(server.url)
        async for _ in response.chunks():
            break
        response.release()
        await asyncio.wait_for(answer.closed.wait(), 5)
        again = await post(server.url)  # a fresh connection, not the closed one
        again.release()
        assert server.connections == 2


async def test_nothing_within_the_read_timeout_is_a_read_timeout():
    async def silent(reader, writer, n):
        await asyncio.sleep(10)

    async with Server(silent) as server:
        with pytest.raises(http1.ReadTimeout):
            await post(server.url, read_timeout_s=0.2)


async def test_a_kept_connection_times_out_on_each_request_s_own_deadline_with_one_timer():
    """The read timeout's timer outlives a request on a kept-alive connection: the next ones
    neither set nor cancel one, and a shorter deadline than the armed one still fires on time."""

    async def then_silent(reader, writer, n):
        if n < 4:
            await fixed(b"{}")(reader, writer, n)
        else:
            await asyncio.sleep(10)

    async with Server(then_silent) as server:
        timers = set()
        for _ in range(3):  # answered well within a long timeout
            response = await post(server.url, read_timeout_s=60.0)
            assert await response.read() == b"{}"
            timers.add(id(response._conn.timer))
            response.release()
        assert len(timers) == 1 and server.connections == 1  # one timer, armed once
        began = asyncio.get_running_loop().time()
        with pytest.raises(http1.ReadTimeout):
            await post(server.url, read_timeout_s=0.2)  # the same connection, a shorter deadline
        assert asyncio.get_running_loop().time() - began < 2.0
        assert server.connections == 1


async def test_a_connection_refused_is_a_connect_error():
    with pytest.raises(http1.ConnectError):
        await post(f"http://127.0.0.1:{free_port()}")


async def test_a_connection_closed_mid_answer_is_disconnected():
    async def half(reader, writer, n):
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly part")
        await writer.drain()
        return False  # close

    async with Server(half) as server:
        response = await post(server.url)
        with pytest.raises(http1.Disconnected):
            await response.read()
        response.release()

    async def nothing(reader, writer, n):
        return False

    async with Server(nothing) as server:
        with pytest.raises(http1.Disconnected):
            await post(server.url)


async def test_garbage_is_disconnected_not_a_crash():
    async def garbage(reader, writer, n):
        writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
        await writer.drain()

    async with Server(garbage) as server:
        with pytest.raises(http1.Disconnected):
            await post(server.url)


async def test_a_body_without_a_length_ends_when_the_connection_does():
    async def until_close(reader, writer, n):
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of it")
        await writer.drain()
        return False

    async with Server(until_close) as server:
        response = await post(server.url)
        assert await response.read() == b"all of it"
        response.release()


async def test_a_slow_reader_pauses_the_engine_instead_of_buffering_without_bound():
    part = b"x" * 65536
    count = 64  # 4 MiB in all, far past HIGH_WATER
    async with Server(chunked([part] * count)) as server:
        response = await post(server.url)
        conn = response._conn
        await asyncio.sleep(0.5)  # the server writes as fast as it may; nobody reads
        assert conn.paused
        assert conn.buffered <= http1.HIGH_WATER + 2 * 65536
        total = 0
        async for chunk in response.chunks():
            total += len(chunk)
        response.release()
        assert total == len(part) * count


async def test_an_idle_connection_past_the_keepalive_is_not_used_again(monkeypatch):
    async with Server(fixed(b"{}")) as server:
        response = await post(server.url)
        await response.read()
        response.release()
        monkeypatch.setattr(http1, "KEEPALIVE_S", 0.05)
        await asyncio.sleep(0.1)
        response = await post(server.url)
        await response.read()
        response.release()
        assert server.connections == 2


async def test_a_piped_stream_hands_each_piece_to_the_sink_as_it_arrives_and_ends():
    parts = [b"data: %d\n\n" % i for i in range(5)]
    async with Server(chunked(parts, pause_s=0.01)) as server:
        response = await post(server.url)
        got, in_task = [], []

        def sink(piece):
            got.append(piece)
            in_task.append(asyncio.current_task() is not None)
            return False

        await response.pipe(sink, None)
        response.release()
        assert b"".join(got) == b"".join(parts) and len(got) >= 3
        # what came with the headers is handed over from the reader's task; the rest from the
        # connection's callback, with no task running
        assert not any(in_task[1:])
        again = await post(server.url)  # read whole: the connection goes back to the pool
        await again.read()
        again.release()
        assert server.connections == 1


async def test_a_full_sink_pauses_the_engine_until_it_drains():
    part = b"x" * 65536
    count = 64
    async with Server(chunked([part] * count)) as server:
        response = await post(server.url)
        conn = response._conn
        received, drained = [], asyncio.Event()

        def sink(piece):
            received.append(len(piece))
            return not drained.is_set()  # full until drained

        async def drain():
            await asyncio.sleep(0.3)
            assert conn.paused
            pieces = len(received)
            await asyncio.sleep(0.2)
            assert len(received) == pieces, "nothing is read while the client is full"
            drained.set()

        await response.pipe(sink, drain)
        response.release()
        assert sum(received) == len(part) * count


async def test_a_failing_sink_ends_the_answer_with_its_error_and_closes_the_connection():
    answer = chunked([b"data: 1\n\n", b"data: 2\n\n"], pause_s=0.05, then_hang=True)
    async with Server(answer) as server:
        response = await post(server.url)

        def sink(piece):
            raise ValueError("not an event")

        with pytest.raises(ValueError, match="not an event"):
            await response.pipe(sink, None)
        response.release()
        await asyncio.wait_for(answer.closed.wait(), 5)


async def test_a_pipe_times_out_after_the_read_timeout_from_its_last_piece():
    loop = asyncio.get_running_loop()
    parts = [b"data: %d\n\n" % i for i in range(4)]
    async with Server(chunked(parts, pause_s=0.15, then_hang=True)) as server:
        response = await post(server.url, read_timeout_s=0.25)
        times = []
        with pytest.raises(http1.ReadTimeout):
            await response.pipe(lambda piece: times.append(loop.time()), None)
        ended = loop.time()
        response.release()
        assert len(times) == 4, "pieces 0.15 s apart do not time out at 0.25 s"
        assert 0.2 <= ended - times[-1] < 0.5
