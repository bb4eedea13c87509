"""The router's read-only endpoints. The proxy itself (/v1/completions, /v1/chat/completions)
is a plain ASGI app in front of Django: apps/routing/proxy/endpoint.py.

``/v1/models`` needs an API key when some are configured (apps/replicas/auth.py); ``/health`` and
``/metrics`` are always open; ``/misses`` too, but the prompts' text in it only with an admin key
or a staff session."""

from __future__ import annotations

from django.http import HttpResponse, JsonResponse

from apps.replicas.auth import admin_refusal, api_key_allowed, invalid_api_key_response
from apps.routing import worker_metrics
from apps.routing.live import router_of


async def models(request):
    if not api_key_allowed(request.headers.get("Authorization")):
        return invalid_api_key_response()
    router = router_of(request)
    data = [{"id": name, "object": "model", "owned_by": "dpmesh"} for name in router.fleet.models()]
    return JsonResponse({"object": "list", "data": data})


async def health(request):
    router = router_of(request)
    available = [t.key for t in router.fleet.candidates(None)]
    if router.fleet.loading:  # not yet the fleet and policy it will serve with
        status, state = 503, "starting"
    elif router.fleet.draining:  # shutting down: load balancers should send elsewhere
        status, state = 503, "draining"
    else:
        status, state = (200, "ok") if available else (503, "unavailable")
    payload = {"status": state, "targets": available}
    if router.config.pd and status == 200:  # a request needs a worker of each role
        missing = [r for r in ("prefill", "decode") if not router.fleet.candidates(None, r)]
        if missing:
            status, payload["status"] = 503, "unavailable"
            payload["reason"] = f"no available {' or '.join(missing)} worker"
    response = JsonResponse(payload, status=status)
    # A 503 here is the answer a load balancer polls for, not a server error: keep it out of
    # django.request's ERROR log (the flag Django itself sets on a response it has logged).
    response._has_been_logged = True
    return response


async def metrics(request):
    return HttpResponse(
        worker_metrics.render(router_of(request)),
        content_type="text/plain; version=0.0.4; charset=utf-8",
    )


async def misses(request):
    """Why prompts were not all served from cache (apps/routing/decision/misses.py): tokens per
    target and reason, the latest divergences of sessions' turns, the sessions that diverge most."""
    renderings = await admin_refusal(request) is None
    return JsonResponse(router_of(request).misses.as_dict(renderings))
