"""The router's public surface: the OpenAI proxy, health, metrics, and the workers API."""
from django.urls import include, path

from apps.routing import views

urlpatterns = [
    path("v1/completions", views.completions),
    path("v1/chat/completions", views.chat_completions),
    path("v1/models", views.models),
    path("health", views.health),
    path("metrics", views.metrics),
    path("", include("apps.replicas.urls")),
]
