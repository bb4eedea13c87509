"""Serving an ASGI app under uvicorn (uvloop and httptools), with the guards a server in front of
untrusted clients needs and uvicorn lacks, and without uvicorn's own signal handling (the
process's drain, serving/drain.py, owns SIGTERM and SIGINT, as it does under daphne).

- A client must finish a request's line and headers within ``header_timeout_s`` (default
  ``HEADER_TIMEOUT_S``; give or take the sweep's ``SWEEP_S``: deadlines are times the server
  looks at once a second, not a timer per request) of its first byte (or of connecting):
  httptools sets no limit on either,
  so a client sending a header byte a second held its connection, and the headers it sent,
  forever. Past the timeout the connection is closed (nginx's ``client_header_timeout``; an
  answer, 408, would need the request line it may not have).
- At most ``MAX_CONNECTIONS`` connections and requests at once; past it uvicorn answers 503.
- Idle keep-alive connections are kept ``KEEPALIVE_S`` (75 s, as nginx), not uvicorn's 5 s, which
  is shorter than common clients' pools keep them and made them race its close.
- The body's own deadline is the application's (serving.asgi ``read_body``): uvicorn hands it
  the body as it arrives.
- A request that declares a small body (``Content-Length`` up to uvicorn's buffer, no ``Expect:
  100-continue``) starts its application once the body is all there, not at its headers:
  clients that write the head and the body apart (httpx, so the OpenAI SDK; aiohttp) had the
  application start, find no body, set a timer and wait for it, then resume: a task step, a
  timer and an event a request. Past ``BODY_GRACE_S`` without the whole body (a slow sender) it
  starts all the same and reads the rest under its own deadline, as any larger body does.
- The request's connection, directly (``DirectBody``, in the scope's extensions under
  serving.asgi ``DIRECT_BODY``), for the router's hot path: a body that has all arrived taken
  without a timer; a whole answer written in one write (head and body), not two; a streamed
  answer's events written from the upstream connection's callback, where ``send`` would cost a
  task switch, a message dict and five awaits per event; a client leaving told by a callback, not
  a task per request waiting for it.
- ``Server.stop`` ends what still runs (a drain that ran out of time) before uvicorn's own
  shutdown: each request's task is cancelled and its answer ended cleanly (a stream stops where
  it was, without ``[DONE]``; one that had not started is a 503), where uvicorn would wait, then
  cancel them itself and log each as an exception in the application.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import uvicorn
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import (
    HEADER_RE,
    HEADER_VALUE_RE,
    STATUS_LINE,
    HttpToolsProtocol,
)

from serving.asgi import DIRECT_BODY, direct_body, send_json
from serving.openai_fields import APIError

HEADER_TIMEOUT_S = 20.0
MAX_CONNECTIONS = 8192
# an idle keep-alive connection is kept this long (uvicorn's default is 5 s): longer than the
# clients' pools keep theirs (httpx 5 s, aiohttp 15 s, the router's own 4 s), so a client does
# not send a request on a connection this server is closing at that moment
KEEPALIVE_S = 75.0
# how long a request whose small body is on its way waits for the rest before its application
# starts anyway (a head and a body written apart arrive well within it); read by the sweep, so
# up to ``SWEEP_S`` later
BODY_GRACE_S = 0.5
# how often the server looks for passed deadlines (headers, a body's grace, a keep-alive)
SWEEP_S = 1.0


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline on each request's line and headers, its
    deadlines kept as times that ``Server``'s sweep reads (``sweep``) rather than a timer armed
    and cancelled per request (uvloop's ``call_later`` and ``cancel`` cost ~1.8 us a pair, and a
    request armed three: its headers, its body's grace, the keep-alive after its answer)."""

    header_timeout_s: float = HEADER_TIMEOUT_S
    directs: list[DirectBody] | None = None  # of the requests on this connection not answered
    header_since: float | None = None  # the request line and headers are awaited since
    deferred: tuple | None = None  # (cycle, app) of a request waiting for its small body
    deferred_since = 0.0
    idle_since: float | None = None  # answered, kept alive for the next request since

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.header_since = self.loop.time()

    def sweep(self, now: float) -> None:
        """Act on the deadlines passed at ``now`` (``loop.time()``): headers too slow (the
        connection is closed), a small body too slow (its application starts and reads the rest
        under its own deadline), a kept-alive connection idle too long (closed)."""
        if self.header_since is not None and now - self.header_since >= self.header_timeout_s:
            self.header_since = None
            if not self.transport.is_closing():
                self.transport.close()
        if self.deferred is not None and now - self.deferred_since >= BODY_GRACE_S:
            self._start_deferred()
        if self.idle_since is not None and now - self.idle_since >= self.timeout_keep_alive:
            self.idle_since = None
            self.timeout_keep_alive_handler()

    def _start_asgi_task(self, cycle, app) -> None:
        if cycle.more_body and not self.expect_100_continue and _small_body(cycle.scope):
            self.deferred = (cycle, app)  # started by on_message_complete, or the sweep
            self.deferred_since = self.loop.time()
            return
        super()._start_asgi_task(cycle, app)

    def _start_deferred(self, cancel: bool = False) -> None:
        """Start the request that waited for its body (``cancel``: started cancelled, so that it
        answers as a request the server stopped)."""
        deferred, self.deferred = self.deferred, None
        if deferred is not None:
            before = set(self.tasks) if cancel else None
            super()._start_asgi_task(*deferred)
            for task in self.tasks - before if cancel else ():
                task.cancel()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self.header_since is None:
            self.header_since = self.loop.time()

    def on_headers_complete(self) -> None:
        self.header_since = None
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle.scope is self.scope:
            direct = DirectBody(cycle)
            self.scope.setdefault("extensions", {})[DIRECT_BODY] = direct
            live = [d for d in self.directs or () if not d.cycle.response_complete]
            live.append(direct)
            self.directs = live

    def on_message_complete(self) -> None:
        super().on_message_complete()
        direct = self.directs[-1] if self.directs else None
        if direct is not None and direct.cycle is self.cycle:
            direct.body_at = time.perf_counter()
        if self.deferred is not None and self.deferred[0] is self.cycle:
            self._start_deferred()

    def on_response_complete(self) -> None:
        """uvicorn's (uvicorn 0.55), with the keep-alive's start noted instead of a timer."""
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self._unset_keepalive_if_required()
        self.flow.resume_reading()
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
        else:
            self.idle_since = self.loop.time()

    def _unset_keepalive_if_required(self) -> None:
        self.idle_since = None
        super()._unset_keepalive_if_required()

    def shutdown(self) -> None:
        if self.deferred is not None:  # the server stops: answered as a request it cut
            self._start_deferred(cancel=True)
        super().shutdown()

    def connection_lost(self, exc) -> None:
        self.header_since = self.idle_since = None
        self.deferred = None  # a request whose body never came: nothing started
        super().connection_lost(exc)
        for direct in self.directs or ():
            if direct.cycle.disconnected and direct.on_lost is not None:
                direct.on_lost()
        self.directs = None


