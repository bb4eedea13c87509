"""Running a router process: build its Router once, restore and discover workers, start the
background loops (daphne runs no ASGI lifespan, so they start here), serve under daphne.

``manage.py runrouter`` and ``serve`` call ``serve_router``; everything the process runs is
composed here, in ``RouterProcess``, and handed the router it needs.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging

from django.conf import settings

from apps.replicas.services import worker_add
from apps.routing import jobs
from apps.routing.admission import Admission
from apps.routing.drain import Drain
from apps.routing.fleet_sync import FleetSync
from apps.routing.health import health_loop, probe_all
from apps.routing.kv_events import KVEventsFeed
from apps.routing.persist import stats_loop
from apps.routing.policies import POLICY_NAMES
from apps.routing.router import Router, RouterConfig
from apps.routing.services import policy_adopt
from apps.routing.shared_index import IndexSync
from controlplane import http

logger = logging.getLogger("apps.router")

DEFAULT_ROUTER_PORT = 30000
STOP_WAIT_S = 2.0  # at shutdown, for the background loops and the cut requests to end
# connections the kernel holds for the router before it accepts them: uvicorn's default (vLLM's
# and SGLang's servers); Twisted's own, 50, overflowed under a burst of 1,000 streams and those
# clients' connections were reset (docs/benchmarks.md, issue 12). The kernel caps it at somaxconn.
LISTEN_BACKLOG = 2048


def listen_endpoint(host: str, port: int) -> str:
    """The Twisted endpoint string daphne listens on."""
    return f"tcp:port={port}:interface={host}:backlog={LISTEN_BACKLOG}"


def add_router_arguments(
    parser: argparse.ArgumentParser, *, port: int = DEFAULT_ROUTER_PORT
) -> None:
    parser.add_argument("--worker-urls", nargs="*", default=[], help="engine URLs to route to")
    parser.add_argument(
        "--dp-aware",
        action="store_true",
        help="one target per DP rank (from /server_info dp_size); inject data_parallel_rank",
    )
    parser.add_argument("--policy", default=None, choices=POLICY_NAMES)
    # what discovery cannot know or gets wrong, for every --worker-urls worker (POST /workers's
    # fields of the same names do it per worker)
    parser.add_argument(
        "--worker-dp-size",
        "--intra-node-data-parallel-size",  # vllm-router's name
        dest="worker_dp_size",
        type=int,
        default=None,
        help="the workers' DP size, instead of what discovery finds",
    )
    parser.add_argument("--worker-block-size", type=int, default=None)
    parser.add_argument("--worker-tokenizer-path", default=None)
    parser.add_argument(
        "--worker-kv-events",
        nargs="+",
        default=None,
        metavar="ENDPOINT",
        help="vLLM: its ZMQ KV-event publishers, one per rank (or the first, the next ports after)",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=port)
    parser.add_argument(
        "--tokenizer-path",
        default=None,
        help="tokenizer for digests when workers' model paths are not readable here",
    )
    parser.add_argument(
        "--cache-threshold", type=float, default=None, help="accepted for SGLang compatibility"
    )
    parser.add_argument(
        "--balance-abs-threshold", type=int, default=None, help="accepted for SGLang compatibility"
    )
    parser.add_argument(
        "--balance-rel-threshold",
        type=float,
        default=None,
        help="accepted for SGLang compatibility",
    )
    parser.add_argument(
        "--decode-weight",
        type=float,
        default=None,
        help="cache_aware: prefill-token cost of each request already running on a rank",
    )
    parser.add_argument("--health-check-interval-secs", type=float, default=None)
    parser.add_argument("--health-failure-threshold", type=int, default=None)
    parser.add_argument("--health-success-threshold", type=int, default=None)
    parser.add_argument("--request-timeout-secs", type=float, default=None)
    parser.add_argument("--max-retries", type=int, default=None)
    parser.add_argument("--prefix-ttl-secs", type=float, default=None)
    parser.add_argument(
        "--session-ttl-secs",
        type=float,
        default=None,
        help="how long a client session (X-Session-ID header or the OpenAI user field) keeps "
        "its rank after its last request (default 600)",
    )
    add_admission_arguments(parser)
    parser.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on /v1/completions, /v1/chat/completions and "
        "/v1/models (repeatable; vLLM's flag; replaces CONTROL_PLANE_API_KEYS)",
    )
    parser.add_argument(
        "--admin-key",
        action="append",
        default=None,
        metavar="KEY",
        help="Bearer key for the workers API's mutations, besides a staff session (repeatable; "
        "replaces CONTROL_PLANE_ADMIN_KEYS)",
    )


def add_admission_arguments(parser: argparse.ArgumentParser) -> None:
    """Admission control and drain (apps/routing/admission.py, drain.py); the defaults are the
    settings' (CONTROL_PLANE_MAX_CONCURRENT_REQUESTS ...)."""
    parser.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=None,
        help="requests this router process lets through at once; more wait (0: no limit)",
    )
    parser.add_argument(
        "--queue-size",
        type=int,
        default=None,
        help="requests that may wait for admission; more get 429 (default 100)",
    )
    parser.add_argument(
        "--queue-timeout-secs",
        type=float,
        default=None,
        help="a queued request's deadline for its first token: a 429 once its wait plus the "
        "engines' recent time to a first token would pass it (default 60)",
    )
    parser.add_argument(
        "--saturation-queued-prefill-tokens",
        type=int,
        default=None,
        help="new requests wait while every target has this many prefill tokens queued (0: off)",
    )
    parser.add_argument(
        "--saturation-kv-usage",
        type=float,
        default=None,
        help="new requests wait while every target whose KV usage is known uses this fraction "
        "of its KV cache (0: off)",
    )
    parser.add_argument(
        "--drain-timeout-secs",
        type=float,
        default=None,
        help="on SIGTERM/SIGINT, how long in-flight requests may finish before the router stops "
        "(default 25)",
    )


