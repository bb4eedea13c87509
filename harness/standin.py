"""A stand-in OpenAI server that misbehaves on purpose, for the router's failure-path tests and
its overhead benchmark.

A bare HTTP/1.1 server on asyncio streams (keep-alive; streams sent with chunked encoding, so a
connection dropped mid-stream is an error to the reader, not the end of the body). It answers
``/health``, ``/server_info`` (with ``dp_size``), ``/v1/models``, and ``/v1/completions`` +
``/v1/chat/completions`` with a ``Behaviour`` chosen per request: the next scripted one, else
the one set for the request's ``data_parallel_rank``, else the default. ``/metrics`` serves
``metrics_text`` when the test sets one; with ``server_info=False`` it has no ``/server_info``
(404), so a ``metrics_text`` in vLLM's names makes discovery take it for vLLM.

In tests it runs in a background thread (``StandIn(...).start()``) and the test changes its
behaviours and reads what it received; for the benchmark it runs as a process:
``python -m harness.standin --port P --dp-size 4``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from collections import deque
from dataclasses import dataclass

REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    429: "Too Many Requests",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
}


@dataclass(frozen=True)
class Behaviour:
    """How to answer one generation request."""

    status: int = 200  # not 200: answer this status with an OpenAI error body
    head_delay_s: float = 0.0  # wait before the response starts (a long one hangs)
    tokens: int = 3  # text chunks of a streamed answer
    token_interval_s: float = 0.0
    drop_after: int | None = None  # streamed: abort the connection after this many events
    cached_tokens: int = 0  # reported in usage.prompt_tokens_details
    reset: bool = False  # abort the connection before answering anything
    padding: int = 0  # characters added to each streamed token's text (large events)

    @classmethod
    def hang(cls) -> Behaviour:
        return cls(head_delay_s=3600.0)


@dataclass
class Received:
    path: str
    body: dict
    rank: int | None
    disconnected: bool = False  # the client went away before the answer was complete
    completed: bool = False


class StandIn:
    def __init__(
        self,
        dp_size: int = 2,
        model: str = "standin",
        default: Behaviour | None = None,
        *,
        server_info: bool = True,
        metrics_text: str = "",
    ):
        self.dp_size, self.model = dp_size, model
        self.server_info = server_info
        self.metrics_text = metrics_text  # "": no /metrics (404); the test may change it
        self.default = default or Behaviour()
        self.by_rank: dict[int, Behaviour] = {}
        self.script: deque[Behaviour] = deque()
        self.received: list[Received] = []
        self.healthy = True
        self.port: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._thread: threading.Thread | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # ----- lifecycle -----------------------------------------------------------------------------
    def start(self, port: int = 0) -> StandIn:
        """Serve on 127.0.0.1:``port`` (0: any free one) from a daemon thread."""
        ready = threading.Event()

        def run():
            self._loop = asyncio.new_event_loop()
            self._loop.run_until_complete(self._listen(port))
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name=f"standin-{port}", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("the stand-in did not start")
        return self

    def stop(self) -> None:
        if self._loop is None:
            return
        asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    async def _listen(self, port: int) -> None:
        self._server = await asyncio.start_server(self._connection, "127.0.0.1", port, backlog=1024)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _close(self) -> None:
        self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        await self._server.wait_closed()

    def wait_received(self, count: int, timeout: float = 10.0) -> list[Received]:
        deadline = time.monotonic() + timeout
        while len(self.received) < count and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.received

    # ----- HTTP -----------------------------------------------------------------------------------
    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while await self._one_request(reader, writer):
                pass
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            self._writers.discard(writer)
            writer.transport.abort()

    async def _one_request(self, reader, writer) -> bool:
        """Serve one request; False when the connection should close."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return False
        lines = head.decode("latin-1").split("\r\n")
        method, target, _ = lines[0].split(" ", 2)
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                name, value = line.split(":", 1)
                headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length") or 0)
        body = await reader.readexactly(length) if length else b""
        keep_alive = headers.get("connection", "").lower() != "close"
        path = target.split("?", 1)[0]
        if method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
            if headers.get("x-dpmesh-pin-check"):  # the router's pin check: not a test's request
                rank = json.loads(body or b"{}").get("data_parallel_rank")
                extra = f"x-data-parallel-rank: {rank}\r\n" if isinstance(rank, int) else ""
                self._send(writer, 200, {"choices": [{"index": 0, "text": "x"}]}, extra)
                await writer.drain()
                return keep_alive
            return await self._generate(path, body, reader, writer) and keep_alive
        if method == "GET" and path in ("/server_info", "/get_server_info") and self.server_info:
            self._send(
                writer,
                200,
                {
                    "dp_size": self.dp_size,
                    "model_id": self.model,
                    "served_model_name": self.model,
                    "tp_size": 1,
                },
            )
        elif method == "GET" and path == "/health":
            self._send(
                writer,
                200 if self.healthy else 503,
                {"status": "ok" if self.healthy else "unavailable"},
            )
        elif method == "GET" and path == "/v1/models":
            self._send(
                writer, 200, {"object": "list", "data": [{"id": self.model, "object": "model"}]}
            )
        elif method == "GET" and path == "/metrics" and self.metrics_text:
            data = self.metrics_text.encode()
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/plain; version=0.0.4\r\n"
                + f"content-length: {len(data)}\r\n\r\n".encode()
                + data
            )
        else:
            self._send(writer, 404, error_body(404, f"{method} {path} is not served here"))
        await writer.drain()
        return keep_alive

    def _send(self, writer, status: int, payload: dict, extra: str = "") -> None:
        data = json.dumps(payload).encode()
        writer.write(
            f"HTTP/1.1 {status} {REASONS.get(status, 'Status')}\r\n"
            f"content-type: application/json\r\n"
            f"content-length: {len(data)}\r\n{extra}\r\n".encode()
            + data
        )

    def _choose(self, rank: int | None) -> Behaviour:
        if self.script:
            return self.script.popleft()
        return self.by_rank.get(rank, self.default) if rank is not None else self.default

    async def _generate(self, path: str, raw: bytes, reader, writer) -> bool:
        body = json.loads(raw or b"{}")
        rank = body.get("data_parallel_rank")
        record = Received(path, body, rank if isinstance(rank, int) else None)
        self.received.append(record)
        behaviour = self._choose(record.rank)
        if not await client_stays(reader, behaviour.head_delay_s):
            record.disconnected = True
            return False
        if behaviour.reset:
            writer.transport.abort()
            return False
        rank_header = f"x-data-parallel-rank: {rank}\r\n" if isinstance(rank, int) else ""
        if behaviour.status != 200:
            self._send(
                writer,
                behaviour.status,
                error_body(behaviour.status, f"stand-in says {behaviour.status}"),
                rank_header,
            )
            await writer.drain()
            record.completed = True
            return True
        chat = path.endswith("chat/completions")
        if body.get("stream") is True:
            return await self._stream(body, chat, behaviour, record, reader, writer, rank_header)
        text = "".join(f"tok{i} " for i in range(behaviour.tokens))
        choice = (
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "length",
            }
            if chat
            else {"index": 0, "text": text, "finish_reason": "length"}
        )
        self._send(
            writer,
            200,
            {
                "id": "cmpl-standin",
                "object": "chat.completion" if chat else "text_completion",
                "created": 0,
                "model": self.model,
                "choices": [choice],
                "usage": usage(behaviour),
            },
            rank_header,
        )
        await writer.drain()
        record.completed = True
        return True

    async def _stream(self, body, chat, behaviour, record, reader, writer, rank_header) -> bool:
        writer.write(
            f"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
            f"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n{rank_header}\r\n".encode()
        )
        pad = "x" * behaviour.padding
        events = [chunk(self.model, chat, f"tok{i} {pad}", None) for i in range(behaviour.tokens)]
        events.append(chunk(self.model, chat, None, "length"))
        options = body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage") is True:
            events.append(
                {
                    "id": "cmpl-standin",
                    "object": "chat.completion.chunk" if chat else "text_completion",
                    "created": 0,
                    "model": self.model,
                    "choices": [],
                    "usage": usage(behaviour),
                }
            )
        for sent, event in enumerate(events):
            if behaviour.drop_after is not None and sent >= behaviour.drop_after:
                writer.transport.abort()
                return False
            if sent and not await client_stays(reader, behaviour.token_interval_s):
                record.disconnected = True
                return False
            write_chunk(writer, b"data: " + json.dumps(event).encode() + b"\n\n")
            await writer.drain()
        write_chunk(writer, b"data: [DONE]\n\n")
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        record.completed = True
        return True