class DirectBody:
    """One request's connection, for a caller that wants less than ASGI's round trips: the same
    framing and state changes uvicorn's ``send`` and ``receive`` make, done in place."""

    __slots__ = ("cycle", "on_lost", "body_at")

    def __init__(self, cycle):
        self.cycle = cycle
        self.on_lost = None  # called when the client leaves before its answer is whole
        self.body_at: float | None = None  # perf_counter() when the body's last byte was parsed

    @property
    def disconnected(self) -> bool:
        return self.cycle.disconnected

    def whole_body(self) -> bytes | None:
        """The request's body when all of it has arrived (else None: read it with ``receive``)."""
        cycle = self.cycle
        if cycle.more_body or cycle.disconnected or cycle.response_complete:
            return None
        body = bytes(cycle.body)
        cycle.body = bytearray()
        cycle.message_event.clear()
        cycle.flow.resume_reading()
        return body

    def respond(self, status: int, content_type: bytes, headers: list, body: bytes) -> bool:
        """Write a whole answer (head and body) in one write; False when it cannot be done here
        (the answer has started, the client left, a header it does not pass), for ``send``."""
        cycle = self.cycle
        if cycle.response_started or cycle.disconnected or cycle.scope["method"] == "HEAD":
            return False
        pairs = (*cycle.default_headers, (b"content-type", content_type), *headers)
        names, values = zip(*pairs, strict=True)
        if not _FRAMING.isdisjoint(map(bytes.lower, names)):
            return False
        # uvicorn's checks of each name and value, as one search each: a tab may be in a value,
        # not in a name, so the values are searched joined by tabs and the names by nothing
        if HEADER_RE.search(b"".join(names)) or HEADER_VALUE_RE.search(b"\t".join(values)):
            return False
        lines = b"".join([b"%s: %s\r\n" % (name, value) for name, value in pairs])
        close = b"" if cycle.keep_alive else b"connection: close\r\n"
        content = b"%s%s%scontent-length: %d\r\n\r\n%s" % (
            STATUS_LINE[status], lines, close, len(body), body)  # fmt: skip
        cycle.response_started = True
        cycle.waiting_for_100_continue = False
        cycle.chunked_encoding = False
        cycle.expected_content_length = 0
        cycle.transport.write(content)
        cycle.response_complete = True
        cycle.message_event.set()
        if not cycle.keep_alive:
            cycle.transport.close()
        cycle.on_response()
        return True

    def ready(self) -> bool:
        """A streamed answer has started, chunked, and has not ended."""
        cycle = self.cycle
        return bool(
            cycle.response_started
            and cycle.chunked_encoding
            and not cycle.response_complete
            and cycle.scope["method"] != "HEAD"
        )

    def write(self, data: bytes) -> None:
        """One chunk of a streamed answer."""
        cycle = self.cycle
        if data and not cycle.disconnected and not cycle.response_complete:
            cycle.transport.write(b"%x\r\n%b\r\n" % (len(data), data))

    @property
    def paused(self) -> bool:
        """The client's buffer is full: wait for ``drain`` before writing more."""
        return self.cycle.flow.write_paused and not self.cycle.disconnected

    async def drain(self) -> None:
        cycle = self.cycle
        if cycle.flow.write_paused and not cycle.disconnected:
            await cycle.flow.drain()


