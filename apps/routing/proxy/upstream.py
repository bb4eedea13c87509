"""One OpenAI request's life behind the router: route, send, relay, end; retry elsewhere while
nothing has reached the client.

``proxy_request`` is the whole story, in order:

1. ``Router.route`` picks a target and returns a ``Dispatch``
   (apps/routing/decision/dispatch.py), which owns the request's two ends;
2. ``_attempt`` posts the body (the rank injected) to the target's engine and relays the answer:
   a JSON body as it is, or the SSE stream event by event (the first event is the first token);
   its one ``finally`` ends the dispatch, however the attempt ends;
3. an attempt that failed before anything reached the client (refused or reset, a connect
   timeout, 408/429/500/502/503/504) is retried on another target, with exponential backoff. A
   read timeout is not retried: the engine may be generating, and a retry would run it twice.
   A refused connection takes the whole worker out at once (its ranks share the endpoint; a
   reset is first confirmed by a probe), so the retry goes to another worker
   (apps/routing/feeds/health.py).

The router asks for the engine's usage on every stream (to learn its cached tokens); when the
client did not ask for it, the usage-only event is dropped on the way.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time

from apps.routing.decision.dispatch import Dispatch
from apps.routing.decision.request_shape import tokenize_off_loop, tokenizes_off_loop
from apps.routing.decision.router import CACHED_PATHS, NoTarget, Router
from apps.routing.feeds import health
from apps.routing.proxy import limits, tenants, wire
from controlplane import http1
from controlplane.errors import error_bytes
from engine.tokenize_cache import TooManyTokens
from serving import tracing
from serving.asgi import SSE_HEADERS, end_body, send_body, send_chunk
from serving.openai_fields import APIError, too_long_message

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
        return (
            self.raw if self.raw is not None else error_bytes(self.status, self.message, self.type)
        )


class Ending:
    """How an attempt ended, filled in as it goes and read once by its ``finally``."""

    __slots__ = ("ok", "usage", "aborted", "unreachable")

    def __init__(self):
        self.ok = self.aborted = self.unreachable = False
        self.usage: dict | None = None

    def apply(self, dispatch: Dispatch) -> None:
        if self.unreachable:
            dispatch.unreachable()
        else:
            dispatch.finish(ok=self.ok, usage=self.usage, aborted=self.aborted)
        if tracing.TRACER is not None:  # on the attempt's span: how it ended
            self.annotate(dispatch, tracing.current_span())

    def annotate(self, dispatch: Dispatch, span) -> None:
        usage = self.usage or {}
        attributes = {"dpmesh.ok": self.ok, "dpmesh.aborted": self.aborted,
                      "dpmesh.unreachable": self.unreachable}  # fmt: skip
        for key, name in (("prompt_tokens", "gen_ai.usage.input_tokens"),
                          ("completion_tokens", "gen_ai.usage.output_tokens")):  # fmt: skip
            if isinstance(usage.get(key), int):
                attributes[name] = usage[key]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        if isinstance(cached, int):
            attributes["dpmesh.cached_tokens"] = cached
        if self.ok:
            for reason, tokens in (dispatch.miss_reasons(usage) or {}).items():
                attributes[f"dpmesh.miss.{reason}"] = tokens
        span.set_attributes(attributes)


def proxy_request(
    router: Router,
    body: dict,
    *,
    chat: bool,
    path: str,
    send,
    rank: int | None = None,
    session: str | None = None,
    since: float | None = None,
):
    """Serve one request through the router (an awaitable; cancelled when the client
    disconnects). ``rank``: the client's own pin (endpoint.client_rank), else the router chooses;
    ``session``: the client's session id (apps/routing/decision/sessions.py); ``since``: when the
    router's own work on it began (``time.perf_counter``; its arrival, moved on by an admission
    wait), from which the overhead it reports is counted. Where nothing is to be awaited before
    it is routed (the usual case), what it returns is ``_attempts``' own coroutine, with no
    frame of its own between."""
    since = time.perf_counter() if since is None else since
    model = body.get("model") if isinstance(body.get("model"), str) else None
    if path == wire.RESPONSES_PATH:
        return _responses(router, body, path, send, model, rank, session, since)
    if path not in CACHED_PATHS:  # embeddings, scoring: routed by load, passed through as sent
        return _attempts(router, body, chat, path, send, model, rank, session, since, {})
    if router.config.pd or tokenizes_off_loop(body, chat):
        return _prepared(router, body, chat, path, send, model, rank, session, since)
    # a short text prompt: tokenized inline, when at all (shape_request)
    return _attempts(router, body, chat, path, send, model, rank, session, since, {})


async def _prepared(router, body, chat, path, send, model, rank, session, since):
    """``proxy_request`` for a long text prompt, tokenized once, in worker threads, for every
    attempt, no further than the longest context of the workers that could serve it
    (apps/routing/proxy/limits.py); and for a prefill/decode-disaggregated fleet."""

    def limit():  # read only for a long prompt or one of token ids
        fleet = router.fleet
        return limits.prompt_limit(fleet.candidates(model) or fleet.candidates(None))

    try:
        ids_by_path = {}
        if tokenizes_off_loop(body, chat):
            ids_by_path = await tokenize_off_loop(
                body, chat, lambda: router.tokenizer_paths(model), limit
            )
    except TooManyTokens as exc:  # no worker could take it: the engine's own answer, here
        message = too_long_message(exc.limit, exc.at_least, exact=False)
        error = APIError(400, message, param="messages" if chat else "prompt")
        await send_body(send, 400, json.dumps(error.body()).encode())
        return
    if router.config.pd:  # prefill and decode on workers of their roles (proxy/pd.py)
        from apps.routing.proxy import pd

        await pd.serve(
            router, body, chat=chat, path=path, send=send, model=model,
            ids_by_path=ids_by_path, rank=rank, session=session, since=since,
        )  # fmt: skip
        return
    await _attempts(router, body, chat, path, send, model, rank, session, since, ids_by_path)


async def _responses(router, body, path, send, model, rank, session, since):
    """A Responses request: routed cache-aware on its instructions and input as chat messages
    (``wire.responses_routing_body``); a continuation (``previous_response_id``) goes to the
    worker that stored the previous response, on its rank while that is not overloaded (the
    session table's entry for it), with no hit predicted (its earlier turns are in the engine's
    store, not in what the router sees). Each answer's id is remembered where it was served."""
    routing = wire.responses_routing_body(body)
    previous = body.get("previous_response_id")
    exclude: set[str] = set()
    if isinstance(previous, str):
        session = wire.RESPONSE_SESSION + previous
        home = router.sessions.homes.get(session)
        if home is not None:  # only that worker stores it: every other is ruled out
            worker = next((t.worker for t in router.fleet.all_targets() if t.key == home[0]), None)
            if worker is not None:
                exclude = {t.key for t in router.fleet.all_targets() if t.worker is not worker}
    try:
        ids_by_path = await tokenize_off_loop(routing, True, lambda: router.tokenizer_paths(model))
    except TooManyTokens:
        ids_by_path = {}
    await _attempts(router, body, True, path, send, model, rank, session, since, ids_by_path,
                    routing=routing, exclude=exclude,
                    predict=not isinstance(previous, str))  # fmt: skip


