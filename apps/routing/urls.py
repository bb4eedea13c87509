"""The router's Django surface: models, health, metrics, the dashboard, the workers API (the
OpenAI proxy paths are served before Django, by apps/routing/proxy/endpoint.py)."""

from django.urls import include, path
from django.views.generic import RedirectView

from apps.routing import dashboard_views, views

urlpatterns = [
    path("", RedirectView.as_view(url="/dashboard/", permanent=False)),
    path("dashboard/", dashboard_views.dashboard, name="dashboard"),
    path("dashboard/snapshot", dashboard_views.snapshot),
    path("dashboard/policy", dashboard_views.policy),
    path("dashboard/bench", dashboard_views.bench),
    path("v1/models", views.models),
    path("health", views.health),
    path("metrics", views.metrics),
    path("misses", views.misses),
    path("", include("apps.replicas.urls")),
]
