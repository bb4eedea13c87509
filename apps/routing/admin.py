"""The admin for routing: the active policy (applied to this process's router at once; other router
processes pick the row up when they next sync) and the benchmark runs (read-only)."""

from __future__ import annotations

from asgiref.sync import async_to_sync
from django.contrib import admin
from django.db import transaction

from apps.routing.jobs import notify_dashboard
from apps.routing.live import router_of
from apps.routing.models import BenchRun, RoutingSettings


async def _apply_policy(router, name: str) -> None:
    # on the server's event loop (async_to_sync from the admin's thread), where the router lives
    router.set_policy(name)


@admin.register(RoutingSettings)
class RoutingSettingsAdmin(admin.ModelAdmin):
    list_display = ["__str__", "policy", "updated_at", "updated_by"]
    fields = ["policy", "updated_at", "updated_by"]
    readonly_fields = ["updated_at", "updated_by"]

    def has_add_permission(self, request):
        return not RoutingSettings.objects.exists()  # one row

    def has_delete_permission(self, request, obj=None):
        return False

    def save_model(self, request, obj, form, change):
        obj.updated_by = request.user.get_username()
        super().save_model(request, obj, form, change)
        policy, router = obj.policy, router_of(request)
        transaction.on_commit(
            lambda: (async_to_sync(_apply_policy)(router, policy), notify_dashboard("policy"))
        )


@admin.register(BenchRun)
class BenchRunAdmin(admin.ModelAdmin):
    """Read-only: runs are started from the dashboard (or ``manage.py bench``) and written by the
    job."""

    list_display = ["id", "created_at", "status", "params_summary", "result_summary", "created_by"]
    list_filter = ["status"]
    readonly_fields = [
        "created_at",
        "finished_at",
        "created_by",
        "status",
        "base_url",
        "params",
        "result",
        "error",
    ]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    @admin.display(description="params")
    def params_summary(self, run):
        return _summary(run.params)

    @admin.display(description="result")
    def result_summary(self, run):
        if run.error:
            return run.error[:120]
        return _summary(
            {k: v for k, v in (run.result or {}).items() if not isinstance(v, (dict, list))}
        )


def _summary(data: dict, limit: int = 160) -> str:
    """``key=value`` pairs of a JSON object's scalars, shortened to one line."""
    if not data:
        return "—"
    text = ", ".join(f"{k}={v}" for k, v in data.items() if not isinstance(v, (dict, list)))
    if not text:
        return "—"
    return text if len(text) <= limit else text[: limit - 1] + "…"
