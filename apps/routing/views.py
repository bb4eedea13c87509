"""The router's OpenAI surface: thin views over apps.routing.proxy."""
from __future__ import annotations

import asyncio
import json

from django.http import HttpResponse, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt

from apps.routing.metrics import render_metrics
from apps.routing.proxy import ProxyError, open_upstream, relay
from apps.routing.router import Router, get_router


def error_response(status: int, message: str, type: str = "invalid_request_error") -> HttpResponse:
    return HttpResponse(ProxyError(status, message, type).body(), status=status, content_type="application/json")


def _route_headers(routed, response) -> dict:
    headers = {"X-Routed-Target": routed.target.key}
    if routed.target.rank is not None:
        headers["X-Data-Parallel-Rank"] = str(routed.target.rank)
    elif "x-data-parallel-rank" in response.headers:
        headers["X-Data-Parallel-Rank"] = response.headers["x-data-parallel-rank"]
    return headers


async def _proxy(request, *, chat: bool, path: str) -> HttpResponse:
    if request.method != "POST":
        return error_response(405, f"{request.method} {request.path} is not served here")
    try:
        body = json.loads(request.body)
    except (ValueError, UnicodeDecodeError) as exc:
        return error_response(400, f"the request body is not valid JSON: {exc}")
    if not isinstance(body, dict):
        return error_response(400, "the request body must be a JSON object")
    stream = body.get("stream") is True
    options = body.get("stream_options")
    wants_usage = stream and isinstance(options, dict) and options.get("include_usage") is True
    router = get_router()
    try:
        routed, response = await open_upstream(router, body, chat=chat, path=path, stream=stream)
    except ProxyError as exc:
        return error_response(exc.status, exc.message, exc.type)
    headers = _route_headers(routed, response)
    content_type = response.headers.get("content-type", "application/json")
    if response.status_code == 200 and stream and content_type.startswith("text/event-stream"):
        return _streaming(router, routed, response, wants_usage, headers)
    ok, content = False, b""
    try:
        content = await response.aread()
        ok = response.status_code < 400
    finally:
        await response.aclose()
        router.finish(routed, ok=ok, usage=_usage(content) if ok else None)
    return HttpResponse(content, status=response.status_code, content_type=content_type, headers=headers)


def _usage(content: bytes) -> dict | None:
    try:
        return json.loads(content).get("usage")
    except (ValueError, AttributeError):
        return None


def _streaming(router: Router, routed, response, wants_usage: bool, headers: dict) -> StreamingHttpResponse:
    out = StreamingHttpResponse(relay(router, routed, response, wants_usage), content_type="text/event-stream",
                                headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    loop = asyncio.get_running_loop()

    def close():  # runs after sending, in a thread; covers a stream that never started
        if not routed.finished:
            loop.call_soon_threadsafe(lambda: (router.finish(routed, ok=False),
                                               asyncio.ensure_future(response.aclose())))

    out._resource_closers.append(close)
    return out


@csrf_exempt
async def completions(request):
    return await _proxy(request, chat=False, path="/v1/completions")


@csrf_exempt
async def chat_completions(request):
    return await _proxy(request, chat=True, path="/v1/chat/completions")


async def models(request):
    router = get_router()
    data = [{"id": name, "object": "model", "owned_by": "dpmesh"} for name in router.fleet.models()]
    return JsonResponse({"object": "list", "data": data})


async def health(request):
    router = get_router()
    available = [t.key for t in router.fleet.candidates(None)]
    status = 200 if available else 503
    return JsonResponse({"status": "ok" if available else "unavailable", "targets": available}, status=status)


async def metrics(request):
    return HttpResponse(render_metrics(get_router()), content_type="text/plain; version=0.0.4; charset=utf-8")
