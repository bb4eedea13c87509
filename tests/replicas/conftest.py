"""A fresh dp-aware router installed as the process's router for one test, restored afterwards,
in a sync flavour (the Django test client, the admin through async_to_sync) and an async one."""

import pytest

from apps.routing import router as router_module
from apps.routing.proxy import proxy_client, upstream
from apps.routing.router import Router, RouterConfig, set_router


@pytest.fixture
def router():
    saved = router_module._router
    fresh = set_router(Router(RouterConfig(dp_aware=True)))
    yield fresh
    set_router(saved)
    upstream.client = upstream.loop = None  # bound to a loop async_to_sync has closed


@pytest.fixture
async def arouter():
    saved = router_module._router
    fresh = set_router(Router(RouterConfig(dp_aware=True)))
    yield fresh
    set_router(saved)
    await upstream.aclose()  # bound to this test's event loop
    await proxy_client.aclose()