async def _attempts(router, body, chat, path, send, model, rank, session, since, ids_by_path,
                    *, routing=None, exclude=frozenset(), predict=True):  # fmt: skip
    """Route (on ``routing``, else the body) and send, retrying on another target while nothing
    reached the client."""
    tried: set[str] = set(exclude)
    last: ProxyError | None = None
    for attempt in range(router.config.max_retries + 1):
        try:
            with tracing.span("dpmesh.router.route") as span:
                dispatch = router.route(
                    routing or body,
                    chat,
                    model,
                    exclude=tried,
                    rank=rank,
                    session=session,
                    ids_by_path=ids_by_path,
                    path=path,
                    predict=predict,
                    settle_later=True,  # settled once the request is written (_attempt)
                )
                if span is not None:
                    span.set_attributes({
                        "dpmesh.target": dispatch.target.key,
                        "dpmesh.prompt_tokens": dispatch.shape.prompt_tokens,
                        "dpmesh.predicted_cached_tokens": dispatch.predicted_tokens,
                    })  # fmt: skip
        except NoTarget as exc:
            error = last or ProxyError(503, str(exc), "server_error")
            await send_body(send, error.status, error.body())
            return
        tried.add(dispatch.target.key)
        last_try = attempt == router.config.max_retries
        given = (
            None
            if chat
            else wire.ids_for(router, dispatch.target, ids_by_path, body, dispatch.shape)
        )
        began = time.perf_counter()
        with tracing.client_span("dpmesh.router.attempt") as span:
            if span is not None:
                span.set_attributes({
                    "dpmesh.target": dispatch.target.key, "dpmesh.attempt": attempt,
                    "dpmesh.predicted_cached_tokens": dispatch.predicted_tokens,
                })  # fmt: skip
            retry = await _attempt(
                router, dispatch, body, path, send, last_try=last_try, ids=given, since=since
            )
        if retry is None:
            return
        last = retry
        logger.warning("retrying after %s (attempt %d)", retry.message, attempt + 1)
        backoff = router.config.retry_backoff_s * (1.5**attempt) * (1 + 0.2 * random.random())
        await asyncio.sleep(backoff)
        since += time.perf_counter() - began  # the failed attempt and the backoff are not ours
    await send_body(send, last.status, last.body())


