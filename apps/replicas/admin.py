"""The admin for the fleet. Every change goes through apps/replicas/services.py, given the
router process's runtime (apps/replicas/runtime.py), so the router's in-memory fleet follows the
database: adding a worker runs discovery (an unreachable one is a form
error and nothing is saved), draining and removal reach the router at once.

The admin's views are sync and run in a worker thread (daphne runs Django under ASGI), so the
async services are called through ``async_to_sync``: they run on the server's event loop, where
the router's state lives, and their database writes come back to this thread (and its
transaction)."""

from __future__ import annotations

import json

from asgiref.sync import async_to_sync
from django import forms
from django.contrib import admin, messages
from django.contrib.admin.actions import delete_selected
from django.core.exceptions import ValidationError
from django.db.models import Count
from django.utils.html import format_html, format_html_join

from apps.replicas.discovery import DiscoveryError, effective_info
from apps.replicas.models import Rank, RankSample, Worker, WorkerEvent
from apps.replicas.runtime import runtime_of
from apps.replicas.services import normalize_url, worker_add, worker_remove, worker_set_draining

HISTORY_LENGTH = 50


def hit_rate(part: int, whole: int) -> str:
    return f"{part / whole:.1%}" if whole else "—"


class WorkerAddForm(forms.ModelForm):
    """url, api_key, dp_aware; ``clean()`` registers the worker through ``worker_add`` (discovery
    through /server_info), so a worker that cannot be discovered is a form error."""

    url = forms.CharField(
        max_length=500, help_text="the engine's base URL, e.g. http://10.0.0.5:8000"
    )
    api_key = forms.CharField(
        max_length=500,
        required=False,
        widget=forms.PasswordInput(render_value=False),
        help_text="sent to the engine as 'Authorization: Bearer'; optional",
    )

    class Meta:
        model = Worker
        fields = ["url", "api_key", "dp_aware"]

    registered: Worker | None = None
    runtime = None  # the router process's (set per request by ``WorkerAdmin.get_form``)

    def clean_url(self):
        try:
            url = normalize_url(self.cleaned_data["url"])
        except ValueError as exc:
            raise ValidationError(str(exc)) from exc
        if Worker.objects.filter(url=url).exists():
            raise ValidationError("this worker is already registered (open it to change it)")
        return url

    def clean(self):
        data = super().clean()
        if self.errors:
            return data
        try:
            self.registered = async_to_sync(worker_add)(
                url=data["url"],
                api_key=data.get("api_key") or "",
                dp_aware=bool(data.get("dp_aware")),
                strict=True,
                runtime=self.runtime,
            )
        except (ValueError, DiscoveryError) as exc:
            raise ValidationError(f"discovery failed: {exc}") from exc
        self.instance = self.registered
        return data

    def _post_clean(self):
        # Once registered, the service has validated and saved the row: the ModelForm's own model
        # validation would only disagree about URLs (Django's URLValidator refuses hosts without a
        # dot, such as http://engine-0:8000, which the workers API accepts).
        if self.registered is None:
            super()._post_clean()


class WorkerChangeForm(forms.ModelForm):
    api_key = forms.CharField(
        max_length=500,
        required=False,
        widget=forms.PasswordInput(render_value=False),
        help_text="leave blank to keep the current key",
    )

    class Meta:
        model = Worker
        fields = ["api_key", "dp_aware", "draining"]

    def clean_api_key(self):
        return self.cleaned_data.get("api_key") or self.instance.api_key


class ReadOnly:
    """Admin mixin for rows the services, the health loop and the router write, never a person."""

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


class RankHitRates:
    """Admin mixin: a Rank's persisted counters as the two hit rates the dashboard compares."""

    @admin.display(description="router-predicted hit rate")
    def router_hit_rate(self, rank):
        return hit_rate(rank.predicted_tokens, rank.prompt_tokens)

    @admin.display(description="engine hit rate")
    def engine_hit_rate(self, rank):
        return hit_rate(rank.cached_tokens, rank.prompt_tokens)


