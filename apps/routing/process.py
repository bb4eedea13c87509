"""Running a router process: build its Router once, restore and discover workers, start the
background loops (daphne runs no ASGI lifespan, so they start here), serve under daphne.

``manage.py runrouter`` and ``serve`` call ``serve_router``; everything the process runs is
composed here, in ``RouterProcess``, and handed the router it needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import shutil
import signal
import socket
import tempfile
import time
from pathlib import Path

from asgiref.sync import markcoroutinefunction
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from apps.replicas.services import worker_add
from apps.routing import jobs, worker_metrics
from apps.routing.decision.router import Router
from apps.routing.feeds.fleet_sync import FleetSync
from apps.routing.feeds.health import health_loop, probe_all
from apps.routing.feeds.kv_events import KVEventsFeed
from apps.routing.feeds.persist import stats_loop
from apps.routing.feeds.shared_index import IndexSync
from apps.routing.flags import DEFAULT_ROUTER_PORT, SERVERS, config_from_options, pd_workers
from apps.routing.live import LiveFleet
from apps.routing.proxy import tenants
from apps.routing.proxy.admission import make_admission
from apps.routing.proxy.drain import Drain
from apps.routing.services import policy_adopt
from controlplane import http

logger = logging.getLogger(__name__)

RESPAWN_WINDOW_S, RESPAWN_LIMIT = 10.0, 3  # workers that die this soon, this often in a row: stop
STOP_WAIT_S = 2.0  # at shutdown, for the background loops and the cut requests to end
# connections the kernel holds for the router before it accepts them: uvicorn's default (vLLM's
# and SGLang's servers); Twisted's own, 50, overflowed under a burst of 1,000 streams and those
# clients' connections were reset (docs/benchmarks.md, the overload runs). The kernel caps it at
# somaxconn.
LISTEN_BACKLOG = 2048


def listen_endpoint(host: str, port: int) -> str:
    """The Twisted endpoint string daphne listens on."""
    return f"tcp:port={port}:interface={host}:backlog={LISTEN_BACKLOG}"


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
        jobs_here: bool | None = None,
        jobs_where: str = "on the Celery worker (REDIS_URL)",
        restore_stats: bool = True,
        role_workers: list[tuple[str, dict]] = (),
    ):
        self.router, self.worker_urls, self.policy_flag = router, worker_urls, policy_flag
        # the periodic jobs: here without a broker (or, of ``--workers N``, in the first worker)
        self.jobs_here = jobs.embedded() if jobs_here is None else jobs_here
        self.jobs_where = jobs_where  # where they run when not here, for the log
        self.restore_stats = restore_stats  # counters start from the rows (feeds/persist.py)
        self.overrides = overrides or None  # for each of worker_urls
        self.role_workers = list(role_workers)  # --prefill / --decode: (url, their overrides)
        router.fleet.loading = True  # from before the socket listens until start() is done
        self.fleet_sync = FleetSync(router)
        self.admission = make_admission(router)
        self.live = LiveFleet(router, self.admission)  # what the replicas' services tell
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
                await worker_add(url=url, strict=False, overrides=self.overrides, runtime=self.live)
            for url, role in self.role_workers:
                overrides = {**(self.overrides or {}), **role}
                await worker_add(url=url, strict=False, overrides=overrides, runtime=self.live)
            await probe_all(router)  # restored workers may be long gone: none serves unprobed
            await policy_adopt(router=router, flag=self.policy_flag)
        except Exception:  # /health stays 503: this process has no fleet to serve
            logger.exception("router startup failed")
            raise
        loops = [health_loop(router), stats_loop(router, self.restore_stats), self.fleet_sync.run()]
        if worker_metrics.shared():  # a worker of --workers N: /metrics adds up all of them
            loops.append(worker_metrics.publish_loop(router))
        if settings.CONTROL_PLANE["KV_EVENTS"]:
            loops.append(KVEventsFeed(router).run())  # it observes the router's dispatches
        if self.jobs_here:
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
            "in this process" if self.jobs_here else self.jobs_where,
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
    """Run a router process (blocking) until SIGINT/SIGTERM, then drain it
    (apps/routing/proxy/drain.py) and return. ``opts["server"]`` (else ``CONTROL_PLANE_SERVER``)
    names the ASGI server: daphne (Twisted on asyncio) or uvicorn (uvloop and httptools); the
    application, the background loops and the drain are the same under both."""
    for flag, name in (("api_key", "API_KEYS"), ("admin_key", "ADMIN_KEYS")):
        # a new dict: the settings' default stays untouched for whoever copied it
        if opts.get(flag):
            settings.CONTROL_PLANE = {**settings.CONTROL_PLANE, name: ",".join(opts[flag])}
    server = opts.get("server") or settings.CONTROL_PLANE["SERVER"]
    if server not in SERVERS:
        raise ValueError(f"unknown server {server!r}; choose one of {list(SERVERS)}")
    workers = opts.get("workers") or 1
    if workers > 1:
        serve_workers(opts, workers, server, on_ready)
        return
    _serve_one(opts, server, on_ready)


def _serve_one(
    opts: dict,
    server: str,
    on_ready=None,
    sock=None,
    jobs_here: bool | None = None,
    restore_stats: bool = True,
    **where,
) -> None:
    """One router process, listening on ``sock`` when given (a worker of ``serve_workers``)."""
    from serving import tracing

    tracing.setup("dpmesh-router")  # its spans, when an OTLP endpoint is configured
    if server == "daphne":
        from daphne.server import Server  # installs the asyncio reactor first
        from twisted.internet import reactor

        loop = reactor._asyncioEventloop
    else:
        import uvloop

        loop = uvloop.new_event_loop()
        asyncio.set_event_loop(loop)
    from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler

    from controlplane.asgi import build_application

    router = Router(config_from_options(opts))
    role_workers = pd_workers(opts)
    if role_workers and not router.config.pd:
        raise ImproperlyConfigured("--prefill and --decode need --pd-disaggregation")
    try:
        tenants.from_config(router.config)  # a malformed limit stops the start, not a request
    except ValueError as exc:
        raise ImproperlyConfigured(f"--tenant-limit / --default-tenant-limit: {exc}") from exc
    overrides = {
        name: opts.get(f"worker_{name}")
        for name in ("dp_size", "block_size", "tokenizer_path", "kv_events")
        if opts.get(f"worker_{name}") is not None
    }
    process = RouterProcess(
        router,
        list(opts.get("worker_urls") or []),
        opts.get("policy"),
        overrides,
        jobs_here,
        restore_stats=restore_stats,
        role_workers=role_workers,
        **where,
    )
    loop.call_soon(lambda: asyncio.ensure_future(process.start()))
    host, port = opts.get("host") or "127.0.0.1", opts.get("port") or DEFAULT_ROUTER_PORT
    app = _with_static(build_application(router, process.admission), ASGIStaticFilesHandler)
    if on_ready:
        loop.call_soon(on_ready)
    if server == "daphne":
        _run_daphne(Server, reactor, loop, app, process, host, port)
    else:
        _run_uvicorn(loop, app, process, host, port, sock)


def _run_daphne(Server, reactor, loop, app, process: RouterProcess, host: str, port: int) -> None:
    from twisted.internet.defer import Deferred

    from serving.drain import close_loop, stop_reactor

    reactor.addSystemEventTrigger(
        "before", "shutdown", lambda: Deferred.fromFuture(asyncio.ensure_future(process.stop()))
    )
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


def _run_uvicorn(loop, app, process: RouterProcess, host: str, port: int, sock=None) -> None:
    from serving.drain import close_loop
    from serving.uvicorn_server import make_server

    server = make_server(
        app,
        host,
        port,
        backlog=LISTEN_BACKLOG,
        graceful_s=STOP_WAIT_S,
        header_timeout_s=settings.CONTROL_PLANE["HEADER_TIMEOUT_S"],
    )

    process.drain.install(loop, server.stop)
    try:
        loop.run_until_complete(server.serve(sockets=[sock] if sock is not None else None))
        loop.run_until_complete(process.stop())
    finally:
        close_loop(loop)


def serve_workers(opts: dict, workers: int, server: str, on_ready=None) -> None:
    """``--workers N``: N router processes accepting on one port (a socket each, bound here, then
    inherited by ``fork``: the kernel hands each connection to one of them,
    ``listening_sockets``), sharing their prefix
    index, load, sessions' placement and the fleet through Redis and the database as separate
    router processes do (docs/operations.md). The first worker also runs the periodic jobs (no
    Celery worker needed). /metrics adds up every worker's numbers (apps/routing/worker_metrics.py,
    through files in a directory made here). This process only supervises: it passes
    SIGTERM/SIGINT on (each worker drains), and forks a worker that died again, unless they keep
    dying."""
    from django.core.management.base import CommandError
    from django.db import connections

    if not settings.REDIS_URL:
        raise CommandError(
            f"--workers {workers} needs REDIS_URL: the worker processes share their prefix "
            "index and load through Redis (e.g. REDIS_URL=redis://127.0.0.1:6379/0), and a "
            "database they can all write (Postgres, DATABASE_URL; SQLite serves a few)"
        )
    if server != "uvicorn":
        raise CommandError(f"--workers {workers} runs under uvicorn only (not --server {server})")
    host, port = opts.get("host") or "127.0.0.1", opts.get("port") or DEFAULT_ROUTER_PORT
    socks = listening_sockets(host, port, workers)
    connections.close_all()  # no database connection crosses a fork
    published = Path(tempfile.mkdtemp(prefix="dpmesh-router-metrics-"))
    children: dict[int, int] = {}  # pid -> worker index
    started: dict[int, float] = {}
    stopping = []

    def spawn(index: int, again: bool = False) -> None:
        pid = os.fork()
        if pid == 0:  # the worker
            code = 0
            try:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                worker_metrics.configure(published, index)
                for other in socks:
                    if other is not socks[index]:
                        other.close()  # (this process's copies: the supervisor keeps its own)
                _serve_one(
                    opts,
                    server,
                    sock=socks[index],
                    jobs_here=index == 0,
                    restore_stats=index == 0 and not again,  # the history, counted once
                    jobs_where="in worker 0",
                )
            except BaseException:
                logger.exception("router worker %d failed", index)
                code = 1
            finally:
                os._exit(code)
        children[pid], started[index] = index, time.monotonic()

    def forward(signum, _frame) -> None:
        stopping.append(signum)
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    for index in range(workers):
        spawn(index)
    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    logger.info("router: %d worker processes on %s:%d", workers, host, port)
    if on_ready:
        on_ready()
    quick_deaths = 0
    while children:
        pid, status = os.wait()
        index = children.pop(pid, None)
        if index is None or stopping:
            continue
        lived = time.monotonic() - started[index]
        logger.error(
            "router worker %d (pid %d) exited (status %d) after %.0f s", index, pid, status, lived
        )
        quick_deaths = quick_deaths + 1 if lived < RESPAWN_WINDOW_S else 0
        if quick_deaths > RESPAWN_LIMIT:
            logger.error("router workers keep dying: stopping all")
            forward(signal.SIGTERM, None)
            continue
        worker_metrics.retire(published, index)  # its counts stay in the fleet's /metrics
        spawn(index, again=True)
    for sock in socks:
        sock.close()
    shutil.rmtree(published, ignore_errors=True)


def listening_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """``count`` sockets listening on ``host:port``, one a worker, each with its own accept queue
    (``SO_REUSEPORT``): the kernel spreads new connections over them by a hash of their
    addresses. On one shared socket whichever worker woke first accepted most of a burst: wrk's
    32 connections split 1/31, 7/25, 24/8 and 16/16 over two workers in four tries. Bound here,
    before the workers are forked: a worker forked again takes over its predecessor's socket, and
    the connections that waited in it meanwhile. Where the platform has no ``SO_REUSEPORT``, all
    workers share one socket.

    ``SO_REUSEPORT`` would also let a second ``--workers`` router of the same user join the port
    and take a share of its connections unseen; the port is first bound without it, so that a
    port anyone listens on is refused as it always was (``OSError``: address in use)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    reuse_port = hasattr(socket, "SO_REUSEPORT")
    if reuse_port:
        with socket.socket(family) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
            port = probe.getsockname()[1]
    socks: list[socket.socket] = []
    for _ in range(count if reuse_port else 1):
        sock = socket.socket(family)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        port = sock.getsockname()[1]  # (port 0: the others take the one the first got)
        sock.listen(LISTEN_BACKLOG)
        sock.set_inheritable(True)
        socks.append(sock)
    return socks if reuse_port else socks * count


def _with_static(application, handler):
    """Serve the admin's and dashboard's static files from the app itself (no CDN, no nginx).
    The OpenAI paths go straight to the endpoint: no static file is under them."""
    from apps.routing.proxy.endpoint import PATHS

    http_app = application.application_mapping["http"]
    proxy = application.proxy  # the OpenAI endpoint itself: one call less a request
    static_http = handler(http_app)

    # an app that hands back its handler's awaitable, with no frame of its own in the request's
    # every resume; marked a coroutine function, as servers check (ASGI 3, not 2)
    @markcoroutinefunction
    def app(scope, receive, send):
        if scope["type"] == "http":
            if scope["path"] in PATHS:
                return proxy(scope, receive, send)
            return static_http(scope, receive, send)
        return application(scope, receive, send)

    return app
