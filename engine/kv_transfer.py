"""Prefill/decode disaggregation: a decode rank pulls a prompt's KV blocks from the prefill rank
that computed them, over TCP.

A prefill rank (``runengine --disaggregation-mode prefill``) ends a request sent for a remote
decode by holding its full prompt blocks (``LLMEngine.held``) and answering where to fetch them;
its ``KVServer`` (one listener per rank, in a thread of the rank process) serves them. A decode
rank given those parameters pulls the blocks it does not already cache (``pull``, in a thread of
the decode rank), caches them as its own (``LLMEngine.import_prefix``), then runs the request as
usual: the pulled blocks are prefix hits, the rest of the prompt (at least its last token) is
computed there, and a later request with the same prefix pulls nothing.

The wire, one pull per connection: the decode side sends a frame (4-byte big-endian length, then
JSON) ``{"op": "pull", "request_id", "blocks": [index, ...], "layout": {...}}`` (or ``"op":
"release"``: the decode side needs nothing, or gave up); the prefill side answers a frame
``{"ok": true, "digests": [...], "bytes": n}`` followed by n bytes of K and V
(``ModelRunner.export_blocks``), or ``{"ok": false, "error": "..."}``. A layout that differs
(block size, layers, heads, head size, dtype) is refused at that first frame; so is a request id
that holds nothing (never prefilled here, pulled already, or expired after
``--kv-transfer-timeout-secs``). The held blocks are released after the answer is sent, whether
or not the decode side read it: one pull per prefill.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import socket
import struct
import threading
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

HEADER = struct.Struct(">I")
MAX_FRAME = 16 * 2**20  # a JSON frame: block lists and digests, never KV
CONNECT_TIMEOUT_S = 5.0
IO_TIMEOUT_S = 60.0
NOT_HELD = (
    "no KV is held there for that request (never prefilled there, pulled already, or expired)"
)


class TransferError(Exception):
    """A pull that failed: ``status`` is the HTTP status the decode side answers with (4xx: the
    parameters were wrong or stale; 502: the prefill side failed)."""

    def __init__(self, message: str, status: int = 502):
        super().__init__(message)
        self.status = status


def send_frame(sock: socket.socket, payload: dict) -> None:
    data = json.dumps(payload).encode()
    sock.sendall(HEADER.pack(len(data)) + data)


async def ask(host: str, port: int, payload: dict, timeout_s: float) -> dict:
    """One frame sent to a listener of this framing (a prefill worker's bootstrap listener) and
    its one-frame answer, from an event loop. Raises OSError, TimeoutError, ValueError or
    asyncio.IncompleteReadError."""
    async with asyncio.timeout(timeout_s):
        reader, writer = await asyncio.open_connection(host, port)
        try:
            data = json.dumps(payload).encode()
            writer.write(HEADER.pack(len(data)) + data)
            (length,) = HEADER.unpack(await reader.readexactly(HEADER.size))
            answer = json.loads(await reader.readexactly(min(length, 65536)))
        finally:
            writer.close()
    if not isinstance(answer, dict):
        raise ValueError("the answer is not a JSON object")
    return answer


def recv_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray(n)
    view, got = memoryview(out), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if not k:
            raise ConnectionError(f"the connection closed after {got} of {n} bytes")
        got += k
    return bytes(out)


def recv_frame(sock: socket.socket) -> dict:
    (length,) = HEADER.unpack(recv_exact(sock, HEADER.size))
    if length > MAX_FRAME:
        raise ConnectionError(f"a frame of {length} bytes is past the limit")
    payload = json.loads(recv_exact(sock, length))
    if not isinstance(payload, dict):
        raise ConnectionError("a frame is not a JSON object")
    return payload


def serve_connections(sock: socket.socket, handle, name: str) -> None:
    """Accept on ``sock`` in a thread called ``name`` until it is closed; each connection is
    ``handle(conn)`` in a thread of its own."""

    def accept() -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, name=name, daemon=True).start()


@dataclass
class Served:
    """A pull the server finished (or refused after taking the hold): the rank's loop releases
    the request's held blocks."""

    request_id: str
    blocks: int
    nbytes: int
    seconds: float


class KVServer:
    """A prefill rank's listener. ``holds`` is the rank's view of its held blocks that this
    thread may read: hold key -> (block ids, digests, cached tokens), kept by the rank's loop; a
    key being served is in ``busy`` (the loop does not expire it meanwhile); each pull served
    goes to ``done`` for the loop to release. A pull may ``wait_s`` for its key to be offered
    (SGLang's protocol sends the decode leg while the prefill runs); a prefill that failed is
    ``fail``-ed, so a pull waiting for it ends at once instead of at its deadline."""

    FAILURES_KEPT = 1024

    def __init__(self, host: str, port: int, layout: dict, export):
        self.layout, self.export = layout, export
        self.lock = threading.Condition()
        self.holds: dict[str, tuple[list[int], list[int], int]] = {}
        self.busy: set[str] = set()
        self.failed: dict[str, str] = {}  # key -> why its prefill ended without KV
        self.done: queue.SimpleQueue[Served] = queue.SimpleQueue()
        self.sock = socket.create_server((host, port))
        self.port = self.sock.getsockname()[1]
        serve_connections(self.sock, self._serve, "kv-server")

    def offer(self, key: str, block_ids: list[int], digests: list[int], cached: int = 0) -> None:
        with self.lock:
            self.holds[key] = (block_ids, digests, cached)
            self.lock.notify_all()

    def fail(self, key: str, reason: str) -> None:
        with self.lock:
            self.failed[key] = reason
            while len(self.failed) > self.FAILURES_KEPT:
                del self.failed[next(iter(self.failed))]
            self.lock.notify_all()

    def take(self, key: str) -> bool:
        """Withdraw an offer nobody is pulling (to expire it): False if a pull has it now (the
        pull's ``Served`` releases it then)."""
        with self.lock:
            return self.holds.pop(key, None) is not None or key not in self.busy

    def close(self) -> None:
        self.sock.close()

    def _claim(self, key, wait_s: float):
        """The offer under ``key`` taken for this pull (busy meanwhile), waiting up to
        ``wait_s`` for it; else an error message."""
        if not isinstance(key, str):
            return "'request_id' must be a string"
        deadline = time.monotonic() + max(0.0, min(float(wait_s or 0), IO_TIMEOUT_S))
        with self.lock:
            while True:
                found = self.holds.pop(key, None)
                if found is not None:
                    self.busy.add(key)
                    return found
                if key in self.failed:
                    return f"the prefill ended without KV to send: {self.failed[key]}"
                left = deadline - time.monotonic()
                if left <= 0:
                    return NOT_HELD
                self.lock.wait(left)

    def _serve(self, conn: socket.socket) -> None:
        key = None
        with conn:
            conn.settimeout(IO_TIMEOUT_S)
            try:
                ask = recv_frame(conn)
                if ask.get("layout") != self.layout:
                    send_frame(conn, {"ok": False, "error": self._mismatch(ask.get("layout"))})
                    return  # nothing taken: the hold stays for a proper pull
                found = self._claim(ask.get("request_id"), ask.get("wait_s") or 0)
                if isinstance(found, str):
                    send_frame(conn, {"ok": False, "error": found})
                    return
                key = ask["request_id"]
                self._answer(conn, ask, key, *found)
            except Exception as exc:  # a broken pull must not end the listener's thread silently
                logger.warning("KV pull for %s failed: %r", key, exc)
                if key is not None:
                    self.done.put(Served(key, 0, 0, 0.0))
            finally:
                if key is not None:
                    with self.lock:
                        self.busy.discard(key)

    def _answer(self, conn, ask: dict, key: str, block_ids, digests, cached: int) -> None:
        started = time.monotonic()
        wanted = ask.get("blocks") if ask.get("op") == "pull" else []
        if not isinstance(wanted, list) or not all(
            isinstance(i, int) and 0 <= i < len(block_ids) for i in wanted
        ):
            error = f"'blocks' must be indices below {len(block_ids)}"
            send_frame(conn, {"ok": False, "error": error})
            self.done.put(Served(key, 0, 0, 0.0))
            return
        data = self.export([block_ids[i] for i in wanted]) if wanted else b""
        digests = [digests[i] for i in wanted]
        send_frame(conn, {"ok": True, "digests": digests, "bytes": len(data),
                          "cached_tokens": cached})  # fmt: skip
        if data:
            conn.sendall(data)
        self.done.put(Served(key, len(wanted), len(data), time.monotonic() - started))

    def _mismatch(self, theirs) -> str:
        return (
            f"the KV layouts differ: this prefill rank has {self.layout}, the decode rank "
            f"{theirs}; prefill and decode must serve the same model, dtype and --block-size"
        )


def pull(
    host: str,
    port: int,
    key: str,
    blocks: list[int],
    digests: list[int],
    layout: dict,
    wait_s: float = 0.0,
) -> tuple[bytes, int]:
    """Fetch the KV of ``blocks`` (indices into the prefill's held blocks) held under ``key``
    from a prefill rank, checking that they are the blocks ``digests`` name; with no ``blocks``,
    only release the hold. ``wait_s``: how long the prefill rank may wait for the prefill to
    end. Returns (the bytes, the tokens the prefill found cached). Raises ``TransferError``."""
    op = "pull" if blocks else "release"
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S) as sock:
            sock.settimeout(IO_TIMEOUT_S + wait_s)
            send_frame(sock, {"op": op, "request_id": key, "blocks": blocks, "layout": layout,
                              "wait_s": wait_s})  # fmt: skip
            answer = recv_frame(sock)
            if not answer.get("ok"):
                error = answer.get("error")
                raise TransferError(f"the prefill rank refused the pull: {error}", 400)
            if answer.get("digests") != digests:
                raise TransferError(
                    "the prefill rank holds other blocks than this prompt's (another prompt, "
                    "model or tokenizer there)",
                    400,
                )
            data = recv_exact(sock, int(answer.get("bytes", 0))) if blocks else b""
            return data, int(answer.get("cached_tokens") or 0)
    except (OSError, ValueError) as exc:
        raise TransferError(f"pulling KV from {host}:{port} failed: {exc!r}") from exc