async def client_stays(reader: asyncio.StreamReader, seconds: float) -> bool:
    """Wait ``seconds``; False as soon as the client closes its end."""
    if seconds <= 0:
        return True
    try:
        data = await asyncio.wait_for(reader.read(1), timeout=seconds)
    except TimeoutError:
        return True
    return bool(data)


def write_chunk(writer, data: bytes) -> None:
    writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")


def error_body(status: int, message: str) -> dict:
    return {
        "error": {
            "message": message,
            "type": "invalid_request_error" if status < 500 else "server_error",
            "param": None,
            "code": status,
        }
    }


def usage(behaviour: Behaviour) -> dict:
    return {
        "prompt_tokens": 5,
        "completion_tokens": behaviour.tokens,
        "total_tokens": 5 + behaviour.tokens,
        "prompt_tokens_details": {"cached_tokens": behaviour.cached_tokens},
    }


def chunk(model: str, chat: bool, text: str | None, finish: str | None) -> dict:
    if chat:
        choice = {"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish}
    return {
        "id": "cmpl-standin",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": 0,
        "model": model,
        "choices": [choice],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="a zero-work OpenAI stand-in (router benchmarks)")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--dp-size", type=int, default=4)
    parser.add_argument("--model", default="standin")
    parser.add_argument("--tokens", type=int, default=Behaviour.tokens, help="streamed chunks")
    parser.add_argument("--token-interval-s", type=float, default=Behaviour.token_interval_s)
    args = parser.parse_args(argv)
    default = Behaviour(tokens=args.tokens, token_interval_s=args.token_interval_s)
    standin = StandIn(dp_size=args.dp_size, model=args.model, default=default)
    standin.received = _Discard()  # a benchmark sends millions; keep nothing

    async def serve():
        await standin._listen(args.port)
        print(f"stand-in on {standin.url} (dp_size {args.dp_size})", flush=True)
        await asyncio.Event().wait()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass


class _Discard(list):
    def append(self, item) -> None:
        pass


if __name__ == "__main__":
    main()
