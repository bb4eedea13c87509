"""Per-tenant rate limits: requests and tokens a minute, per router process.

A request's tenant is its ``X-Tenant-Id`` header, else the API key it carries (``Authorization:
Bearer KEY``, named ``key-`` and 12 hex digits of its SHA-256: ``key_tenant``), else none (the
anonymous tenant, ``-``). ``--tenant-limit TENANT=RPM[:TPM]``
(repeatable; ``CONTROL_PLANE_TENANT_LIMITS``, comma-separated) sets a tenant's limits and
``--default-tenant-limit RPM[:TPM]`` (``CONTROL_PLANE_DEFAULT_TENANT_LIMIT``) every other
tenant's; without either nothing is limited. 0 means no limit on that count.

Each tenant has two token buckets, as OpenAI meters its own API: requests (``RPM`` a minute,
a burst of ``RPM``) and tokens (``TPM`` a minute). A request takes one from the first at arrival;
its tokens (the engine's usage: prompt plus completion) are taken from the second when it ends,
so a tenant whose bucket went negative waits until it refills. A request that finds either empty
is answered 429 at once, before admission, in OpenAI's rate-limit shape (``type`` ``requests``
or ``tokens``, ``code`` ``rate_limit_exceeded``) with ``Retry-After`` and OpenAI's
``x-ratelimit-*`` headers: it has cost nothing and lost nothing. The others are served as
before. With several router processes each keeps its own buckets: a tenant's limit is per
process (docs/operations.md).
"""

from __future__ import annotations

import contextvars
import hashlib
import math
import time
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily

from apps.routing.decision.dispatch import DispatchObserver
from apps.routing.metrics import PREFIX
from controlplane.errors import error_bytes

ANONYMOUS = "-"
TENANT_HEADER = b"x-tenant-id"


@dataclass(frozen=True)
class Limit:
    rpm: float = 0.0  # 0: no limit
    tpm: float = 0.0


def parse_limit(text: str) -> Limit:
    """``RPM[:TPM]`` -> Limit (ValueError naming what is wrong)."""
    parts = text.strip().split(":")
    if len(parts) > 2 or not all(p.strip() for p in parts):
        raise ValueError(f"a tenant limit is RPM[:TPM], got {text!r}")
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"a tenant limit is RPM[:TPM] (numbers), got {text!r}") from None
    if any(v < 0 or not math.isfinite(v) for v in values):
        raise ValueError(f"a tenant limit must be >= 0, got {text!r}")
    return Limit(*values)


def parse_tenant_limits(entries) -> dict[str, Limit]:
    """``["TENANT=RPM[:TPM]", ...]`` (or one comma-separated string) -> {tenant: Limit}."""
    if isinstance(entries, str):
        entries = [e for e in entries.split(",") if e.strip()]
    out = {}
    for entry in entries or ():
        tenant, sep, limit = entry.partition("=")
        if not sep or not tenant.strip():
            raise ValueError(f"a tenant limit is TENANT=RPM[:TPM], got {entry!r}")
        out[tenant.strip()] = parse_limit(limit)
    return out


# what the request being served spends is charged to (set by the endpoint; read where its answer
# ends, proxy/upstream.py ``_attempt``, in whatever task a leg runs)
USAGE_SINK: contextvars.ContextVar = contextvars.ContextVar("usage_sink", default=None)


def charge(usage: dict | None) -> None:
    """An answer's usage, charged to the tenant of the request being served (if limited)."""
    sink = USAGE_SINK.get()
    if sink is not None and isinstance(usage, dict):
        tokens = usage.get("total_tokens")
        if not isinstance(tokens, int):
            tokens = sum(v for k in ("prompt_tokens", "completion_tokens")
                         if isinstance(v := usage.get(k), int))  # fmt: skip
        sink(tokens)


class RateLimited(Exception):
    def __init__(self, tenant: str, kind: str, limit: float, retry_after_s: float):
        super().__init__(
            f"Rate limit reached for tenant {tenant!r} on {kind} per minute: limit {limit:g}. "
            f"Please try again in {retry_after_s:.1f}s."
        )
        self.kind, self.limit, self.retry_after_s = kind, limit, retry_after_s

    status = 429

    def body(self) -> bytes:
        return error_bytes(429, str(self), self.kind, code="rate_limit_exceeded")

    def headers(self) -> list[tuple[bytes, bytes]]:
        reset = f"{self.retry_after_s:.3f}s".encode()
        return [
            (b"retry-after", str(max(1, math.ceil(self.retry_after_s))).encode()),
            (f"x-ratelimit-limit-{self.kind}".encode(), f"{self.limit:g}".encode()),
            (f"x-ratelimit-remaining-{self.kind}".encode(), b"0"),
            (f"x-ratelimit-reset-{self.kind}".encode(), reset),
        ]


