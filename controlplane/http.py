"""The control plane's one outbound HTTP client: an aiohttp session per event loop.

aiohttp, not httpx: on the proxy path it measured ~3-6x the requests/s of httpx, whose pool scans
every connection per request (docs/benchmarks.md). Discovery, health checks, KV-event readers and
the periodic jobs use the same library, so there is one set of errors and timeouts to know.

A session is bound to the loop it was created on. The router process has one loop for its life;
tests and ``async_to_sync`` create and finish loops, and each job thread keeps one (``run``), so
sessions are kept per loop; one left on a loop that was closed is released later.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import threading

import aiohttp

from controlplane import http1

# the proxy's connections to its engines: many at once, kept alive, no total deadline (a stream
# lasts as long as it generates); per-request timeouts narrow these
CONNECTIONS = 4096
DNS_CACHE_S = 300
# an idle pooled connection is closed after this: shorter than the engines' servers keep one
# (uvicorn's default, vLLM's and SGLang's: 5 s), so a request never goes out on a connection the
# server is closing at that moment ("Can not write request body", 502: seen behind our engine
# under uvicorn, 106 of 1,000 streams sent 5 s after the last ones ended)
KEEPALIVE_S = 4.0


def auth_headers(api_key: str) -> dict:
    """``Authorization: Bearer`` for an engine that wants a key (none when empty)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def timeout(total: float | None = None, *, connect: float | None = None, read: float | None = None):
    return aiohttp.ClientTimeout(total=total, sock_connect=connect, sock_read=read)


class ClientPerLoop:
    """One pooled ``aiohttp.ClientSession`` per running event loop (the router's own, and any a
    job thread runs meanwhile: each keeps its session, none replaces another's). Sessions of
    loops that were closed without closing them (a test's, ``async_to_sync``'s) are released
    when the next session is made, and at exit."""

    def __init__(self):
        self._sessions: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}
        atexit.register(self._close_at_exit)

    def get(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        session = self._sessions.get(loop)
        if session is None or session.closed:
            self._release_orphans()
            connector = aiohttp.TCPConnector(
                limit=CONNECTIONS,
                limit_per_host=0,
                ttl_dns_cache=DNS_CACHE_S,
                keepalive_timeout=KEEPALIVE_S,
            )
            # auto_decompress off: the proxy passes bodies through as the engine encoded them
            session = aiohttp.ClientSession(
                connector=connector, timeout=timeout(), auto_decompress=False
            )
            self._sessions[loop] = session
        return session

    async def aclose(self) -> None:
        """Close the running loop's session (a loop's session can only be closed on it), and the
        proxy's pooled connections on it (controlplane/http1.py)."""
        http1.close_pool()
        session = self._sessions.pop(asyncio.get_running_loop(), None)
        if session is not None:
            await session.close()

    def _release_orphans(self) -> None:
        for loop in [loop for loop in self._sessions if loop.is_closed()]:
            session = self._sessions.pop(loop)
            connector = session.connector
            session.detach()  # closed from now on; its sockets died with their loop
            if connector is not None:
                connector._close()

    def _close_at_exit(self) -> None:
        """Close what is left: sessions of idle loops (the jobs' threads') on their own loop."""
        self._release_orphans()
        for loop, session in list(self._sessions.items()):
            if not loop.is_running():
                loop.run_until_complete(session.close())
            self._sessions.pop(loop, None)


_threads = threading.local()
_thread_loops: list[asyncio.AbstractEventLoop] = []  # every loop ``run`` made, to close at exit


def _close_thread_loops() -> None:
    """At exit, after the sessions on them were closed (``ClientPerLoop._close_at_exit``, which
    registers later and so runs first): close the job threads' loops. Left to the collector,
    one could be finalized after its self-pipe socket was, which prints a traceback ("Invalid
    file descriptor: -1") on a router stopped at once by a second SIGTERM."""
    for loop in _thread_loops:
        if not loop.is_closed() and not loop.is_running():
            loop.close()


atexit.register(_close_thread_loops)


def run(coro_fn, *args):
    """Run ``coro_fn(*args)`` from a job's thread, on a loop of that thread's own (never the
    router's, which may stop while the job runs). The loop, and with it its session, its
    connections and its resolver's thread, is kept for the thread's next job: the embedded
    scrape runs every 2 s, and a fresh loop each time cost the router's requests measurably
    (docs/benchmarks.md)."""
    loop = getattr(_threads, "loop", None)
    if loop is None or loop.is_closed():
        loop = _threads.loop = asyncio.new_event_loop()
        _thread_loops.append(loop)
    return loop.run_until_complete(coro_fn(*args))


# The process's client: every outbound request of the control plane goes through it. Code that
# runs its own short loop (``asyncio.run`` in a job) closes it before that loop ends.
client = ClientPerLoop()


async def get_json(url: str, *, api_key: str = "", timeout_s: float = 10.0):
    """(status, parsed JSON or None, text) of a GET; aiohttp.ClientError/TimeoutError propagate."""
    async with client.get().get(
        url, headers=auth_headers(api_key), timeout=timeout(timeout_s)
    ) as response:
        text = await response.text(errors="replace")
    try:
        body = json.loads(text) if text else None
    except ValueError:
        body = None
    return response.status, body, text


async def get_text(url: str, *, api_key: str = "", timeout_s: float = 10.0) -> tuple[int, str]:
    async with client.get().get(
        url, headers=auth_headers(api_key), timeout=timeout(timeout_s)
    ) as response:
        return response.status, await response.text(errors="replace")


ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)  # what a failed outbound request raises
