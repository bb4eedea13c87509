"""ASGI entry point: HTTP through Django, websockets through Channels."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
# Must run before anything below imports models: it sets up the app registry.
django_asgi_app = get_asgi_application()

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402

from apps.routing.fastpath import PATHS as PROXY_PATHS  # noqa: E402
from apps.routing.fastpath import openai_proxy  # noqa: E402
from apps.routing.routing import websocket_urlpatterns  # noqa: E402


async def http_app(scope, receive, send):
    """The OpenAI proxy paths skip Django's middleware (apps/routing/fastpath.py); the rest is Django."""
    if scope["path"] in PROXY_PATHS:
        return await openai_proxy(scope, receive, send)
    return await django_asgi_app(scope, receive, send)


application = ProtocolTypeRouter(
    {
        "http": http_app,
        "websocket": AllowedHostsOriginValidator(
            AuthMiddlewareStack(URLRouter(websocket_urlpatterns))
        ),
    }
)