class RouterProcess:
    """One router process: its router and everything that runs beside the requests.

    ``start`` (on the server's loop, before the first request is served) restores the fleet
    from the database, adds ``worker_urls`` (discovered now or, if not up yet, by the health
    loop), probes every worker once (a restored one that does not answer serves nothing until it
    does; one no longer in ``worker_urls`` stays registered: the database, which other router
    processes share, is the fleet's record, and ``DELETE /workers/ID`` forgets it), adopts the
    recorded policy unless ``--policy`` was given, then starts the loops: health checks, stats
    persistence, the database sync, the engines' KV events, the shared index (with
    ``REDIS_URL``), and without a broker the periodic jobs. Until it is done, the fleet says
    is ``loading`` and /health answers 503 ``starting``.

    It also holds the process's admission control (the one the OpenAI endpoint admits through)
    and its ``drain``, which ``serve_router`` hands the signals.
    """

    def __init__(
        self,
        router: Router,
        worker_urls: list[str],
        policy_flag: str | None = None,
        overrides: dict | None = None,
    ):
        self.router, self.worker_urls, self.policy_flag = router, worker_urls, policy_flag
        self.overrides = overrides or None  # for each of worker_urls
        router.fleet.loading = True  # from before the socket listens until start() is done
        self.fleet_sync = FleetSync(router)
        self.admission = Admission.for_router(router)
        self.drain = Drain(router, self.admission, router.config.drain_timeout_s)
        self.index_sync: IndexSync | None = None
        # the loop keeps only weak references to tasks: the process holds them for its life
        self.tasks: list[asyncio.Task] = []

    async def start(self) -> list[asyncio.Task]:
        router = self.router
        jobs.notify_on(asyncio.get_running_loop())
        try:
            restored = await self.fleet_sync.sync()
            for url in self.worker_urls:
                await worker_add(url=url, strict=False, overrides=self.overrides, runtime=router)
            await probe_all(router)  # restored workers may be long gone: none serves unprobed
            await policy_adopt(router=router, flag=self.policy_flag)
        except Exception:  # /health stays 503: this process has no fleet to serve
            logger.exception("router startup failed")
            raise
        loops = [health_loop(router), stats_loop(router), self.fleet_sync.run()]
        if settings.CONTROL_PLANE["KV_EVENTS"]:
            loops.append(KVEventsFeed(router).run())  # it observes the router's dispatches
        if jobs.embedded():
            loops.append(jobs.embedded_jobs_loop())
        if settings.REDIS_URL and settings.CONTROL_PLANE["SHARE_INDEX"]:
            # one channel per control plane: the processes that share a database share an index
            channel = f"dpmesh:index:{settings.DATABASES['default']['NAME']}"
            self.index_sync = IndexSync(router, settings.REDIS_URL, channel)
            self.tasks += self.index_sync.start()
        logger.info(
            "router ready: %d workers restored, %d given; policy %s, %s; periodic jobs %s",
            restored,
            len(self.worker_urls),
            router.config.policy,
            "dp-aware" if router.config.dp_aware else "worker-level",
            "in this process" if jobs.embedded() else "on the Celery worker (REDIS_URL)",
        )
        if self.index_sync is not None:
            logger.info("prefix index and load shared with the other router processes (Redis)")
        # Everything loaded so far (Django, transformers, the fleet) lives as long as the process:
        # keep it out of the collector's full passes, which otherwise stall the event loop for
        # tens of ms (measured: p99 55 -> 3.6 ms at one connection, docs/benchmarks.md)
        gc.collect()
        gc.freeze()
        router.fleet.loading = False  # after the lines above: whoever sees /health 200 reads them
        self.tasks += [asyncio.ensure_future(loop) for loop in loops]
        return self.tasks

    async def stop(self) -> None:
        """On shutdown: end the background loops, let the requests the server has just cancelled
        (a drain cut short) unwind, tell the other router processes (if any) to stop counting
        this one's load, and close this loop's outbound connections."""
        for task in self.tasks:
            task.cancel()
        if self.tasks:
            await asyncio.wait(self.tasks, timeout=STOP_WAIT_S)
        deadline = asyncio.get_running_loop().time() + STOP_WAIT_S
        while self.admission.in_flight and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        if self.index_sync is not None:
            await self.index_sync.goodbye()
        await http.client.aclose()


