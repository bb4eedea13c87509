"""A fresh dp-aware router for one test, as a router process would hand it to its requests: the
Django test clients carry it (``admin_client``, ``client``), services are given it as their
runtime. A sync flavour (the Django test client, the admin through async_to_sync) and an async
one."""

import pytest

from apps.replicas.runtime import SCOPE_KEY
from apps.routing.decision.config import RouterConfig
from apps.routing.decision.router import Router
from apps.routing.live import LiveFleet
from controlplane import http


@pytest.fixture
def router():
    return Router(RouterConfig(dp_aware=True))


@pytest.fixture
def admin_client(admin_client, router):
    # a WSGI request's environ, as the ASGI scope
    admin_client.defaults[SCOPE_KEY] = LiveFleet(router)
    return admin_client


@pytest.fixture
async def arouter():
    yield Router(RouterConfig(dp_aware=True))
    await http.client.aclose()  # bound to this test's event loop
