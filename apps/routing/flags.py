"""A router process's configuration from its command line (``runrouter``; SGLang's flag names where
they exist, vLLM's and vllm-router's accepted beside them) and the settings (``CONTROL_PLANE``)."""

from __future__ import annotations

import argparse

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from apps.routing.decision.config import RouterConfig
from apps.routing.decision.policies import POLICIES, POLICY_NAMES

DEFAULT_ROUTER_PORT = 30000
SERVERS = ("daphne", "uvicorn")  # the ASGI servers a router process runs under (process.py)


def add_router_arguments(
    parser: argparse.ArgumentParser, *, port: int = DEFAULT_ROUTER_PORT
) -> None:
    """Every ``runrouter`` flag, in the order ``--help`` lists them; each group is its own function
    so a flag is found (and added) beside the ones it belongs with."""
    parser.add_argument("--worker-urls", nargs="*", default=[], help="engine URLs to route to")
    parser.add_argument(
        "--dp-aware",
        action="store_true",
        help="one target per DP rank (from /server_info dp_size); inject data_parallel_rank",
    )
    parser.add_argument("--policy", default=None, choices=POLICY_NAMES)
    add_worker_override_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=port)
    parser.add_argument(
        "--server",
        choices=SERVERS,
        default=None,
        help="the ASGI server the router runs under (default: CONTROL_PLANE_SERVER, else uvicorn)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="router processes accepting on the port (N > 1 needs REDIS_URL: docs/operations.md)",
    )
    add_routing_arguments(parser)
    add_pd_arguments(parser)
    add_admission_arguments(parser)
    add_access_key_arguments(parser)


def add_pd_arguments(parser: argparse.ArgumentParser) -> None:
    """Prefill/decode disaggregation (apps/routing/proxy/pd.py): smg's flags, vllm-router's
    ``--vllm-pd-disaggregation`` beside them."""
    group = parser.add_argument_group("prefill/decode disaggregation")
    group.add_argument(
        "--pd-disaggregation",
        action="store_true",
        help="route each request's prefill to a prefill worker and its decode to a decode worker",
    )
    group.add_argument(
        "--vllm-pd-disaggregation",
        action="store_true",
        help="vllm-router's flag: --pd-disaggregation with vLLM's kv_transfer_params protocol",
    )
    group.add_argument(
        "--prefill",
        nargs="+",
        action="append",
        default=[],
        metavar=("URL", "BOOTSTRAP_PORT"),
        help="a prefill worker, and its bootstrap port for SGLang's protocol (repeatable)",
    )
    group.add_argument(
        "--decode", action="append", default=[], metavar="URL", help="a decode worker (repeatable)"
    )
    group.add_argument("--prefill-policy", default=None, choices=POLICY_NAMES)
    group.add_argument("--decode-policy", default=None, choices=POLICY_NAMES)
    group.add_argument(
        "--pd-protocol",
        choices=["auto", "vllm", "sglang"],
        default=None,
        help="the handshake between the legs (auto: SGLang's bootstrap, both legs at once, for "
        "SGLang and for ours in both roles; vLLM's kv_transfer_params for vLLM, ATOM and mixed "
        "fleets)",
    )


def pd_workers(opts: dict) -> list[tuple[str, dict]]:
    """(url, registration overrides) of every ``--prefill`` / ``--decode`` worker."""
    out = []
    for given in opts.get("prefill") or []:
        url, *rest = given
        overrides = {"role": "prefill"}
        if rest and rest[0].lower() != "none":
            try:
                overrides["bootstrap_port"] = int(rest[0])
            except ValueError:
                raise ImproperlyConfigured(f"--prefill {url} {rest[0]}: not a port") from None
        out.append((url, overrides))
    out += [(url, {"role": "decode"}) for url in opts.get("decode") or []]
    return out


def add_worker_override_arguments(parser: argparse.ArgumentParser) -> None:
    """What discovery cannot know or gets wrong, for every ``--worker-urls`` worker (POST
    /workers's fields of the same names do it per worker)."""
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


