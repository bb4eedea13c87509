"""The OpenAI proxy endpoints as a plain ASGI app, in front of Django.

``/v1/completions`` and ``/v1/chat/completions`` are the router's hot path; the pooling and
scoring paths (``/v1/embeddings``, ``/v1/rerank``, ``/v1/score``, ...) pass through here too,
routed by load with their load counted (``PATHS``). Django's middleware
stack runs its hooks through thread hops (measured: ~13 per request, ~5 ms added at p50), which
these two endpoints do not need: they have no session, no CSRF, no templates. So
``controlplane.asgi`` sends exactly these paths here and everything else to Django.

This app takes the request in (access control, method, body: within the limits of
apps/routing/proxy/limits.py, a body too large answered 413 before it is read, one that does not
arrive within ``CONTROL_PLANE_BODY_TIMEOUT_S`` 408) and hands it to
``upstream.proxy_request``, which routes, sends and relays it. Access control is checked from the
scope's headers before the body is read: when API keys are configured (apps/replicas/auth.py) a
request without one of them is answered 401. Then the admission control
(apps/routing/proxy/admission.py) lets it through, or holds it in its queue (``X-Priority``: lower
first), or answers why not (429, or 503 while the process drains); the slot it was given is released
however the request ends.
"""

from __future__ import annotations

import functools
import re
import time

from django.conf import settings

from apps.replicas.auth import INVALID_API_KEY_BODY, api_key_allowed, scope_authorization
from apps.routing.decision.router import Router
from apps.routing.decision.sessions import SESSION_HEADER, session_of
from apps.routing.proxy import limits, tenants
from apps.routing.proxy.admission import Admission, Rejected, make_admission
from apps.routing.proxy.upstream import ProxyError, proxy_request
from serving import memory, tracing
from serving.asgi import (
    BodyTimeout,
    BodyTooLarge,
    CancelOnDisconnect,
    ClientGone,
    declared_length,
    direct_body,
    read_body,
    send_body,
)
from serving.openai_fields import APIError, rank_hint, strict_json

# path -> chat? (None: a path passed through as it is: routed by load, nothing predicted cached,
# no prompt read; pooling and scoring requests share no prefix cache with generation)
PATHS = {
    "/v1/completions": False,
    "/v1/chat/completions": True,
    "/v1/responses": True,  # routed on its input as chat messages (upstream._responses)
    **dict.fromkeys(
        ("/v1/embeddings", "/v1/rerank", "/v1/score", "/rerank", "/score", "/v1/classify",
         "/classify", "/pooling"),
        None,
    ),
}  # fmt: skip
PRIORITY = re.compile(r"[+-]?[0-9]{1,18}")
# the request headers the endpoint reads (access, length, priority, rank pin, tenant, session):
# picked out in one pass, so each check scans these few instead of every header again
READ_HEADERS = frozenset({
    b"authorization", b"content-length", b"x-priority", b"x-data-parallel-rank",
    tenants.TENANT_HEADER, SESSION_HEADER,
})  # fmt: skip


class Answer:
    """A request's ASGI ``send``, counting every answer by status for /metrics; ``direct``: the
    server's direct use of the request's connection (serving/asgi.py ``DIRECT_BODY``), or None
    (daphne)."""

    __slots__ = ("send", "path", "stats", "span", "direct")

    def __init__(self, send, path: str, stats, span, direct):
        self.send, self.path, self.stats, self.span, self.direct = send, path, stats, span, direct

    async def __call__(self, message) -> None:
        if message["type"] == "http.response.start":
            self._counted(message["status"])
        await self.send(message)

    def respond(self, status: int, content_type: bytes, headers: list, body: bytes) -> bool:
        """A whole answer in one write, where the server allows (serving/asgi.py
        ``send_body``)."""
        if self.direct is None or not self.direct.respond(status, content_type, headers, body):
            return False
        self._counted(status)
        return True

    def _counted(self, status: int) -> None:
        self.stats.responded(self.path, status)
        if self.span is not None:
            self.span.set_attribute("http.response.status_code", status)


