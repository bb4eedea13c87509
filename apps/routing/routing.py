"""Websocket routes, mounted by ``controlplane.asgi`` behind origin and auth checks."""

websocket_urlpatterns = []
