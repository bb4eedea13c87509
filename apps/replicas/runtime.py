"""What the replicas app asks of a running router process, declared here so that it never imports
the routing app (the one arrow between the apps points from routing to replicas).

The services of this app write the durable record (``Worker``, ``Rank``); when they run inside a
router process they also tell its live fleet, through a ``FleetRuntime`` (the process's
``apps.routing.live.LiveFleet`` implements it). Without one (a Celery worker, a shell), they only
write the database, and every router process applies the change when it next syncs from it
(within seconds).

The router process hands its runtime to each request: ``controlplane.asgi`` puts it in the ASGI
scope under ``SCOPE_KEY``; a WSGI request (Django's test client) carries it in its environ.
"""

from __future__ import annotations

from typing import Protocol

SCOPE_KEY = "dpmesh.router"


class FleetRuntime(Protocol):
    dp_aware: bool  # the process's default for workers registered without saying

    def worker_saved(self, worker, rank_ids: dict[int | None, int]) -> None:
        """A Worker row was written (registered, rediscovered, changed): serve what it says."""

    def worker_removed(self, worker_id: int) -> None:
        """The worker is gone from the record: stop routing to it and forget its cache."""

    def worker_draining(self, worker_id: int, draining: bool) -> None:
        """The worker stops (or resumes) taking new requests."""

    def worker_live(self, worker_id: int) -> dict | None:
        """Live state for the workers API (health as this process sees it, its targets' circuit
        and load), or None when the worker is not installed here."""


def runtime_of(request) -> FleetRuntime | None:
    """The router process's runtime serving ``request`` (None outside a router process)."""
    scope = getattr(request, "scope", None)
    if scope is not None:
        return scope.get(SCOPE_KEY)
    return getattr(request, "META", {}).get(SCOPE_KEY)
