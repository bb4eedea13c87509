"""The dashboard page and its two actions (staff only). Live data comes over the websocket
(apps/routing/consumers.py); ``/dashboard/snapshot`` serves the same JSON for scripts."""

from __future__ import annotations

import json

from asgiref.sync import sync_to_async
from django.contrib.admin.views.decorators import staff_member_required
from django.http import JsonResponse
from django.shortcuts import render
from django.views.decorators.http import require_GET, require_POST

from apps.routing import background, benchjob
from apps.routing.dashboard import build_snapshot
from apps.routing.policies import POLICIES
from apps.routing.router import get_router


def _error(status: int, message: str) -> JsonResponse:
    return JsonResponse(
        {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": None,
                "code": status,
            }
        },
        status=status,
    )


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
            "policy": get_router().config.policy,
            "ws_path": "/ws/dashboard/",
        },
    )


@staff_member_required
@require_GET
async def snapshot(request):
    return JsonResponse(await sync_to_async(build_snapshot)(get_router()))


@staff_member_required
@require_POST
async def policy(request):
    try:
        name = _json_body(request).get("policy")
        user = await request.auser()
        await background.set_policy(get_router(), str(name), user.get_username())
    except ValueError as exc:
        return _error(400, str(exc))
    return JsonResponse({"policy": get_router().config.policy})


def _create_run(base_url: str, params: dict, user: str):
    from apps.routing.models import BenchRun

    return BenchRun.objects.create(base_url=base_url, params=params, created_by=user)


@staff_member_required
@require_POST
async def bench(request):
    """Queue a benchmark of the live fleet through this router; it shows up on the dashboard."""
    try:
        params = benchjob.validate(_json_body(request))
    except ValueError as exc:
        return _error(400, str(exc))
    user = await request.auser()
    # the workload goes to this router process (what the operator is looking at), at the address
    # it listens on; a wildcard bind is reached over loopback
    host, port = request.scope.get("server") or ("127.0.0.1", request.get_port())
    host = "127.0.0.1" if host in (None, "", "0.0.0.0") else "[::1]" if host == "::" else host
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    run = await sync_to_async(_create_run)(f"http://{host}:{port}", params, user.get_username())
    background.enqueue_bench(run.id)
    return JsonResponse({"id": run.id, "status": run.status, "params": params}, status=202)