@dataclass
class _Bucket:
    per_minute: float
    level: float
    at: float

    def refill(self, now: float) -> None:
        self.level = min(self.per_minute, self.level + (now - self.at) * self.per_minute / 60.0)
        self.at = now

    def wait_s(self, need: float) -> float:
        """Seconds until the bucket holds ``need``."""
        return max(0.0, (need - self.level) * 60.0 / self.per_minute)


@dataclass
class _Tenant:
    requests: _Bucket | None
    tokens: _Bucket | None
    limited: dict = field(default_factory=lambda: {"requests": 0, "tokens": 0})


class TenantLimits(DispatchObserver):
    """The buckets of one router process. Lives on the event loop (no locks). An observer of the
    router's only for its /metrics family (``attach``)."""

    def __init__(self, limits: dict[str, Limit] | None = None, default: Limit | None = None,
                 clock=time.monotonic):  # fmt: skip
        self.limits = dict(limits or {})
        self.default = default
        self.clock = clock
        self.tenants: dict[str, _Tenant] = {}
        self.limited: dict[tuple[str, str], int] = {}  # (tenant, kind) -> 429s, for /metrics

    @property
    def active(self) -> bool:
        return bool(self.limits) or self.default is not None

    def _tenant(self, name: str) -> _Tenant | None:
        tenant = self.tenants.get(name)
        if tenant is None:
            limit = self.limits.get(name, self.default)
            if limit is None:
                return None
            now = self.clock()
            tenant = _Tenant(
                _Bucket(limit.rpm, limit.rpm, now) if limit.rpm else None,
                _Bucket(limit.tpm, limit.tpm, now) if limit.tpm else None,
            )
            self.tenants[name] = tenant
        return tenant

    def admit(self, name: str) -> None:
        """Take one request from ``name``'s bucket, or raise RateLimited (nothing taken)."""
        tenant = self._tenant(name)
        if tenant is None:
            return
        now = self.clock()
        for kind, bucket, need in (
            ("tokens", tenant.tokens, 1e-9),
            ("requests", tenant.requests, 1.0),
        ):
            if bucket is None:
                continue
            bucket.refill(now)
            if bucket.level < need:
                self.limited[(name, kind)] = self.limited.get((name, kind), 0) + 1
                raise RateLimited(name, kind, bucket.per_minute, bucket.wait_s(need))
        if tenant.requests is not None:
            tenant.requests.level -= 1.0

    def attach(self, router) -> None:
        """Count on the router's /metrics (``dpmesh_router_tenant_rate_limited_total``)."""
        if self.active and self not in router.observers:
            router.observers.append(self)

    def routed(self, key: str, digests: list[int]) -> None:
        pass

    def metric_families(self):
        family = CounterMetricFamily(
            f"{PREFIX}_tenant_rate_limited",
            "Requests answered 429 by a tenant's rate limit, by tenant and by the count it hit",
            labels=["tenant", "kind"],
        )
        for (tenant, kind), count in sorted(self.limited.items()):
            family.add_metric([tenant, kind], count)
        yield family

    def spent(self, name: str, tokens: int) -> None:
        """A request of ``name`` ended having used ``tokens`` (its usage): charge them."""
        tenant = self.tenants.get(name)
        if tenant is not None and tenant.tokens is not None and tokens > 0:
            tenant.tokens.refill(self.clock())
            tenant.tokens.level -= tokens


def key_tenant(key: str) -> str:
    """The tenant an API key names: ``key-`` and the first 12 hex digits of its SHA-256 (what
    ``--tenant-limit`` and ``/metrics`` call it: the key itself never appears)."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


def tenant_of(scope) -> str:
    """``X-Tenant-Id``, else the Bearer key's tenant (``key_tenant``), else the anonymous one."""
    key = None
    for name, value in scope.get("headers") or ():
        lower = name.lower()
        if lower == TENANT_HEADER:
            text = value.decode("latin-1").strip()
            if text:
                return text
        elif lower == b"authorization":
            text = value.decode("latin-1").strip()
            if text.lower().startswith("bearer "):
                key = text[7:].strip() or None
    return key_tenant(key) if key else ANONYMOUS


def from_config(config) -> TenantLimits:
    """The process's limits from its ``RouterConfig`` (ValueError for a malformed entry)."""
    default = config.default_tenant_limit
    return TenantLimits(
        parse_tenant_limits(list(config.tenant_limits)),
        parse_limit(default) if default else None,
    )