class OpenAIEndpoint:
    """The ASGI app of ``PATHS``, serving through ``router``."""

    def __init__(
        self,
        router: Router,
        admission: Admission | None = None,
        tenant_limits: tenants.TenantLimits | None = None,
    ):
        self.router = router
        self.admission = admission or make_admission(router)
        self.large_bodies = limits.LargeBodies()
        self.body_timeout_s = settings.CONTROL_PLANE["BODY_TIMEOUT_S"]
        self.tenants = tenant_limits or tenants.from_config(router.config)
        self.tenants.attach(router)
        self._facts_of: tuple | None = None  # the fleet's targets ``_facts`` were read from
        self._facts = (limits.BODY_CAP_BYTES, 0)

    def fleet_facts(self) -> tuple[int, int]:
        """(the body limit, the largest dp-aware worker's ``dp_size``) of the fleet as it is: read
        again only when the fleet changed (``Fleet.all_targets`` is rebuilt on every change)."""
        fleet = self.router.fleet
        targets = fleet.all_targets()
        if targets is not self._facts_of:
            workers = list(fleet.workers.values())
            dp_size = max((w.dp_size for w in workers if w.dp_aware), default=0)
            self._facts, self._facts_of = (limits.body_limit(workers), dp_size), targets
        return self._facts

    async def __call__(self, scope, receive, send, span=None) -> None:
        """One request, in one coroutine from its arrival to ``proxy_request`` (each coroutine
        between the server and the engine is a frame that every resume of the request passes
        through): its access and method, its body, its own fields, then, under
        ``CancelOnDisconnect``, its admission and ``proxy_request``, which routes, sends and
        relays it. ``span``: its server span (``_traced``), when traced."""
        if tracing.TRACER is not None and span is None:
            await self._traced(scope, receive, send)
            return
        arrived = time.perf_counter()
        path, stats = scope["path"], self.router.stats

        direct = direct_body(scope)
        send = Answer(send, path, stats, span, direct)
        headers = scope.get("headers") or ()
        if direct is not None:  # our uvicorn, which lowercases every name (as ASGI advises)
            read = {"headers": [(n, v) for n, v in headers if n in READ_HEADERS]}
        else:  # a server that may not
            read = {"headers": [(n, v) for n, v in headers if n.lower() in READ_HEADERS]}

        if not api_key_allowed(scope_authorization(read)):
            auth = [(b"www-authenticate", b"Bearer")]
            await send_body(send, 401, INVALID_API_KEY_BODY, headers=auth)
            return
        if scope["method"] != "POST":
            error = ProxyError(405, f"{scope['method']} {path} is not served here")
            await send_body(send, error.status, error.body())
            return
        limit, dp_size = self.fleet_facts()
        declared = declared_length(read)
        try:
            held = self.large_bodies.take(declared if declared and declared <= limit else None)
        except OverflowError as exc:
            error = ProxyError(503, str(exc), "server_error")
            await send_body(send, 503, error.body(), headers=[(b"retry-after", b"1")])
            return
        size = 0
        try:
            waiting = time.perf_counter()
            try:
                # all of it here (the usual case: the server held the request for a small body),
                # taken as it is; else read as it comes, under its deadline
                raw = direct.whole_body() if direct is not None else None
                if raw is None:
                    raw = await read_body(receive, limit, scope, self.body_timeout_s)
                elif len(raw) > limit:
                    raise BodyTooLarge(f"the request body is larger than {limit} bytes")
                size = len(raw)
                body = parse(raw)
                # what the client asked of the fleet
                pin = client_rank(dp_size, body, read)
                priority = request_priority(read)
            except ClientGone:
                return
            except (BodyTooLarge, BodyTimeout, ProxyError) as exc:
                await send_body(send, *_refusal(exc))
                return
            # the router's own time leaves out the client's: the body's way here, from the wait
            # for it to its last byte (a client writes head and body apart, or trickles the
            # body); where the server does not say when that was (daphne), the whole wait counts
            body_at = direct.body_at if direct is not None else None
            if body_at is not None and body_at > waiting:
                arrived += body_at - waiting
            # the request's tenant (proxy/tenants.py): its rate limits, its cache salt when asked
            # for, its fair share of the admission queue
            tenant = tenants.tenant_of(read)
            salted = self.router.config.tenant_cache_salt and PATHS[path] is not None
            if salted and "cache_salt" not in body and tenant != tenants.ANONYMOUS:
                body["cache_salt"] = tenant  # its prefixes are its own
            if self.tenants.active:  # rate limits: before admission
                try:
                    self.tenants.admit(tenant)
                except tenants.RateLimited as exc:
                    await send_body(send, exc.status, exc.body(), headers=exc.headers())
                    return
                tenants.USAGE_SINK.set(functools.partial(self.tenants.spent, tenant))
            session = session_of(body, read["headers"])
            if direct is not None and direct.disconnected:  # gone already
                return
            # from here a client that leaves cancels the request, its wait for admission too
            with CancelOnDisconnect(receive, direct):
                try:
                    # admitted at once, the usual case, without an await (traced: under its span)
                    slot = self.admission.admit_now(tenant) if tracing.TRACER is None else None
                    if slot is None:
                        asked = time.perf_counter()
                        with tracing.span("dpmesh.router.admission"):
                            slot = await self.admission.acquire(priority, tenant)
                        arrived += time.perf_counter() - asked  # the wait is not the router's
                except Rejected as exc:
                    await send_body(send, exc.status, exc.body(), headers=exc.headers())
                    return
                try:
                    chat = bool(PATHS[path])
                    await proxy_request(self.router, body, chat=chat, path=path, send=send,
                                        rank=pin, session=session, since=arrived)  # fmt: skip
                finally:
                    slot.release()  # however it ended
        finally:
            self.large_bodies.give_back(held)
            if held or size >= limits.LARGE_BODY_BYTES:
                memory.trim()  # the body, its prompt and its tokens are garbage now

    async def _traced(self, scope, receive, send) -> None:
        """The request under its server span (the client's traceparent its parent)."""
        parent = tracing.parent_from(scope.get("headers"))
        route = {"http.route": scope["path"]}
        with tracing.server_span("dpmesh.router.request", parent, **route) as span:
            await self(scope, receive, send, span)