def _small_body(scope) -> bool:
    """The request declares a body of at most uvicorn's buffer (``HIGH_WATER_LIMIT``: a larger
    one pauses the connection until the application reads it)."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            return value.isdigit() and 0 < int(value) <= HIGH_WATER_LIMIT
    return False


# headers ``respond`` leaves to uvicorn (it writes the length itself)
_FRAMING = frozenset((b"content-length", b"transfer-encoding", b"connection"))


class Server(uvicorn.Server):
    cut: Cut

    @contextlib.contextmanager
    def capture_signals(self):  # the process's drain handles SIGTERM and SIGINT
        yield

    async def on_tick(self, counter: int) -> bool:
        if counter % round(SWEEP_S / 0.1) == 0:  # uvicorn ticks every 0.1 s
            now = asyncio.get_running_loop().time()
            for connection in list(self.server_state.connections):
                sweep = getattr(connection, "sweep", None)  # a websocket's has none
                if sweep is not None:
                    sweep(now)
        return await super().on_tick(counter)

    def stop(self) -> None:
        """Cut whatever still runs, then let uvicorn shut down."""
        self.cut.cutting = True
        for task in list(self.server_state.tasks):
            task.cancel()
        self.should_exit = True


class Cut:
    """The ASGI app wrapped so that a request cancelled by ``Server.stop`` ends its answer (or,
    a websocket, just ends) instead of raising into uvicorn."""

    def __init__(self, app):
        self.app, self.cutting = app, False

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            try:
                return await self.app(scope, receive, send)
            except asyncio.CancelledError:
                if not self.cutting:
                    raise
                return None
        direct = direct_body(scope)
        # where the server answers on the connection directly, it tells how far the answer went;
        # else ``send`` is watched for it
        tracked = _Tracked(send) if direct is None else None
        try:
            return await self.app(scope, receive, send if tracked is None else tracked)
        except asyncio.CancelledError:
            if not self.cutting:
                raise
        if tracked is None:
            await _end_cut(send, direct.cycle.response_started, direct.cycle.response_complete)
        else:
            await _end_cut(send, tracked.started, tracked.ended)
        return None


class _Tracked:
    """An ASGI ``send`` that notes whether the answer started and ended."""

    __slots__ = ("send", "started", "ended")

    def __init__(self, send):
        self.send, self.started, self.ended = send, False, False

    async def __call__(self, message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
        elif message["type"] == "http.response.body" and not message.get("more_body"):
            self.ended = True
        await self.send(message)


async def _end_cut(send, started: bool, ended: bool) -> None:
    """End the answer of a request the server cut: a stream stops where it was, an answer not
    begun is a 503."""
    if ended:
        return
    if started:
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    else:
        await send_json(send, 503, APIError(503, "the server is stopping").body())


def make_server(
    app,
    host: str,
    port: int,
    backlog: int,
    graceful_s: float,
    header_timeout_s: float = HEADER_TIMEOUT_S,
) -> Server:
    """A uvicorn server of ``app`` on ``host:port``, to run on the current (uvloop) loop with
    ``loop.run_until_complete(server.serve())``; ``server.stop()`` stops it."""
    protocol = type(
        "HttpProtocol", (GuardedHttpToolsProtocol,), {"header_timeout_s": header_timeout_s}
    )
    cut = Cut(app)
    config = uvicorn.Config(
        cut,
        host=host,
        port=port,
        loop="none",
        http=protocol,
        ws="wsproto",
        lifespan="off",
        backlog=backlog,
        limit_concurrency=MAX_CONNECTIONS,
        timeout_keep_alive=KEEPALIVE_S,
        log_level="warning",
        access_log=False,
        proxy_headers=False,  # a client's X-Forwarded-For is not taken for its address
        server_header=False,
        timeout_graceful_shutdown=graceful_s,
    )
    server = Server(config)
    server.cut = cut
    return server