class RankInline(ReadOnly, RankHitRates, admin.TabularInline):
    model = Rank
    extra = 0
    fields = readonly_fields = [
        "rank",
        "circuit_state",
        "requests",
        "prompt_tokens",
        "cached_tokens",
        "predicted_tokens",
        "errors",
        "router_hit_rate",
        "engine_hit_rate",
    ]


@admin.register(Worker)
class WorkerAdmin(admin.ModelAdmin):
    list_display = [
        "url",
        "flavour",
        "model_name",
        "dp_size",
        "health",
        "draining",
        "rank_count",
        "last_checked_at",
    ]
    list_filter = ["health", "draining"]
    search_fields = ["url", "model_id", "served_model_name"]
    form = WorkerChangeForm
    add_form = WorkerAddForm
    add_fieldsets = [(None, {"fields": ["url", "api_key", "dp_aware"]})]
    fieldsets = [
        (
            None,
            {
                "fields": [
                    "url",
                    "model_id",
                    "served_model_name",
                    "dp_size",
                    "api_key",
                    "dp_aware",
                    "draining",
                ]
            },
        ),
        (
            "Health",
            {"fields": ["health", "health_detail", "last_checked_at", "created_at", "updated_at"]},
        ),
        (
            "Discovery",
            {"fields": ["flavour", "discovery_sources", "overrides", "server_info_json"]},
        ),
        (f"Health history (last {HISTORY_LENGTH} events)", {"fields": ["health_history"]}),
    ]
    readonly_fields = [
        "url",
        "model_id",
        "served_model_name",
        "dp_size",
        "health",
        "health_detail",
        "last_checked_at",
        "created_at",
        "updated_at",
        "server_info_json",
        "health_history",
        "flavour",
        "discovery_sources",
        "overrides",
    ]
    inlines = [RankInline]
    actions = ["drain_selected", "undrain_selected"]

    def get_queryset(self, request):
        return super().get_queryset(request).annotate(rank_count=Count("ranks"))

    # ----- columns and read-only fields -----------------------------------------------------------
    @admin.display(description="model", ordering="served_model_name")
    def model_name(self, worker):  # not ``model``: ModelAdmin.model is the model class
        return worker.model_name

    @admin.display(description="ranks", ordering="rank_count")
    def rank_count(self, worker):
        return worker.rank_count

    @admin.display(description="flavour")
    def flavour(self, worker):
        return (worker.server_info or {}).get("flavour") or "—"

    @admin.display(description="where each fact came from")
    def discovery_sources(self, worker):
        sources = effective_info(worker.server_info, worker.overrides).get("sources") or {}
        if not sources:
            return "—"
        return format_html_join("", "<div>{}: {}</div>", sorted(sources.items()))

    @admin.display(description="server_info")
    def server_info_json(self, worker):
        return format_html(
            "<pre>{}</pre>", json.dumps(worker.server_info, indent=2, sort_keys=True)
        )

    @admin.display(description="events")
    def health_history(self, worker):
        events = worker.events.order_by("-at", "-id")[:HISTORY_LENGTH]
        if not events:
            return "—"
        rows = format_html_join(
            "",
            "<tr><td>{}</td><td>{}</td><td>{}</td></tr>",
            ((f"{e.at:%Y-%m-%d %H:%M:%S}", e.kind, e.detail) for e in events),
        )
        return format_html(
            "<table><thead><tr><th>at (UTC)</th><th>kind</th><th>detail</th></tr></thead>"
            "<tbody>{}</tbody></table>",
            rows,
        )

    # ----- add and change: through the services ---------------------------------------------------
    def get_form(self, request, obj=None, **kwargs):
        if obj is None:
            kwargs["form"] = type(
                "WorkerAddForm", (self.add_form,), {"runtime": runtime_of(request)}
            )
        return super().get_form(request, obj, **kwargs)

    def get_fieldsets(self, request, obj=None):
        return self.add_fieldsets if obj is None else super().get_fieldsets(request, obj)

    def get_readonly_fields(self, request, obj=None):
        return [] if obj is None else super().get_readonly_fields(request, obj)

    def get_inlines(self, request, obj):
        return [] if obj is None else super().get_inlines(request, obj)

    def save_model(self, request, obj, form, change):
        if not change:
            return  # WorkerAddForm.clean() registered it: ``obj`` is the saved worker
        saved = Worker.objects.get(pk=obj.pk)
        if (obj.api_key, obj.dp_aware) != (saved.api_key, saved.dp_aware):
            # rediscover with the new key, and install the targets dp-awareness asks for
            async_to_sync(worker_add)(
                url=saved.url,
                api_key=obj.api_key,
                dp_aware=obj.dp_aware,
                strict=False,
                runtime=runtime_of(request),
            )
        if obj.draining != saved.draining:
            async_to_sync(worker_set_draining)(
                worker_id=obj.pk, draining=obj.draining, runtime=runtime_of(request)
            )

    # ----- removal: through worker_remove, so the router forgets the targets ----------------------
    def delete_model(self, request, obj):
        async_to_sync(worker_remove)(worker_id=obj.pk, runtime=runtime_of(request))

    def delete_queryset(self, request, queryset):
        ids = list(queryset.values_list("id", flat=True))
        async_to_sync(_remove_all)(ids, runtime_of(request))

    def get_deleted_objects(self, objs, request):
        """A worker's ranks, events and samples go with it: their admins refusing deletion on their
        own must not block removing the worker."""
        deleted, counts, perms_needed, protected = super().get_deleted_objects(objs, request)
        cascaded = {m._meta.verbose_name for m in (Rank, WorkerEvent, RankSample)}
        return deleted, counts, perms_needed - cascaded, protected

    def get_actions(self, request):
        actions = super().get_actions(request)
        if "delete_selected" in actions:  # same name: the confirmation page posts it back
            actions["delete_selected"] = (
                remove_selected,
                "delete_selected",
                remove_selected.short_description,
            )
        return actions

    @admin.action(description="Drain selected workers", permissions=["change"])
    def drain_selected(self, request, queryset):
        self._set_draining(request, queryset, True)

    @admin.action(description="Undrain selected workers", permissions=["change"])
    def undrain_selected(self, request, queryset):
        self._set_draining(request, queryset, False)

    def _set_draining(self, request, queryset, draining: bool):
        ids = list(queryset.values_list("id", flat=True))
        async_to_sync(_drain_all)(ids, draining, runtime_of(request))
        self.message_user(
            request,
            f"{'Drained' if draining else 'Undrained'} {len(ids)} worker(s).",
            messages.SUCCESS,
        )


