"""The proxy's own HTTP/1.1 client to its engines: an asyncio protocol per connection, httptools'
response parser, a keep-alive pool per event loop.

aiohttp stays the client for everything else (discovery, health, scrapes, KV events:
controlplane/http.py). On the proxy's path it was ~15 % of the router's CPU per non-streamed
request (py-spy at 32 connections, docs/benchmarks.md "What the router itself costs"): building
a request object, a payload registry, header multidicts, a stream reader with its own buffers and
timers. The proxy needs much less, and this is all it does:

- ``post(url, body, headers, connect_timeout_s, read_timeout_s)``: one write of the request head
  and body on a pooled connection (or a new one), then the answer's status and headers;
- the body whole (``Response.read``) or as it arrives (``Response.chunks``: whatever has come
  since the last read, joined), ``read_timeout_s`` at most between arrivals; reading from the
  engine pauses while ``HIGH_WATER`` bytes wait for a slow client, so a stream costs bounded
  memory;
- or piped (``Response.pipe``): each piece handed to a function in the connection's own callback
  as it arrives, so a streamed answer costs no task switch, timer or future per event (the relay
  of a stream to a client, apps/routing/proxy/upstream.py); the function says when the client is
  full, and reading pauses until it has drained;
- ``Response.release``: the connection goes back to the pool when the answer was read whole and
  the server keeps it alive; otherwise it is closed, which is how an engine learns that a client
  left (it aborts the request and frees its KV blocks).

Its errors say what the proxy must do next: ``ConnectError`` (refused, unresolvable: nobody
listens, the whole worker is down), ``ConnectTimeout``, ``ReadTimeout`` (the engine has the
request and may be generating: not to be retried), ``Disconnected`` (reset or closed before the
answer was whole). A pooled connection is kept ``KEEPALIVE_S``, less than the engines' servers
keep one idle (5 s), so no request goes out on a connection its server is closing.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Callable
from functools import lru_cache
from urllib.parse import urlsplit

import httptools

KEEPALIVE_S = 4.0
HIGH_WATER = 256 * 1024  # bytes of an answer held for a slow client before reading pauses
USER_AGENT = b"dpmesh-router"


class UpstreamError(Exception):
    """Anything that went wrong between the router and an engine."""


class ConnectError(UpstreamError):
    """Nobody listens there (refused, or the host does not resolve)."""


class ConnectTimeout(UpstreamError):
    """No connection within the connect timeout."""


class ReadTimeout(UpstreamError, TimeoutError):
    """Nothing arrived for the read timeout, before the answer was whole."""


class Disconnected(UpstreamError):
    """The connection closed or broke before the answer was whole (or the answer was not
    HTTP)."""


@lru_cache(maxsize=256)
def _split(url: str) -> tuple[tuple, bytes]:
    """((host, port, tls), the request's first two lines) for a POST to an http(s) URL; cached: a
    worker's URL and path are the same for every request to it."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConnectError(f"not an http(s) URL: {url!r}")
    tls = parts.scheme == "https"
    port = parts.port or (443 if tls else 80)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    if port != (443 if tls else 80):
        host = f"{host}:{port}"
    start = b"POST %s HTTP/1.1\r\nHost: %s\r\nUser-Agent: %s\r\n" % (
        target.encode("ascii"),
        host.encode("idna"),
        USER_AGENT,
    )
    return (parts.hostname, port, tls), start


class _Connection(asyncio.Protocol):
    """One TCP connection and the answer being read on it."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0
        self.sink = None  # Response.pipe's function, while it pipes
        self.last_arrival = 0.0  # when it was handed a piece last: its read timeout's clock
        # the read timeout: the current wait's deadline (loop time; None: none) and the timer
        # that checks it (``_arm``)
        self.deadline: float | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.timer_at = 0.0
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.headers_done = self.complete = self.paused = self.keep_alive = False
        self.body: list[bytes] = []
        self.buffered = 0
        self.error: UpstreamError | None = None
        self.sink_error: BaseException | None = None
        self.waiter: asyncio.Future | None = None

    # asyncio's side
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(Disconnected("the engine answered with a protocol upgrade"))
        except httptools.HttpParserError as exc:
            self._fail(Disconnected(f"the engine's answer is not HTTP: {exc}"))
        if self.sink is None or self.closed:  # a pipe wakes its reader only at the end or a pause
            self._wake()

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if not self.complete and self.error is None:
            if self.headers_done and self._ends_at_close():
                self.complete = True  # a body without a length ends when the connection does
            else:
                reason = f": {exc!r}" if exc else ""
                self.error = Disconnected(f"the engine closed the connection{reason}")
        self._wake()

    # httptools' side
    def on_header(self, name: bytes, value: bytes) -> None:
        self.raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()  # known here, not after the body
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        if self.sink is not None:
            if self.sink_error is not None:
                return
            self.last_arrival = self.loop.time()
            try:
                full = self.sink(body)
            except Exception as exc:  # the reader raises it; the answer is not read further
                self.sink_error = exc
                self.close()
                return
            if full and self._pause():
                self._wake()
            return
        self.body.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER:
            self._pause()

    def on_message_complete(self) -> None:
        self.complete = True
        self._wake()

    # the reader's side
    def take(self) -> bytes:
        data = self.body[0] if len(self.body) == 1 else b"".join(self.body)
        self.body.clear()
        self.buffered = 0
        self._resume()
        return data

    def _pause(self) -> bool:
        """Stop reading from the engine (the reader is full); True when this paused it."""
        if self.paused or self.closed:
            return False
        self.paused = True
        self.transport.pause_reading()
        return True

    def _resume(self) -> None:
        if self.paused:
            self.paused = False
            if not self.closed:
                self.transport.resume_reading()

    async def wait(self, timeout_s: float | None) -> None:
        """Until something more arrives (or the connection ends), at most ``timeout_s``."""
        waiter = self.waiter = self.loop.create_future()
        self.deadline = None
        if timeout_s:
            self.deadline = deadline = self.loop.time() + timeout_s
            if self.timer is None or self.timer_at > deadline:
                self._arm(deadline)
        try:
            await waiter
        finally:
            self.waiter = None

    def _arm(self, at: float) -> None:
        """The connection's one timer, at ``at``: it outlives a wait (a request's answer comes
        well before its read timeout; the next request's wait finds it armed for a time before
        its own deadline and leaves it), so a request neither sets nor cancels a timer; when it
        fires it checks the deadline of whatever waits then (``_time_out``)."""
        if self.timer is not None:
            self.timer.cancel()
        self.timer, self.timer_at = self.loop.call_at(at, self._time_out), at

    def _time_out(self) -> None:
        self.timer = None
        waiter, deadline = self.waiter, self.deadline
        if waiter is None or waiter.done() or deadline is None or self.closed:
            return  # nothing waits: the next wait arms it again
        if self.loop.time() >= deadline:
            waiter.set_exception(ReadTimeout("no answer from the engine within the read timeout"))
        else:  # a later wait's deadline: checked again then
            self._arm(deadline)

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: UpstreamError) -> None:
        self.error = error
        self.close()

    def _ends_at_close(self) -> bool:
        for name, value in self.raw_headers:
            lowered = name.lower()
            if lowered == b"content-length" or (
                lowered == b"transfer-encoding" and b"chunked" in value.lower()
            ):
                return False
        return True

    def reusable(self) -> bool:
        return self.complete and not self.closed and self.keep_alive

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.transport.close()


class Response:
    """An engine's answer: ``status``, ``headers`` (lower-case names, the first value of each),
    and its body through ``read`` or ``chunks``; ``release`` when done with it, always."""

    __slots__ = ("status", "_raw", "_headers", "_conn", "_pool", "_key", "_timeout_s")

    def __init__(self, conn: _Connection, pool: Pool, key: tuple, timeout_s: float | None):
        self.status = conn.status
        self._raw = conn.raw_headers
        self._headers: dict[str, str] | None = None
        self._conn, self._pool, self._key, self._timeout_s = conn, pool, key, timeout_s

    def header(self, name: bytes) -> str | None:
        """The first value of header ``name`` (lower-case), without building ``headers``."""
        for raw, value in self._raw:
            if raw.lower() == name:
                return value.decode("latin-1")
        return None

    @property
    def headers(self) -> dict[str, str]:
        if self._headers is None:
            headers: dict[str, str] = {}
            for name, value in self._raw:
                headers.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
            self._headers = headers
        return self._headers

    async def read(self) -> bytes:
        conn = self._conn
        while not conn.complete:
            if conn.error is not None:
                raise conn.error
            await conn.wait(self._timeout_s)
        return conn.take()

    async def chunks(self):
        """What has arrived since the last step, until the answer is whole."""
        conn = self._conn
        while True:
            if conn.body:
                yield conn.take()
            elif conn.complete:
                return
            elif conn.error is not None:
                raise conn.error
            else:
                await conn.wait(self._timeout_s)

    async def pipe(self, sink, drain) -> None:
        """Hand each piece of the body to ``sink`` as it arrives, until the answer is whole,
        from the connection's own callback: no task switch per piece. ``sink(piece)`` returns
        true when the client cannot take more now; reading then pauses until ``await drain()``
        returns. An exception ``sink`` raises ends the answer and is raised here. The read
        timeout counts from the last piece (its timer is set again only when it fires, not for
        each piece)."""
        conn = self._conn
        conn.last_arrival = conn.loop.time()
        conn.sink = sink
        timeout_s = self._timeout_s
        try:
            if conn.body and sink(conn.take()):  # what came with the head
                conn._pause()
            while not conn.complete:
                if conn.sink_error is not None:
                    raise conn.sink_error
                if conn.error is not None:
                    raise conn.error
                if conn.paused:
                    await drain()
                    conn._resume()
                    continue
                try:
                    await conn.wait(timeout_s)
                    timeout_s = self._timeout_s
                except ReadTimeout:
                    timeout_s = self._timeout_s - (conn.loop.time() - conn.last_arrival)
                    if timeout_s <= 0:
                        raise
        finally:
            conn.sink = None
        if conn.sink_error is not None:
            raise conn.sink_error

    def release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if conn.reusable() and not conn.body:
            self._pool.put(self._key, conn)
        else:
            conn.close()


class Pool:
    """Idle keep-alive connections per (host, port, tls), most recently used first."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._idle: dict[tuple, deque[_Connection]] = {}
        self._tls: ssl.SSLContext | None = None

    async def post(
        self,
        url: str,
        body: bytes,
        headers: dict[str, str] | bytes,
        *,
        connect_timeout_s: float | None,
        read_timeout_s: float | None,
        sent: Callable[[], None] | None = None,
    ) -> Response:
        """POST ``body`` and wait for the answer's head. ``headers``: a dict, or its lines as they
        go on the wire (``encode_headers``: a caller that sends the same ones often encodes them
        once). ``sent``: called once the request is written (before a new connection is waited
        for, where none is idle: the caller's work never waits on a connect), so the caller's
        own work overlaps the upstream's."""
        key, start = _split(url)
        conn = self._take_idle(key)
        if conn is None:
            if sent is not None:
                sent, then = None, sent
                then()
            conn = await self._connect(key, connect_timeout_s)
        conn._reset()
        lines = headers if type(headers) is bytes else encode_headers(headers)
        request = b"%s%sContent-Length: %d\r\n\r\n" % (start, lines, len(body))
        try:
            if len(body) < 65536:
                conn.transport.write(request + body)
            else:
                conn.transport.writelines((request, body))
            if sent is not None:
                sent()
            while not conn.headers_done:
                if conn.error is not None:
                    raise conn.error
                await conn.wait(read_timeout_s)
        except BaseException:
            conn.close()
            raise
        return Response(conn, self, key, read_timeout_s)

    def _take_idle(self, key: tuple) -> _Connection | None:
        idle = self._idle.get(key)
        deadline = self.loop.time() - KEEPALIVE_S
        while idle:
            conn = idle.pop()
            if not conn.closed and conn.idle_since > deadline:
                return conn
            conn.close()
        return None

    async def _connect(self, key: tuple, timeout_s: float | None) -> _Connection:
        host, port, tls = key
        if tls and self._tls is None:
            self._tls = ssl.create_default_context()
        try:
            async with asyncio.timeout(timeout_s):
                _, conn = await self.loop.create_connection(
                    lambda: _Connection(self.loop), host, port, ssl=self._tls if tls else None
                )
        except TimeoutError as exc:
            raise ConnectTimeout(f"no connection to {host}:{port} in {timeout_s} s") from exc
        except OSError as exc:  # refused, unreachable, does not resolve
            raise ConnectError(f"cannot connect to {host}:{port}: {exc!r}") from exc
        return conn

    def put(self, key: tuple, conn: _Connection) -> None:
        now = self.loop.time()
        conn.idle_since = now
        idle = self._idle.setdefault(key, deque())
        while idle and (idle[0].closed or idle[0].idle_since <= now - KEEPALIVE_S):
            idle.popleft().close()  # the oldest first: no idle list outgrows its busiest moment
        idle.append(conn)

    def close(self) -> None:
        for idle in self._idle.values():
            while idle:
                idle.pop().close()
        self._idle.clear()


def encode_headers(headers: dict[str, str]) -> bytes:
    """Header lines as they go on the wire (``name: value\\r\\n`` each)."""
    return b"".join(
        b"%s: %s\r\n" % (name.encode("latin-1"), value.encode("latin-1"))
        for name, value in headers.items()
    )


_pools: dict[asyncio.AbstractEventLoop, Pool] = {}


def pool() -> Pool:
    """The running loop's pool (pools of loops closed since are dropped as a new one is made)."""
    loop = asyncio.get_running_loop()
    found = _pools.get(loop)
    if found is None:
        for old in [old for old in _pools if old.is_closed()]:
            _pools.pop(old)
        found = _pools[loop] = Pool(loop)
    return found


def close_pool() -> None:
    """Close the running loop's idle connections (a test's loop, before it ends)."""
    found = _pools.pop(asyncio.get_running_loop(), None)
    if found is not None:
        found.close()