def add_routing_arguments(parser: argparse.ArgumentParser) -> None:
    """The routing knobs: the policy's weights, health checks, retries and the index's and
    sessions' lifetimes (``OPTION_FIELDS`` maps them onto ``RouterConfig``; None: the settings'
    value). SGLang's threshold flags are accepted so its command lines run unchanged."""
    parser.add_argument(
        "--tokenizer-path",
        default=None,
        help="tokenizer for digests when workers' model paths are not readable here",
    )
    for flag, kind in (
        ("--cache-threshold", float),
        ("--balance-abs-threshold", int),
        ("--balance-rel-threshold", float),
    ):
        parser.add_argument(flag, type=kind, default=None, help="accepted for SGLang compatibility")
    parser.add_argument(
        "--decode-weight",
        type=float,
        default=None,
        help="cache_aware: prefill-token cost of each request already running on a rank",
    )
    parser.add_argument(
        "--time-check",
        choices=["on", "off"],
        default=None,
        help="cache_aware: send a request elsewhere than the policy chose when the learned time "
        "model expects its first token clearly sooner there (default on; CONTROL_PLANE_TIME_CHECK)",
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


def add_access_key_arguments(parser: argparse.ArgumentParser) -> None:
    """Who may call the router: keys given here replace the settings' CONTROL_PLANE_API_KEYS and
    CONTROL_PLANE_ADMIN_KEYS for this process (``serve_router`` applies them), so a command line
    alone says who gets in."""
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
    """Admission control and drain (apps/routing/proxy/admission.py, drain.py); the defaults are the
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
    parser.add_argument(
        "--tenant-limit",
        action="append",
        default=None,
        metavar="TENANT=RPM[:TPM]",
        help="a tenant's requests (and tokens) a minute, per router process; the tenant is the "
        "X-Tenant-Id header, else the API key's key-<sha256 prefix> (repeatable; replaces "
        "CONTROL_PLANE_TENANT_LIMITS)",
    )
    parser.add_argument(
        "--tenant-cache-salt",
        action="store_true",
        default=None,
        help="a request without a cache_salt gets its tenant (X-Tenant-Id, else the API key's "
        "key-<sha256 prefix>) as one: tenants share no cached prefix (CONTROL_PLANE_TENANT_CACHE_"
        "SALT)",
    )
    parser.add_argument(
        "--default-tenant-limit",
        default=None,
        metavar="RPM[:TPM]",
        help="every tenant not named by --tenant-limit (default: not limited)",
    )


# runrouter option -> RouterConfig field, where the names differ (the flags are SGLang's)
OPTION_FIELDS = {
    "policy": "policy",
    "tokenizer_path": "tokenizer_path",
    "cache_threshold": "cache_threshold",
    "balance_abs_threshold": "balance_abs_threshold",
    "balance_rel_threshold": "balance_rel_threshold",
    "decode_weight": "decode_weight",
    "health_check_interval_secs": "health_check_interval_s",
    "health_failure_threshold": "health_failure_threshold",
    "health_success_threshold": "health_success_threshold",
    "request_timeout_secs": "request_timeout_s",
    "max_retries": "max_retries",
    "prefix_ttl_secs": "prefix_ttl_s",
    "session_ttl_secs": "session_ttl_s",
    "max_concurrent_requests": "max_concurrent_requests",
    "queue_size": "queue_size",
    "queue_timeout_secs": "queue_timeout_s",
    "saturation_queued_prefill_tokens": "saturation_queued_prefill_tokens",
    "saturation_kv_usage": "saturation_kv_usage",
    "drain_timeout_secs": "drain_timeout_s",
}


def config_from_settings(**overrides) -> RouterConfig:
    """The settings' ``CONTROL_PLANE`` values, then each override that is not None."""
    cp = settings.CONTROL_PLANE
    base = RouterConfig(
        policy=cp.get("POLICY", "cache_aware"),
        cache_threshold=cp.get("CACHE_THRESHOLD", 0.3),
        balance_abs_threshold=cp.get("BALANCE_ABS_THRESHOLD", 64),
        balance_rel_threshold=cp.get("BALANCE_REL_THRESHOLD", 1.5),
        health_check_interval_s=cp.get("HEALTH_CHECK_INTERVAL_S", 10.0),
        request_timeout_s=cp.get("REQUEST_TIMEOUT_S", 600.0),
        max_concurrent_requests=cp.get("MAX_CONCURRENT_REQUESTS", 0),
        queue_size=cp.get("QUEUE_SIZE", 100),
        queue_timeout_s=cp.get("QUEUE_TIMEOUT_S", 60.0),
        saturation_queued_prefill_tokens=cp.get("SATURATION_QUEUED_PREFILL_TOKENS", 0),
        saturation_kv_usage=cp.get("SATURATION_KV_USAGE", 0.0),
        drain_timeout_s=cp.get("DRAIN_TIMEOUT_S", 25.0),
        time_check=cp.get("TIME_CHECK", True),
        tenant_limits=tuple(e for e in str(cp.get("TENANT_LIMITS", "")).split(",") if e.strip()),
        default_tenant_limit=cp.get("DEFAULT_TENANT_LIMIT") or None,
        tenant_cache_salt=cp.get("TENANT_CACHE_SALT", False),
    )
    for key, value in overrides.items():
        if value is not None:
            setattr(base, key, value)
    if base.policy not in POLICIES:
        raise ImproperlyConfigured(
            f"unknown routing policy {base.policy!r} (CONTROL_PLANE_POLICY or --policy); "
            f"choose one of {', '.join(sorted(POLICIES))}"
        )
    return base


def config_from_options(opts: dict) -> RouterConfig:
    """From ``runrouter``'s options (``add_router_arguments``)."""
    time_check = opts.get("time_check")
    pd = bool(opts.get("pd_disaggregation") or opts.get("vllm_pd_disaggregation"))
    protocol = opts.get("pd_protocol") or ("vllm" if opts.get("vllm_pd_disaggregation") else None)
    return config_from_settings(
        dp_aware=bool(opts.get("dp_aware")),
        time_check=None if time_check is None else time_check == "on",
        pd=pd or None,
        pd_protocol=protocol,
        prefill_policy=opts.get("prefill_policy"),
        decode_policy=opts.get("decode_policy"),
        tenant_limits=tuple(opts["tenant_limit"]) if opts.get("tenant_limit") else None,
        default_tenant_limit=opts.get("default_tenant_limit"),
        tenant_cache_salt=opts.get("tenant_cache_salt"),
        **{field: opts.get(option) for option, field in OPTION_FIELDS.items()},
    )
