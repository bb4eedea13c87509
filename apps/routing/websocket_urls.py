"""Websocket routes, mounted by ``controlplane.asgi`` behind origin and auth checks."""

from django.urls import path

from apps.routing.consumers import DashboardConsumer

websocket_urlpatterns = [path("ws/dashboard/", DashboardConsumer.as_asgi())]
