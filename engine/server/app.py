"""The engine's ASGI application: OpenAI endpoints, /server_info, /health, /metrics.

A plain ASGI callable (no framework) served by daphne: the hot path is parse → choose rank →
relay outputs, and each streamed token leaves as its own SSE event.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid

from engine.server import openai_api as api
from engine.server.frontend import EngineClient, RankFailed, RankUnavailable
from engine.server.metrics import make_registry, render

logger = logging.getLogger("engine.front")

JSON = b"application/json"


class ClientGone(Exception):
    pass


class EngineApp:
    def __init__(self, client: EngineClient, tokenizer, server_info: dict, max_body_bytes: int = 4 * 2**20):
        self.client, self.tokenizer, self.info = client, tokenizer, server_info
        self.max_body_bytes = max_body_bytes
        self.model = server_info["served_model_name"]
        self.model_names = {self.model, server_info["model_id"]}
        self.registry = make_registry(client, self.model)
        self.routes = {
            ("GET", "/health"): self.health,
            ("GET", "/server_info"): self.server_info,
            ("GET", "/get_server_info"): self.server_info,
            ("GET", "/v1/models"): self.models,
            ("GET", "/metrics"): self.metrics,
            ("POST", "/v1/completions"): self.completions,
            ("POST", "/v1/chat/completions"): self.chat_completions,
        }

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path = scope["path"].rstrip("/") or "/"
        handler = self.routes.get((scope["method"], path))
        try:
            if handler is None:
                allowed = any(p == path for _, p in self.routes)
                raise api.APIError(405 if allowed else 404, f"{scope['method']} {path} is not served here")
            await handler(scope, receive, send)
        except api.APIError as exc:
            await send_json(send, exc.status, exc.body())
        except ClientGone:
            pass

    # ----- plain endpoints ---------------------------------------------------------------------
    async def health(self, scope, receive, send):
        if self.client.healthy:
            await send_json(send, 200, {"status": "ok", "dp_size": self.client.dp_size})
        else:
            await send_json(send, 503, {"status": "unavailable", "reason": self.client.health_reason()})

    async def server_info(self, scope, receive, send):
        ranks = [{"rank": s.rank, "up": s.alive, "pid": s.info.pid if s.info else None,
                  "inflight_requests": s.inflight_requests} for s in self.client.ranks]
        await send_json(send, 200, {**self.info, "ranks": ranks})

    async def models(self, scope, receive, send):
        card = {"id": self.model, "object": "model", "created": int(time.time()), "owned_by": "dpmesh",
                "root": self.info["model_path"], "max_model_len": self.info["max_model_len"]}
        await send_json(send, 200, {"object": "list", "data": [card]})

    async def metrics(self, scope, receive, send):
        await send_body(send, 200, render(self.registry), b"text/plain; version=0.0.4; charset=utf-8")

    # ----- generation ----------------------------------------------------------------------------
    async def completions(self, scope, receive, send):
        await self._generate(scope, receive, send, chat=False)

    async def chat_completions(self, scope, receive, send):
        await self._generate(scope, receive, send, chat=True)

    async def _generate(self, scope, receive, send, chat: bool):
        body = await read_json(receive, self.max_body_bytes)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        req = api.parse(body, headers, chat=chat, tokenizer=self.tokenizer, model_names=self.model_names,
                        dp_size=self.client.dp_size, max_model_len=self.info["max_model_len"],
                        vocab_size=self.info["vocab_size"])
        try:
            rank = self.client.choose_rank(req.rank_hint)
        except RankUnavailable as exc:
            raise api.APIError(503, str(exc)) from exc
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        outputs = self.client.generate(rid, rank, req.prompt_token_ids, req.params)
        relay = self._stream(req, rid, rank, outputs, send) if req.stream else self._complete(req, rid, rank, outputs, send)
        await until_disconnect(relay, receive)

    async def _complete(self, req, rid, rank, outputs, send):
        text, last = [], None
        try:
            async with contextlib.aclosing(outputs) as stream:
                async for out in stream:
                    text.append(out.new_text)
                    last = out
        except RankFailed as exc:
            raise api.APIError(exc.status, str(exc)) from exc
        use = api.usage(last.num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens)
        await send_json(send, 200, api.response(req, rid, self.model, "".join(text), last.finish_reason, use),
                        rank=rank)

    async def _stream(self, req, rid, rank, outputs, send):
        created = int(time.time())
        started = False
        try:
            async with contextlib.aclosing(outputs) as stream:
                async for out in stream:
                    if not started:
                        await start_sse(send, rank)
                        started = True
                        if req.chat:
                            await send_event(send, api.chunk(req, rid, self.model, created, None, None, role=True))
                    if out.new_text or out.finished:
                        await send_event(send, api.chunk(req, rid, self.model, created, out.new_text or None,
                                                         out.finish_reason))
                    last = out
        except RankFailed as exc:
            if not started:
                raise api.APIError(exc.status, str(exc)) from exc
            await send_event(send, api.APIError(exc.status, str(exc)).body())
            await send_sse_end(send)
            return
        if req.include_usage:
            use = api.usage(last.num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens)
            await send_event(send, api.usage_chunk(req, rid, self.model, created, use))
        await send_sse_end(send)


# ----- ASGI helpers ----------------------------------------------------------------------------
async def _lifespan(receive, send):
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def read_json(receive, limit: int):
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise api.APIError(413, f"the request body is larger than {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body"):
            break
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError) as exc:
        raise api.APIError(400, f"the request body is not valid JSON: {exc}") from exc


async def until_disconnect(work, receive):
    """Run ``work`` until it ends or the client disconnects; a disconnect cancels it, which
    closes the output stream and so aborts the request in its rank."""
    task = asyncio.ensure_future(work)

    async def watch():
        while (await receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.done() and not task.cancelled():
        task.result()  # re-raise APIError and friends


def _headers(content_type: bytes, rank: int | None, extra: list | None = None) -> list:
    headers = [(b"content-type", content_type)] + (extra or [])
    if rank is not None:
        headers.append((b"x-data-parallel-rank", str(rank).encode()))
    return headers


async def send_body(send, status: int, body: bytes, content_type: bytes = JSON, rank: int | None = None):
    headers = _headers(content_type, rank, [(b"content-length", str(len(body)).encode())])
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def send_json(send, status: int, payload: dict, rank: int | None = None):
    await send_body(send, status, json.dumps(payload).encode(), JSON, rank)


async def start_sse(send, rank: int):
    extra = [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
    await send({"type": "http.response.start", "status": 200,
                "headers": _headers(b"text/event-stream; charset=utf-8", rank, extra)})


async def send_event(send, payload: dict):
    await send({"type": "http.response.body", "body": b"data: " + json.dumps(payload).encode() + b"\n\n",
                "more_body": True})


async def send_sse_end(send):
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