def remove_selected(modeladmin, request, queryset):
    """Django's delete_selected (its confirmation page included), whose deletion is
    ``WorkerAdmin.delete_queryset``: ``worker_remove`` for each."""
    return delete_selected(modeladmin, request, queryset)


remove_selected.short_description = "Remove selected workers"
remove_selected.allowed_permissions = ("delete",)


async def _remove_all(ids: list[int], runtime) -> None:
    for worker_id in ids:
        await worker_remove(worker_id=worker_id, runtime=runtime)


async def _drain_all(ids: list[int], draining: bool, runtime) -> None:
    for worker_id in ids:
        await worker_set_draining(worker_id=worker_id, draining=draining, runtime=runtime)


@admin.register(Rank)
class RankAdmin(ReadOnly, RankHitRates, admin.ModelAdmin):
    """Read-only: ranks follow their worker's discovery; the counters come from the router."""

    list_display = [
        "__str__",
        "worker",
        "rank",
        "circuit_state",
        "requests",
        "prompt_tokens",
        "cached_tokens",
        "predicted_tokens",
        "errors",
        "router_hit_rate",
        "engine_hit_rate",
    ]
    list_filter = ["circuit_state"]
    list_select_related = ["worker"]
    search_fields = ["worker__url"]


@admin.register(WorkerEvent)
class WorkerEventAdmin(ReadOnly, admin.ModelAdmin):
    """Read-only: the fleet's history (recorded by the services and the health loop)."""

    list_display = ["at", "worker", "kind", "detail"]
    list_filter = ["kind"]
    list_select_related = ["worker"]
    search_fields = ["worker__url", "detail"]
    date_hierarchy = "at"