async def _attempt(
    router: Router,
    dispatch: Dispatch,
    body: dict,
    path: str,
    send,
    *,
    last_try: bool,
    ids: list[int] | None = None,
    since: float,
    extra: list | None = None,
    cached_tokens: int | None = None,
) -> ProxyError | None:
    """Send the request to the dispatch's target and relay the answer to the client. Returns
    the error to retry on another target when nothing reached the client, else None. ``ids``:
    the prompt's token ids in the target's tokenizer, sent beside it (``wire.ids_for``);
    ``since``: where the router's overhead is counted from (``proxy_request``)."""
    target, config = dispatch.target, router.config
    stream = body.get("stream") is True
    ending = Ending()
    response = None
    try:
        try:
            payload = wire.upstream_payload(body, dispatch, stream, ids)
            overhead_s = time.perf_counter() - since
            head = []  # the answer's route headers, made while the engine works

            def sent() -> None:
                """The request is written: the router's commit and what the answer will say
                of it, while the engine works (off the path from its answer to the client)."""
                dispatch.settle()
                head.extend(wire.route_headers(dispatch, overhead_s))

            response = await http1.pool().post(
                target.worker.url + path,
                payload,
                wire.upstream_head(dispatch),
                connect_timeout_s=config.connect_timeout_s,
                read_timeout_s=config.request_timeout_s,
                sent=sent,
            )
        except http1.ConnectTimeout as exc:
            ending.unreachable = True
            return ProxyError(
                504, f"upstream {target.key} timed out connecting: {exc}", "server_error"
            )
        except http1.ReadTimeout as exc:
            # The request reached the engine and may be generating: retrying would run it twice.
            error = ProxyError(504, f"upstream {target.key} timed out: {exc}", "server_error")
            await send_body(send, error.status, error.body())
            return None
        except http1.ConnectError as exc:  # refused: the whole worker is gone
            ending.unreachable = True
            health.mark_unreachable(router, target.worker, f"unreachable: {exc}")
            return ProxyError(502, f"upstream {target.key} unreachable: {exc}", "server_error")
        except http1.Disconnected as exc:  # reset before an answer: dead, or a dropped socket?
            ending.unreachable = True
            await health.confirm_reachable(router, target.worker)
            return ProxyError(502, f"upstream {target.key} unreachable: {exc}", "server_error")
        if response.status in RETRYABLE and not last_try:
            ending.unreachable = True
            try:
                raw = await response.read()
            except http1.UpstreamError:
                raw = b""
            message = f"upstream {target.key} answered {response.status}"
            return ProxyError(response.status, message, "server_error", raw=raw or None)
        headers = head + wire.served_rank(dispatch, response) + (extra or [])
        router.stats.overhead.observe(overhead_s)
        content_type = response.header(b"content-type") or "application/json"
        if response.status == 200 and stream and content_type.startswith("text/event-stream"):
            remember = (
                (lambda first: _remember_response(router, dispatch, first))
                if path == wire.RESPONSES_PATH
                else None
            )
            headers += wire.misses_header(dispatch, None)
            await _relay_stream(dispatch, response, wire.wants_usage(body), send, headers,
                                ending, cached_tokens, remember)  # fmt: skip
        else:
            try:
                content = await response.read()
            except http1.UpstreamError as exc:
                error = ProxyError(502, f"upstream {target.key} failed: {exc}", "server_error")
                await send_body(send, error.status, error.body())
                return None
            ending.ok = response.status < 400
            if ending.ok and path == wire.RESPONSES_PATH:
                _remember_response(router, dispatch, content)
            if ending.ok and cached_tokens is not None:
                content = wire.with_cached_tokens(content, cached_tokens)
            ending.usage = wire.usage_from_body(content) if ending.ok else None
            if ending.ok:
                headers += wire.misses_header(dispatch, ending.usage)
            await send_body(send, response.status, content, content_type.encode(), headers)
        return None
    except asyncio.CancelledError:  # the client left
        ending.aborted = True
        raise
    finally:
        if response is not None:
            response.release()
        ending.apply(dispatch)
        if ending.ok:
            tenants.charge(ending.usage)  # its tenant's tokens a minute (proxy/tenants.py)


