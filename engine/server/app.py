"""The engine's ASGI application: OpenAI endpoints, /server_info, /health, /metrics, /kv_events.

A plain ASGI callable (no framework) served by daphne: the hot path is parse → choose rank →
relay outputs, and each streamed token leaves as its own SSE event.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
import uuid

from engine.server import openai_api as api
from engine.server import pd, responses
from engine.server.frontend import EngineClient, RankFailed, RankUnavailable
from engine.server.metrics import make_registry, render
from engine.server.served_models import ServedModels
from serving import tracing
from serving.asgi import (
    BodyTimeout,
    BodyTooLarge,
    ClientGone,
    end_body,
    lifespan,
    read_body,
    send_body,
    send_chunk,
    send_json,
    start_sse,
    until_disconnect,
)
from serving.openai_fields import OFF_LOOP_CHARS, APIError, prompt_text_chars, strict_json

logger = logging.getLogger(__name__)

KV_KEEPALIVE_S = 10.0


def traced(headers: dict) -> tuple | None:
    """(the client's trace context or None) while traces are exported, else None."""
    return None if tracing.TRACER is None else (tracing.parent_from(headers),)


def rank_header(rank: int | None) -> list:
    return [] if rank is None else [(b"x-data-parallel-rank", str(rank).encode())]


async def send_event(send, payload: dict):
    await send_chunk(send, b"data: " + json.dumps(payload).encode() + b"\n\n")


async def send_named_event(send, kind: str, payload: dict):
    """One server-sent event with its ``event:`` name (the Responses API's stream)."""
    data = b"event: " + kind.encode() + b"\ndata: " + json.dumps(payload).encode() + b"\n\n"
    await send_chunk(send, data)


async def send_sse_end(send):
    await end_body(send, b"data: [DONE]\n\n")


async def read_json(receive, limit: int, scope=None):
    try:
        raw = await read_body(receive, limit, scope)
    except BodyTooLarge as exc:
        raise APIError(413, str(exc)) from exc
    except BodyTimeout as exc:
        raise APIError(408, str(exc)) from exc
    try:
        return strict_json(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from exc


class EngineApp:
    def __init__(
        self, client: EngineClient, tokenizer, server_info: dict, max_body_bytes: int = 4 * 2**20
    ):
        self.client, self.tokenizer, self.info = client, tokenizer, server_info
        self.max_body_bytes = max_body_bytes
        self.draining = False  # SIGTERM: no new requests, the ones in flight finish (drain.py)
        self.model = server_info["served_model_name"]
        self.served_models = ServedModels(
            self.model, server_info["model_id"], server_info["model_path"],
            server_info["max_model_len"], client.config.lora_modules,
        )  # fmt: skip
        self.registry = make_registry(client, self.model)
        self.routes = {
            ("GET", "/health"): self.health,
            ("GET", "/server_info"): self.server_info,
            ("GET", "/get_server_info"): self.server_info,
            ("GET", "/kv_transfer_info"): self.kv_transfer_info,
            ("GET", "/v1/models"): self.models,
            ("GET", "/metrics"): self.metrics,
            ("GET", "/kv_events"): self.kv_events,
            ("POST", "/v1/completions"): self.completions,
            ("POST", "/v1/chat/completions"): self.chat_completions,
            ("POST", "/v1/embeddings"): self.embeddings,
            ("POST", "/v1/responses"): self.responses,
        }
        self.response_store = responses.ResponseStore()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path = scope["path"].rstrip("/") or "/"
        handler = self.routes.get((scope["method"], path))
        try:
            if handler is None:
                allowed = any(p == path for _, p in self.routes)
                raise APIError(
                    405 if allowed else 404, f"{scope['method']} {path} is not served here"
                )
            await handler(scope, receive, send)
        except APIError as exc:
            await send_json(send, exc.status, exc.body())
        except ClientGone:
            pass

    # ----- plain endpoints ---------------------------------------------------------------------
    async def health(self, scope, receive, send):
        if self.draining:
            await send_json(send, 503, {"status": "draining", "in_flight": self.in_flight})
        elif self.client.healthy:
            await send_json(
                send,
                200,
                {
                    "status": "ok",
                    "dp_size": self.client.dp_size,
                    "instance_id": self.info.get("instance_id"),
                },
            )
        else:
            await send_json(
                send, 503, {"status": "unavailable", "reason": self.client.health_reason()}
            )

    async def server_info(self, scope, receive, send):
        ranks = [
            {
                "rank": s.rank,
                "up": s.alive,
                "pid": s.info.pid if s.info else None,
                "inflight_requests": s.inflight_requests,
                **self._kv_address(s),
            }
            for s in self.client.ranks
        ]
        await send_json(send, 200, {**self.info, "ranks": ranks})

    def _kv_address(self, state) -> dict:
        port = state.info.kv_port if state.info else None
        if port is None:
            return {}
        return {"kv_transfer_host": self.client.config.kv_transfer_host, "kv_transfer_port": port}

    async def kv_transfer_info(self, scope, receive, send):
        """Prefill/decode facts in one place (ATOM's path): the role, the KV layout's terms, and
        each rank's KV listener (a prefill worker's)."""
        config = self.client.config
        await send_json(
            send,
            200,
            {
                "disaggregation_mode": config.disaggregation_mode or "null",
                "engine_id": self.info["instance_id"],
                "dp_size": self.client.dp_size,
                "tp_size": self.info["tp_size"],
                "block_size": config.block_size,
                "ranks": [{"rank": s.rank, **self._kv_address(s)} for s in self.client.ranks],
            },
        )

    async def models(self, scope, receive, send):
        await send_json(send, 200, {"object": "list", "data": self.served_models.cards()})

    async def metrics(self, scope, receive, send):
        await send_body(
            send, 200, render(self.registry), b"text/plain; version=0.0.4; charset=utf-8"
        )

    async def kv_events(self, scope, receive, send):
        """The prefix caches as they change, for routers (SSE, never ends by itself): first one
        ``{"rank", "snapshot": [digest, ...]}`` per rank, then ``{"rank", "events": [["stored" |
        "removed", [digest, ...]], ...]}`` in the order the rank produced them. Digests are
        DESIGN.md's chained block digests, the ones a router computes from the prompt."""
        sub = self.client.kv_subscribe()
        try:
            await until_disconnect(self._relay_kv_events(sub, send), receive)
        finally:
            self.client.kv_unsubscribe(sub)

    async def _relay_kv_events(self, sub, send):
        await start_sse(send)
        for rank, digests in sorted(sub.snapshot.items()):
            await send_event(send, {"rank": rank, "snapshot": digests})
        while not sub.overflowed:
            try:
                item = await asyncio.wait_for(sub.queue.get(), KV_KEEPALIVE_S)
            except TimeoutError:
                # lets the reader tell a quiet engine from a dead one
                await send_chunk(send, b": keepalive\n\n")
                continue
            if item is None:
                break
            rank, events = item
            await send_event(send, {"rank": rank, "events": events})
        await send_event(
            send, {"error": "this reader fell too far behind; reconnect for a new snapshot"}
        )
        await end_body(send)

    # ----- generation ----------------------------------------------------------------------------
    async def completions(self, scope, receive, send):
        await self._generate(scope, receive, send, chat=False)

    async def chat_completions(self, scope, receive, send):
        await self._generate(scope, receive, send, chat=True)

    async def embeddings(self, scope, receive, send):
        """OpenAI's embeddings on the rank asked for (the body's rank fields or the header, as on
        the generation paths) or the one the balancer picks: the model's last-token hidden state,
        normalized (``ModelRunner.embed``)."""
        if self.draining:
            raise APIError(503, "the engine is draining: send new requests elsewhere")
        body = await read_json(receive, self.max_body_bytes, scope)
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        if self.served_models.adapter(body.get("model")) is not None:  # a 404 if it names none
            raise APIError(400, "LoRA adapters are not supported on /v1/embeddings: name the "
                           f"base model `{self.model}`", param="model")  # fmt: skip
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        hint = api.rank_hint(body, headers, self.client.dp_size)
        parse = functools.partial(
            api.embedding_inputs, body, self.tokenizer, self.info["vocab_size"],
            self.info["max_model_len"],
        )  # fmt: skip
        long = prompt_text_chars({"prompt": body.get("input")}, False) >= OFF_LOOP_CHARS
        inputs = await asyncio.to_thread(parse) if long else parse()
        if scope["path"] in self.client.config.debug_ignore_rank_paths:
            hint = None
        try:
            rank = self.client.choose_rank(hint)
            vectors = await until_disconnect(
                self.client.embed(f"embd-{uuid.uuid4().hex}", rank, inputs), receive
            )
        except RankUnavailable as exc:
            raise APIError(503, str(exc)) from exc
        except RankFailed as exc:
            raise APIError(exc.status, str(exc)) from exc
        if vectors is None:  # the client left
            return
        tokens = sum(map(len, inputs))
        fmt = body.get("encoding_format") or "float"
        answer = api.embeddings_answer(vectors, self.model, tokens, fmt)
        await send_json(send, 200, answer, rank_header(rank))

    async def responses(self, scope, receive, send):
        """OpenAI's Responses API on the chat path (engine/server/responses.py): the request as a
        chat, its answer in the Responses shapes; stored for ``previous_response_id`` unless
        ``store`` is false."""
        if self.draining:
            raise APIError(503, "the engine is draining: send new requests elsewhere")
        body = await read_json(receive, self.max_body_bytes, scope)
        chat, messages = responses.chat_body(body, self.response_store)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        parse = functools.partial(
            api.parse, chat, headers, chat=True, tokenizer=self.tokenizer,
            models=self.served_models, dp_size=self.client.dp_size,
            max_model_len=self.info["max_model_len"], vocab_size=self.info["vocab_size"],
        )  # fmt: skip
        long = prompt_text_chars(chat, True) >= OFF_LOOP_CHARS
        req = await asyncio.to_thread(parse) if long else parse()
        if scope["path"] in self.client.config.debug_ignore_rank_paths:
            req.rank_hint = None
        rid = responses.new_id()
        try:
            rank = self.client.choose_rank(req.rank_hint)
        except RankUnavailable as exc:
            raise APIError(503, str(exc)) from exc
        outputs = self.client.generate(rid, rank, req.prompt_token_ids, req.params,
                                       predicted=req.predicted, trace=traced(headers))  # fmt: skip
        model = self.served_models.answer_name(req.params.lora_name)
        writer = responses.EventWriter(rid, model, body)
        relay = self._respond(req, writer, rank, outputs, send)
        text = await until_disconnect(relay, receive)
        if text is not None and body.get("store", True) is not False:
            self.response_store.put(rid, [*messages, {"role": "assistant", "content": text}])

    async def _respond(self, req, writer, rank, outputs, send) -> str | None:
        """Run one Responses request and answer it; its text (None if it failed)."""
        text, last, started = [], None, False
        try:
            async with contextlib.aclosing(outputs) as stream:
                async for out in stream:
                    if req.stream and not started:
                        await start_sse(send, rank_header(rank))
                        started = True
                        for kind, event in writer.opening():
                            await send_named_event(send, kind, event)
                    if req.stream and out.new_text:
                        await send_named_event(send, *writer.delta(out.new_text))
                    text.append(out.new_text)
                    last = out
        except RankFailed as exc:
            if not started:
                raise APIError(exc.status, str(exc)) from exc
            error = APIError(exc.status, str(exc)).body()
            await send_named_event(send, "error", {"type": "error", **error["error"]})
            await end_body(send)
            return None
        answer = "".join(text)
        use = responses.usage(last.num_prompt_tokens, last.num_output_tokens,
                              last.num_cached_tokens)  # fmt: skip
        if req.stream:
            for kind, event in writer.closing(answer, use):
                await send_named_event(send, kind, event)
            await end_body(send)
        else:
            payload = responses.response_object(writer.rid, writer.model, writer.body, "completed",
                                                answer, use, writer.created)  # fmt: skip
            await send_json(send, 200, payload, rank_header(rank))
        return answer

    @property
    def in_flight(self) -> int:
        """Generation requests the ranks are serving now, streams included."""
        return sum(s.inflight_requests for s in self.client.ranks)

    async def _generate(self, scope, receive, send, chat: bool):
        if self.draining:
            raise APIError(503, "the engine is draining: send new requests elsewhere")
        body = await read_json(receive, self.max_body_bytes, scope)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        parse = functools.partial(
            api.parse,
            body,
            headers,
            chat=chat,
            tokenizer=self.tokenizer,
            models=self.served_models,
            dp_size=self.client.dp_size,
            max_model_len=self.info["max_model_len"],
            vocab_size=self.info["vocab_size"],
        )
        # a long text prompt is tokenized in a worker thread: the loop keeps streaming meanwhile
        long = prompt_text_chars(body, chat) >= OFF_LOOP_CHARS
        req = await asyncio.to_thread(parse) if long else parse()
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if scope["path"] in self.client.config.debug_ignore_rank_paths:
            req.rank_hint = None  # a path that drops the pin (the router's pin check finds it)
        hint, transfer = await self._transfer(body, req, rid)
        try:
            rank = self.client.choose_rank(hint)
        except RankUnavailable as exc:
            raise APIError(503, str(exc)) from exc
        if req.pretokenized:
            self.client.ranks[rank].counters.pretokenized += 1
        outputs = self.client.generate(rid, rank, req.prompt_token_ids, req.params,
                                       predicted=req.predicted, trace=traced(headers),
                                       **transfer)  # fmt: skip
        relay = (
            self._stream(req, rid, rank, outputs, send)
            if req.stream
            else self._complete(req, rid, rank, outputs, send)
        )
        await until_disconnect(relay, receive)

    async def _transfer(self, body: dict, req, rid: str) -> tuple[int | None, dict]:
        """(the rank hint, ``generate``'s transfer keywords) of a prefill/decode leg, either
        protocol (engine/server/pd.py); an ordinary request's own hint and none."""
        config = self.client.config
        mode = config.disaggregation_mode
        room = pd.bootstrap_room(body) if mode else None
        if room is None:
            return req.rank_hint, pd.transfer_fields(body, mode, rid)
        if mode == "prefill":  # SGLang's prefill leg: prefill only, held under its room
            req.params.max_tokens = 1
            rank = pd.sglang_prefill_rank(body, room, req.rank_hint, self.client.dp_size)
            return rank, {"hold_key": pd.room_key(room)}
        wait_s = min(config.kv_transfer_timeout_s, pd.DECODE_WAIT_S)
        return req.rank_hint, await pd.sglang_decode_fields(body, room, wait_s)

    async def _complete(self, req, rid, rank, outputs, send):
        text, last = [], None
        try:
            async with contextlib.aclosing(outputs) as stream:
                async for out in stream:
                    text.append(out.new_text)
                    last = out
        except RankFailed as exc:
            raise APIError(exc.status, str(exc)) from exc
        use = api.usage(last.num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens)
        model = self.served_models.answer_name(req.params.lora_name)
        answer = api.response(req, rid, model, "".join(text), last.finish_reason, use)
        transfer = pd.prefill_answer(self.client, self.info, rank, rid, last)
        if transfer is not None:
            answer[pd.PARAM] = transfer
        await send_json(send, 200, answer, rank_header(rank))

    async def _stream(self, req, rid, rank, outputs, send):
        created = int(time.time())
        model = self.served_models.answer_name(req.params.lora_name)
        started = False
        try:
            async with contextlib.aclosing(outputs) as stream:
                async for out in stream:
                    if not started:
                        await start_sse(send, rank_header(rank))
                        started = True
                        if req.chat:
                            await send_event(
                                send,
                                api.chunk(req, rid, model, created, None, None, role=True),
                            )
                    if out.new_text or out.finished:
                        event = api.chunk(
                            req, rid, model, created, out.new_text or None, out.finish_reason
                        )
                        transfer = pd.prefill_answer(self.client, self.info, rank, rid, out)
                        if transfer is not None:  # a streamed prefill: with its last event
                            event[pd.PARAM] = transfer
                        await send_event(send, event)
                    last = out
        except RankFailed as exc:
            if not started:
                raise APIError(exc.status, str(exc)) from exc
            await send_event(send, APIError(exc.status, str(exc)).body())
            await send_sse_end(send)
            return
        if req.include_usage:
            use = api.usage(last.num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens)
            await send_event(send, api.usage_chunk(req, rid, model, created, use))
        await send_sse_end(send)
