"""ASGI entry point: the OpenAI proxy paths straight to the router, the rest of HTTP through
Django, websockets through Channels.

``build_application(router, admission)`` is what a router process serves (apps/routing/process.py
builds both once and hands them here). Django views and Channels consumers find them in their
scope under ``apps.replicas.runtime.SCOPE_KEY``, in the process's ``LiveFleet``; the OpenAI
endpoint holds them itself.

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
from apps.routing.live import LiveFleet  # noqa: E402
from apps.routing.proxy.admission import make_admission  # noqa: E402
from apps.routing.proxy.endpoint import PATHS as PROXY_PATHS  # noqa: E402
from apps.routing.proxy.endpoint import OpenAIEndpoint  # noqa: E402
from apps.routing.websocket_urls import websocket_urlpatterns  # noqa: E402


def build_application(router, admission=None, django_http=django_asgi_app):
    """The ASGI app of a router process serving through ``router``, admitting through
    ``admission`` (the process's; None: one made for this app). Django's views and the websocket
    find both in their scope, through the process's ``LiveFleet``."""
    admission = admission or make_admission(router)
    proxy = OpenAIEndpoint(router, admission)
    live = LiveFleet(router, admission)
    websocket = AllowedHostsOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns)))

    async def http_app(scope, receive, send):
        if scope["path"] in PROXY_PATHS:  # the hot path skips Django's middleware
            return await proxy(scope, receive, send)
        return await django_http({**scope, SCOPE_KEY: live}, receive, send)

    async def websocket_app(scope, receive, send):
        return await websocket({**scope, SCOPE_KEY: live}, receive, send)

    application = ProtocolTypeRouter({"http": http_app, "websocket": websocket_app})
    application.proxy = proxy  # for a wrapper that sends ``PROXY_PATHS`` here itself
    return application


def __getattr__(name):
    if name == "application":
        from apps.routing.decision.router import Router
        from apps.routing.flags import config_from_settings

        app = build_application(Router(config_from_settings()))
        globals()["application"] = app
        return app
    raise AttributeError(name)