def _remember_response(router, dispatch, data: bytes) -> None:
    """A Responses answer's id -> where it was served, for its continuations."""
    rid = wire.response_id_of(data)
    if rid is not None:
        router.sessions.record(wire.RESPONSE_SESSION + rid, dispatch.target.key, kept=False)


async def _relay_stream(
    dispatch, response, client_wants_usage: bool, send, headers, ending, cached_tokens=None,
    remember=None,
):  # fmt: skip
    """Relay the SSE events as they arrive; a failure mid-stream ends it with an error event.
    ``remember``: given the first event (a Responses stream's, which names its id). Where the
    server writes straight to the connection (``send.direct``, serving/asgi.py ``DIRECT_BODY``),
    the events go from the engine's connection to the client's in its callback, with no task
    switch per event; otherwise through ``send``."""
    await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS + headers})
    events = SseEvents(dispatch, client_wants_usage, ending, cached_tokens, remember)
    direct = getattr(send, "direct", None)
    try:
        if direct is not None and direct.ready():

            def sink(chunk: bytes) -> bool:
                out = events.feed(chunk)
                if out:
                    direct.write(out)
                return direct.paused

            await response.pipe(sink, direct.drain)
        else:
            async for chunk in response.chunks():
                out = events.feed(chunk)
                if out:
                    await send_chunk(send, out)
        if events.buffer:
            await send_chunk(send, events.buffer)
        ending.ok = True
    except http1.UpstreamError as exc:
        key = dispatch.target.key
        error = ProxyError(502, f"upstream {key} failed mid-stream: {exc}", "server_error")
        await send_chunk(send, b"data: " + error.body() + b"\n\ndata: [DONE]\n\n")
    await end_body(send)


class SseEvents:
    """What of an engine's SSE stream goes to the client, piece by piece as it arrives
    (``feed``): whole events only, those that came together in one piece (one write, not one
    each); the first event marks the first token; an event with a usage gives the attempt its
    usage (its cached tokens rewritten where the prefill side's count, ``cached_tokens``), and a
    usage-only event is dropped when the client did not ask for usage. The common piece (whole
    events, past the first, no usage in them) goes out as it came, unread."""

    __slots__ = ("dispatch", "wants_usage", "ending", "cached_tokens", "remember", "buffer",
                 "started", "span")  # fmt: skip

    def __init__(self, dispatch, wants_usage: bool, ending, cached_tokens=None, remember=None):
        self.dispatch, self.wants_usage, self.ending = dispatch, wants_usage, ending
        self.cached_tokens, self.remember = cached_tokens, remember
        self.buffer = b""  # the start of an event not whole yet
        self.started = False
        # the attempt's span, taken here: ``feed`` may run in a connection's callback, outside
        # the request's context
        self.span = tracing.current_span() if tracing.TRACER is not None else None

    def feed(self, chunk: bytes) -> bytes | None:
        """What of ``chunk`` (and what was held before it) goes to the client now."""
        if (
            self.started
            and not self.buffer
            and self.cached_tokens is None
            and chunk.endswith(b"\n\n")
            and not _names_a_usage(chunk)
        ):
            return chunk
        buffer = self.buffer + chunk
        if b"\n\n" not in buffer:
            self.buffer = buffer
            return None
        *events, self.buffer = buffer.split(b"\n\n")
        if not self.started:
            self.started = True
            if self.span is not None and not self.dispatch.ticket.prefilled:
                self.span.add_event("first_token")
            self.dispatch.first_token()
            if self.remember is not None:
                self.remember(events[0])
                self.remember = None
        out = []
        for event in events:
            found = wire.usage_of(event)
            if found is not None and self.cached_tokens is not None:
                event = wire.with_cached_tokens(event, self.cached_tokens)
                found = wire.usage_of(event)
            if found is not None:
                self.ending.usage = found
                if not self.wants_usage and wire.is_usage_only(event):
                    continue
            out.append(event + b"\n\n")
        return b"".join(out) if out else None


def _names_a_usage(chunk: bytes) -> bool:
    """Some event in ``chunk`` may carry a usage: a ``"usage"`` key that is not null."""
    keys = chunk.count(b'"usage"')
    return keys > 0 and keys != chunk.count(b'"usage":null') + chunk.count(b'"usage": null')