def serve_router(opts: dict, on_ready=None) -> None:
    """Run a router process (blocking) until SIGINT/SIGTERM, then drain it (apps/routing/drain.py)
    and return."""
    for flag, name in (("api_key", "API_KEYS"), ("admin_key", "ADMIN_KEYS")):
        # a new dict: the settings' default stays untouched for whoever copied it
        if opts.get(flag):
            settings.CONTROL_PLANE = {**settings.CONTROL_PLANE, name: ",".join(opts[flag])}
    from daphne.server import Server  # installs the asyncio reactor first
    from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler
    from twisted.internet import reactor
    from twisted.internet.defer import Deferred

    from controlplane.asgi import build_application
    from engine.server.drain import close_loop, stop_reactor

    router = Router(RouterConfig.from_options(opts))
    overrides = {
        name: opts.get(f"worker_{name}")
        for name in ("dp_size", "block_size", "tokenizer_path", "kv_events")
        if opts.get(f"worker_{name}") is not None
    }
    process = RouterProcess(
        router, list(opts.get("worker_urls") or []), opts.get("policy"), overrides
    )
    loop = reactor._asyncioEventloop
    loop.call_soon(lambda: asyncio.ensure_future(process.start()))
    host, port = opts.get("host") or "127.0.0.1", opts.get("port") or DEFAULT_ROUTER_PORT
    app = _with_static(build_application(router), ASGIStaticFilesHandler)
    reactor.addSystemEventTrigger(
        "before", "shutdown", lambda: Deferred.fromFuture(asyncio.ensure_future(process.stop()))
    )
    if on_ready:
        loop.call_soon(on_ready)

    # Twisted's own handlers would stop the reactor at the first signal, cutting every stream
    process.drain.install(loop, lambda: stop_reactor(reactor))
    Server(
        application=app,
        endpoints=[listen_endpoint(host, port)],
        signal_handlers=False,
        verbosity=0,
        application_close_timeout=5,
    ).run()
    close_loop(loop)


def _with_static(application, handler):
    """Serve the admin's and dashboard's static files from the app itself (no CDN, no nginx)."""
    static_http = handler(application.application_mapping["http"])

    async def app(scope, receive, send):
        if scope["type"] == "http":
            return await static_http(scope, receive, send)
        return await application(scope, receive, send)

    return app


def ensure_admin_user() -> str:
    """Create the first admin from ``DJANGO_SUPERUSER_USERNAME`` / ``DJANGO_SUPERUSER_PASSWORD``
    (/ ``DJANGO_SUPERUSER_EMAIL``; Django's own names) when set and absent. Returns one line for
    the banner: who can log in, or how to create someone who can."""
    import os

    from django.contrib.auth import get_user_model
    from django.core.management import call_command

    users = get_user_model().objects
    name = os.environ.get("DJANGO_SUPERUSER_USERNAME", "").strip()
    if (
        name
        and os.environ.get("DJANGO_SUPERUSER_PASSWORD")
        and not users.filter(username=name).exists()
    ):
        os.environ.setdefault("DJANGO_SUPERUSER_EMAIL", "")
        call_command("createsuperuser", interactive=False, username=name, verbosity=0)
        return (
            f"admin user {name!r} created from DJANGO_SUPERUSER_USERNAME / "
            "DJANGO_SUPERUSER_PASSWORD"
        )
    if users.filter(is_staff=True, is_active=True).exists():
        return "log in with a staff account"
    return (
        "no admin user yet: run `python manage.py createsuperuser`, or start with "
        "DJANGO_SUPERUSER_USERNAME and DJANGO_SUPERUSER_PASSWORD set"
    )
