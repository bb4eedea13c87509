"""ASGI entry point: the OpenAI proxy paths straight to the router, the rest of HTTP through
Django, websockets through Channels.

``build_application(router)`` is what a router process serves (apps/routing/process.py builds its
router once and hands it here). Django views and Channels consumers find that router in their
scope under ``apps.replicas.runtime.SCOPE_KEY``; the OpenAI endpoint holds it itself.

``application`` (``ASGI_APPLICATION``, ``daphne controlplane.asgi:application``) is built on first
use with a router from the settings alone: no workers restored, no background loops. Serve a
fleet with ``manage.py runrouter`` or ``serve``.
"""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
# Must run before anything below imports models: it sets up the app registry.
django_asgi_app = get_asgi_application()

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402

from apps.replicas.runtime import SCOPE_KEY  # noqa: E402
from apps.routing.endpoint import PATHS as PROXY_PATHS  # noqa: E402
from apps.routing.endpoint import OpenAIEndpoint  # noqa: E402
from apps.routing.websocket_urls import websocket_urlpatterns  # noqa: E402


def build_application(router, django_http=django_asgi_app):
    """The ASGI app of a router process serving through ``router``."""
    proxy = OpenAIEndpoint(router)
    websocket = AllowedHostsOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns)))

    async def http_app(scope, receive, send):
        if scope["path"] in PROXY_PATHS:  # the hot path skips Django's middleware
            return await proxy(scope, receive, send)
        return await django_http({**scope, SCOPE_KEY: router}, receive, send)

    async def websocket_app(scope, receive, send):
        return await websocket({**scope, SCOPE_KEY: router}, receive, send)

    return ProtocolTypeRouter({"http": http_app, "websocket": websocket_app})


def __getattr__(name):
    if name == "application":
        from apps.routing.router import Router

        app = build_application(Router())
        globals()["application"] = app
        return app
    raise AttributeError(name)
