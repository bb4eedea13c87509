"""The workers API: ours (``/workers``) and SGLang router's legacy one (``/add_worker`` …).

Mutations (POST /workers, DELETE /workers/{id}, POST /add_worker, POST /remove_worker) need an
admin key (``Authorization: Bearer``) or a staff session with a CSRF token: apps/replicas/auth.py.
Reads (GET /workers, GET /workers/{id}, GET /list_workers) stay open, as in SGLang's router.

``POST /workers {"url", "api_key"?, "dp_aware"?, "dp_size"?, "block_size"?, "tokenizer_path"?,
"kv_events"?}``: the last four override what discovery finds (a re-post without them keeps the
recorded ones). Each worker's answer says its ``flavour`` and where each fact came from."""

from __future__ import annotations

import json

from django.http import JsonResponse
from django.views.decorators.csrf import csrf_exempt

from apps.replicas.auth import admin_required
from apps.replicas.discovery import OVERRIDABLE, DiscoveryError
from apps.replicas.models import Worker
from apps.replicas.runtime import runtime_of
from apps.replicas.services import worker_add, worker_as_dict, worker_remove
from controlplane.errors import error_response


async def _register(
    request, url: str, api_key: str = "", dp_aware=None, overrides=None
) -> JsonResponse:
    runtime = runtime_of(request)
    try:
        worker = await worker_add(
            url=url, api_key=api_key, dp_aware=dp_aware, overrides=overrides, runtime=runtime
        )
    except ValueError as exc:
        return error_response(400, str(exc))
    except DiscoveryError as exc:
        return error_response(502, str(exc))
    return JsonResponse(worker_as_dict(worker, runtime), status=201)


@csrf_exempt
@admin_required
async def workers(request):
    if request.method == "GET":
        runtime = runtime_of(request)
        rows = [worker_as_dict(w, runtime) async for w in Worker.objects.all()]
        return JsonResponse({"workers": rows})
    if request.method != "POST":
        return error_response(405, "use GET or POST")
    try:
        body = json.loads(request.body or b"{}")
    except ValueError:
        return error_response(400, "the request body is not valid JSON")
    if not isinstance(body, dict) or not isinstance(body.get("url"), str):
        return error_response(400, "'url' is required")
    dp_aware = body.get("dp_aware")
    if dp_aware is not None and not isinstance(dp_aware, bool):
        return error_response(400, "'dp_aware' must be a boolean")
    # what discovery cannot know, or gets wrong, the registration says (DESIGN.md)
    overrides = {k: body[k] for k in OVERRIDABLE if k in body}
    return await _register(
        request, body["url"], str(body.get("api_key") or ""), dp_aware, overrides or None
    )


@csrf_exempt
@admin_required
async def worker_detail(request, worker_id: int):
    worker = await Worker.objects.filter(id=worker_id).afirst()
    if worker is None:
        return error_response(404, f"no worker {worker_id}")
    if request.method == "GET":
        return JsonResponse(worker_as_dict(worker, runtime_of(request)))
    if request.method == "DELETE":
        await worker_remove(worker_id=worker_id, runtime=runtime_of(request))
        return JsonResponse({"deleted": worker_id})
    return error_response(405, "use GET or DELETE")


@csrf_exempt
@admin_required
async def add_worker(request):
    if request.method != "POST":
        return error_response(405, "use POST")
    return await _register(request, request.GET.get("url", ""), request.GET.get("api_key", ""))


@csrf_exempt
@admin_required
async def remove_worker(request):
    if request.method != "POST":
        return error_response(405, "use POST")
    worker = await Worker.objects.filter(url=request.GET.get("url", "").rstrip("/")).afirst()
    if worker is None:
        return error_response(404, f"no worker {request.GET.get('url')!r}")
    await worker_remove(worker_id=worker.id, runtime=runtime_of(request))
    return JsonResponse({"removed": worker.url})


async def list_workers(request):
    return JsonResponse({"urls": [w.url async for w in Worker.objects.all()]})
