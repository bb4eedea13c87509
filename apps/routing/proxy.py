"""Forwarding one OpenAI request: route, inject the rank, retry before the first byte, relay.

Retries (408/429/500/502/503/504, connection errors, connect timeouts) go to another target with
exponential backoff, but only while nothing has reached the client. A read timeout is not
retried: the engine may be generating, and a retry would run the request twice. A streamed response is
relayed event by event as it arrives; if the client did not ask for usage, the usage event the
router asked for (to learn the engine's cached tokens) is dropped on the way. Every path ends the
request's load exactly once: finish, upstream error, timeout, client disconnect.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random

import aiohttp
import httpx

from apps.replicas.discovery import auth_headers
from apps.routing.router import NoTarget, Routed, Router

logger = logging.getLogger(__name__)

RETRYABLE = {408, 429, 500, 502, 503, 504}


class ProxyError(Exception):
    """An error answer for the client; ``raw`` is an upstream's own error body, passed on as is."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        raw: bytes | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.raw = status, message, type, raw

    def body(self) -> bytes:
        if self.raw is not None:
            return self.raw
        return json.dumps(
            {
                "error": {
                    "message": self.message,
                    "type": self.type,
                    "param": None,
                    "code": self.status,
                }
            }
        ).encode()


class Upstream:
    """The router's pooled HTTP client, created on the loop that first needs it."""

    def __init__(self):
        self.client: httpx.AsyncClient | None = None
        self.loop = None

    def get(self, config) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if self.client is None or self.loop is not loop:
            limits = httpx.Limits(max_connections=4096, max_keepalive_connections=512)
            timeout = httpx.Timeout(config.request_timeout_s, connect=config.connect_timeout_s)
            self.client, self.loop = httpx.AsyncClient(limits=limits, timeout=timeout), loop
        return self.client

    async def aclose(self) -> None:
        """Close the client if it belongs to the running loop; a client of another (finished)
        loop cannot be closed from this one, so it is only dropped."""
        client, loop = self.client, self.loop
        self.client = self.loop = None
        if client is not None and loop is asyncio.get_running_loop():
            await client.aclose()


upstream = Upstream()  # discovery and health checks


class ProxyResponse:
    """An upstream answer on the proxy path (aiohttp: measured ~3-6x the requests/s of httpx on
    this path, whose pool scans every connection per request)."""

    def __init__(self, response: aiohttp.ClientResponse):
        self._response = response
        self.status_code = response.status
        self.headers = response.headers  # case-insensitive

    async def aread(self) -> bytes:
        return await self._response.read()

    def aiter_raw(self):
        return self._response.content.iter_any()

    async def aclose(self) -> None:
        self._response.release()


class ProxyClient:
    """The proxy's pooled aiohttp session, created on the loop that first needs it."""

    def __init__(self):
        self.session: aiohttp.ClientSession | None = None
        self.loop = None

    def get(self, config) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self.session is None or self.loop is not loop:
            timeout = aiohttp.ClientTimeout(
                total=None,
                sock_connect=config.connect_timeout_s,
                sock_read=config.request_timeout_s,
            )
            connector = aiohttp.TCPConnector(limit=4096, limit_per_host=0, ttl_dns_cache=300)
            self.session = aiohttp.ClientSession(
                timeout=timeout, connector=connector, auto_decompress=False
            )
            self.loop = loop
        return self.session

    async def aclose(self) -> None:
        """As ``Upstream.aclose``: close on the owning loop, drop otherwise."""
        session, loop = self.session, self.loop
        self.session = self.loop = None
        if session is not None and loop is asyncio.get_running_loop():
            await session.close()

    async def post(self, config, url: str, data: bytes, headers: dict) -> ProxyResponse:
        return ProxyResponse(await self.get(config).post(url, data=data, headers=headers))


proxy_client = ProxyClient()