def _refusal(exc: Exception) -> tuple[int, bytes]:
    """The status and error body of a request refused before it is served (its body, its
    fields)."""
    if isinstance(exc, BodyTooLarge):
        return 413, ProxyError(413, str(exc)).body()
    if isinstance(exc, BodyTimeout):
        return 408, ProxyError(408, str(exc)).body()
    return exc.status, exc.body()


def request_priority(scope) -> int:
    """The client's ``X-Priority`` header: an integer, the lower served first when requests
    wait for admission (vLLM's ``priority`` order); 0 without one. Anything else is a 400."""
    for name, value in scope.get("headers") or ():
        if name.lower() == b"x-priority":
            text = value.decode("latin-1").strip()
            if not PRIORITY.fullmatch(text):
                raise ProxyError(
                    400, f"X-Priority must be an integer (lower is served first), not {text!r}"
                )
            return int(text)
    return 0


def client_rank(dp_size: int, body: dict, scope) -> int | None:
    """A DP rank the client asked for itself (body ``data_parallel_rank`` / ``data-parallel-rank``
    or header ``X-data-parallel-rank``), checked as the engine checks it: an integer in range of
    the fleet's largest dp-aware worker (``dp_size``: ``OpenAIEndpoint.fleet_facts``) is honoured
    as a pin (a single-worker fleet, or one worker whose rank it names); anything else is a 400
    with the engine's wording. None: the router chooses. A fleet routed worker by worker (no
    dp-aware worker: ``dp_size`` 0) passes the client's hint on to the engine."""
    if not dp_size:
        return None
    headers = {}
    for name, value in scope.get("headers") or ():
        if name.lower() == b"x-data-parallel-rank":
            headers["x-data-parallel-rank"] = value.decode("latin-1")
    try:
        return rank_hint(body, headers, dp_size)
    except APIError as exc:
        raise ProxyError(exc.status, exc.message) from exc


def parse(raw: bytes) -> dict:
    try:
        body = strict_json(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProxyError(400, f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ProxyError(400, "the request body must be a JSON object")
    return body
