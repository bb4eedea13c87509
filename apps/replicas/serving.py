"""Running the router process: configure the Router, restore and discover workers, start the
background loops (daphne runs no ASGI lifespan, so they start here), serve under daphne."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging

logger = logging.getLogger("apps.router")

DEFAULT_ROUTER_PORT = 30000


def add_router_arguments(
    parser: argparse.ArgumentParser, *, port: int = DEFAULT_ROUTER_PORT
) -> None:
    parser.add_argument("--worker-urls", nargs="*", default=[], help="engine URLs to route to")
    parser.add_argument(
        "--dp-aware",
        action="store_true",
        help="one target per DP rank (from /server_info dp_size); inject data_parallel_rank",
    )
    parser.add_argument(
        "--policy", default=None, choices=["cache_aware", "round_robin", "random", "power_of_two"]
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


def router_config(opts: dict):
    from apps.routing.router import RouterConfig

    return RouterConfig.from_settings(
        policy=opts.get("policy"),
        dp_aware=bool(opts.get("dp_aware")),
        tokenizer_path=opts.get("tokenizer_path"),
        cache_threshold=opts.get("cache_threshold"),
        balance_abs_threshold=opts.get("balance_abs_threshold"),
        balance_rel_threshold=opts.get("balance_rel_threshold"),
        decode_weight=opts.get("decode_weight"),
        health_check_interval_s=opts.get("health_check_interval_secs"),
        health_failure_threshold=opts.get("health_failure_threshold"),
        health_success_threshold=opts.get("health_success_threshold"),
        request_timeout_s=opts.get("request_timeout_secs"),
        max_retries=opts.get("max_retries"),
        prefix_ttl_s=opts.get("prefix_ttl_secs"),
    )


async def startup(
    router, worker_urls: list[str], policy_flag: str | None = None
) -> list[asyncio.Task]:
    """Restore the fleet from the database, add ``worker_urls`` (discovered now or, if not up
    yet, by the health loop), adopt the recorded policy unless ``--policy`` was given, and start
    the background loops (with no broker, the periodic jobs run here too)."""
    from django.conf import settings

    from apps.replicas.health import health_loop
    from apps.replicas.services import fleet_restore, worker_add
    from apps.routing import background, jobs
    from apps.routing.persist import stats_loop

    router.starting = True
    jobs.notify_on(asyncio.get_running_loop())
    try:
        restored = await fleet_restore(router=router)
        for url in worker_urls:
            await worker_add(url=url, strict=False, router=router)
        await background.adopt_policy(router, policy_flag)
    except Exception:  # /health stays 503: this process has no fleet to serve
        logger.exception("router startup failed")
        raise
    loops = [health_loop(router), stats_loop(router), background.sync_loop(router)]
    if settings.CONTROL_PLANE["KV_EVENTS"]:
        from apps.routing.kv_events import KVEventsFeed

        loops.append(KVEventsFeed(router).run())  # it installs itself as router.kv_feed
    if background.embedded():
        loops.append(background.embedded_jobs_loop())
    tasks = []
    if settings.REDIS_URL and settings.CONTROL_PLANE["SHARE_INDEX"]:
        from apps.routing.shared_index import IndexSync

        # one channel per control plane: the processes that share a database share an index
        channel = f"dpmesh:index:{settings.DATABASES['default']['NAME']}"
        router.index_sync = IndexSync(router, settings.REDIS_URL, channel)
        tasks = router.index_sync.start()
    logger.info(
        "router ready: %d workers restored, %d given; policy %s, %s; periodic jobs %s",
        restored,
        len(worker_urls),
        router.config.policy,
        "dp-aware" if router.config.dp_aware else "worker-level",
        "in this process" if background.embedded() else "on the Celery worker (REDIS_URL)",
    )
    if router.index_sync is not None:
        logger.info("prefix index and load shared with the other router processes through Redis")
    # Everything loaded so far (Django, transformers, the fleet) lives as long as the process: keep
    # it out of the collector's full passes, which otherwise stall the event loop for tens of ms
    # (measured: p99 55 -> 3.6 ms at one connection, docs/benchmarks.md)
    gc.collect()
    gc.freeze()
    router.starting = False  # after the lines above: whoever sees /health 200 can read them
    # the loop keeps only weak references to tasks: the router holds them for the process's life
    router.background_tasks = tasks + [asyncio.ensure_future(loop) for loop in loops]
    return router.background_tasks


def serve_router(opts: dict, on_ready=None) -> None:
    """Run the router (blocking) until SIGINT/SIGTERM."""
    from django.conf import settings

    for flag, name in (("api_key", "API_KEYS"), ("admin_key", "ADMIN_KEYS")):
        if opts.get(
            flag
        ):  # a new dict: the settings' default stays untouched for whoever copied it
            settings.CONTROL_PLANE = {**settings.CONTROL_PLANE, name: ",".join(opts[flag])}
    from daphne.server import Server  # installs the asyncio reactor first
    from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler
    from twisted.internet import reactor

    from apps.routing.router import Router, set_router
    from controlplane.asgi import application

    router = set_router(Router(router_config(opts)))
    router.starting = True  # before the socket listens; startup() clears it
    loop = reactor._asyncioEventloop
    loop.call_soon(
        lambda: asyncio.ensure_future(
            startup(router, list(opts.get("worker_urls") or []), opts.get("policy"))
        )
    )
    host, port = opts.get("host") or "127.0.0.1", opts.get("port") or DEFAULT_ROUTER_PORT
    app = _with_static(application, ASGIStaticFilesHandler)
    reactor.addSystemEventTrigger("before", "shutdown", _say_goodbye, router)
    if on_ready:
        loop.call_soon(on_ready)
    Server(
        application=app,
        endpoints=[f"tcp:port={port}:interface={host}"],
        signal_handlers=True,
        verbosity=0,
        application_close_timeout=5,
    ).run()


def _say_goodbye(router):
    """On shutdown, tell the other router processes (if any) to stop counting this one's load."""
    if router.index_sync is None:
        return None
    from twisted.internet.defer import Deferred

    return Deferred.fromFuture(asyncio.ensure_future(router.index_sync.goodbye()))


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
        return f"admin user {name!r} created from DJANGO_SUPERUSER_USERNAME / DJANGO_SUPERUSER_PASSWORD"
    if users.filter(is_staff=True, is_active=True).exists():
        return "log in with a staff account"
    return (
        "no admin user yet: run `python manage.py createsuperuser`, or start with DJANGO_SUPERUSER_USERNAME "
        "and DJANGO_SUPERUSER_PASSWORD set"
    )