def upstream_payload(body: dict, routed: Routed, stream: bool) -> bytes:
    payload = dict(body)
    if routed.target.rank is not None:
        payload.pop("data-parallel-rank", None)
        payload["data_parallel_rank"] = routed.target.rank
    if stream:
        payload["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    return json.dumps(payload).encode()


async def open_upstream(
    router: Router, body: dict, *, chat: bool, path: str, stream: bool
) -> tuple[Routed, ProxyResponse]:
    """Send the request to a chosen target, retrying elsewhere while nothing reached the client.
    Returns the routed request and the open response (a 2xx, or the last error to pass on)."""
    config = router.config
    model = body.get("model") if isinstance(body.get("model"), str) else None
    tried: set[str] = set()
    last: ProxyError | None = None
    for attempt in range(config.max_retries + 1):
        try:
            routed = router.route(body, chat, model, exclude=tried)
        except NoTarget as exc:
            router.stats.no_target += 1
            raise last or ProxyError(503, str(exc), "server_error") from exc
        tried.add(routed.target.key)
        worker = routed.target.worker
        headers = {"content-type": "application/json", **auth_headers(worker.api_key)}
        try:
            response = await proxy_client.post(
                config, worker.url + path, upstream_payload(body, routed, stream), headers
            )
        except aiohttp.ConnectionTimeoutError as exc:
            last = ProxyError(
                504, f"upstream {routed.target.key} timed out connecting: {exc!r}", "server_error"
            )
        except (TimeoutError, aiohttp.SocketTimeoutError) as exc:
            # The request reached the engine and may be generating: retrying would run it twice.
            router.finish(routed, ok=False)
            raise ProxyError(
                504, f"upstream {routed.target.key} timed out: {exc!r}", "server_error"
            ) from exc
        except aiohttp.ClientError as exc:
            last = ProxyError(
                502, f"upstream {routed.target.key} unreachable: {exc!r}", "server_error"
            )
        except BaseException as exc:  # the client left (cancelled) or worse
            router.finish(routed, ok=False, aborted=isinstance(exc, asyncio.CancelledError))
            raise
        else:
            if response.status_code not in RETRYABLE or attempt == config.max_retries:
                return routed, response
            try:
                raw = await response.aread()
            finally:
                await response.aclose()
            last = ProxyError(
                response.status_code,
                f"upstream {routed.target.key} answered {response.status_code}",
                "server_error",
                raw=raw or None,
            )
        routed.target.breaker.record_failure()
        router.finish(routed, ok=False)
        router.stats.retries += 1
        logger.warning("retrying after %s (attempt %d)", last.message, attempt + 1)
        await asyncio.sleep(config.retry_backoff_s * (1.5**attempt) * (1 + 0.2 * random.random()))
    raise last


def usage_of(event: bytes) -> dict | None:
    """The usage object of an SSE event, if it carries one (cheap check before parsing)."""
    if b'"usage"' not in event:
        return None
    try:
        data = json.loads(event[event.index(b"{") :])
    except ValueError:
        return None
    return data.get("usage") if isinstance(data, dict) else None


def is_usage_only(event: bytes) -> bool:
    try:
        data = json.loads(event[event.index(b"{") :])
    except ValueError:
        return False
    return isinstance(data, dict) and data.get("usage") is not None and not data.get("choices")


async def relay(router: Router, routed: Routed, response: ProxyResponse, client_wants_usage: bool):
    """Yield the upstream's SSE events as they arrive; end the load however the stream ends."""
    buffer = b""
    usage = None
    ok = aborted = False
    try:
        async for chunk in response.aiter_raw():
            buffer += chunk
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                if not routed.ticket.prefilled:
                    router.first_token(routed)
                found = usage_of(event)
                if found is not None:
                    usage = found
                    if not client_wants_usage and is_usage_only(event):
                        continue
                yield event + b"\n\n"
        if buffer:
            yield buffer
        ok = True
    except (TimeoutError, aiohttp.ClientError) as exc:
        error = ProxyError(
            502, f"upstream {routed.target.key} failed mid-stream: {exc!r}", "server_error"
        )
        yield b"data: " + error.body() + b"\n\ndata: [DONE]\n\n"
    except (asyncio.CancelledError, GeneratorExit):  # the client left mid-stream
        aborted = True
        raise
    finally:
        router.finish(routed, ok=ok, usage=usage, aborted=aborted)
        await response.aclose()
