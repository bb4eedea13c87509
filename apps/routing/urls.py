"""The router's Django surface: models, health, metrics, the workers API (the OpenAI proxy paths
are served before Django, by apps/routing/fastpath.py)."""
from django.urls import include, path

from apps.routing import views

urlpatterns = [
    path("v1/models", views.models),
    path("health", views.health),
    path("metrics", views.metrics),
    path("", include("apps.replicas.urls")),
]
