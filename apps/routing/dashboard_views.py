"""The dashboard page and its two actions (staff only). Live data comes over the websocket
(apps/routing/consumers.py); ``/dashboard/snapshot`` serves the same JSON for scripts."""

from __future__ import annotations

import json

from asgiref.sync import sync_to_async
from django.contrib.admin.views.decorators import staff_member_required
from django.http import JsonResponse
from django.shortcuts import render
from django.views.decorators.http import require_GET, require_POST

from apps.routing import benchjob, services
from apps.routing.decision.policies import POLICIES
from apps.routing.live import live_of, router_of
from apps.routing.selectors import build_snapshot
from controlplane.errors import error_response


def _json_body(request) -> dict:
    try:
        body = json.loads(request.body or b"{}")
    except ValueError as exc:
        raise ValueError(f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ValueError("the request body must be a JSON object")
    return body


@staff_member_required
@require_GET
def dashboard(request):
    return render(
        request,
        "routing/dashboard.html",
        {
            "policies": sorted(POLICIES),
            "policy": router_of(request).config.policy,
            "ws_path": "/ws/dashboard/",
        },
    )


@staff_member_required
@require_GET
async def snapshot(request):
    live = live_of(request)
    return JsonResponse(await sync_to_async(build_snapshot)(live.router, live.admission))


@staff_member_required
@require_POST
async def policy(request):
    try:
        name = _json_body(request).get("policy")
        user = await request.auser()
        await services.policy_set(router=router_of(request), name=str(name), by=user.get_username())
    except ValueError as exc:
        return error_response(400, str(exc))
    return JsonResponse({"policy": router_of(request).config.policy})


@staff_member_required
@require_POST
async def bench(request):
    """Queue a benchmark of the live fleet through this router; it shows up on the dashboard."""
    try:
        params = benchjob.validate(_json_body(request))
    except ValueError as exc:
        return error_response(400, str(exc))
    user = await request.auser()
    # the workload goes to this router process (what the operator is looking at), at the address
    # it listens on; a wildcard bind is reached over loopback
    host, port = request.scope.get("server") or ("127.0.0.1", request.get_port())
    host = "127.0.0.1" if host in (None, "", "0.0.0.0") else "[::1]" if host == "::" else host
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    run = await sync_to_async(services.bench_run_create)(
        base_url=f"http://{host}:{port}", params=params, user=user.get_username()
    )
    services.bench_run_enqueue(run_id=run.id)
    return JsonResponse({"id": run.id, "status": run.status, "params": params}, status=202)
