"""Per-tenant rate limits (apps/routing/proxy/tenants.py) on a hand-moved clock: requests and
tokens a minute as token buckets, who the tenant is, what a refusal says."""

from __future__ import annotations

import json

import pytest

from apps.routing.proxy import tenants
from apps.routing.proxy.tenants import Limit, RateLimited, TenantLimits
from tests.routing.helpers import Clock


def scope(**headers) -> dict:
    return {"headers": [(k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()]}


def test_the_tenant_is_the_header_else_the_keys_hash_else_anonymous():
    assert tenants.tenant_of(scope(x_tenant_id="acme", authorization="Bearer k1")) == "acme"
    keyed = tenants.tenant_of(scope(authorization="Bearer sk-secret"))
    assert keyed == tenants.key_tenant("sk-secret") and "secret" not in keyed
    assert keyed.startswith("key-") and len(keyed) == 16
    assert tenants.tenant_of(scope()) == tenants.ANONYMOUS


def test_a_tenants_requests_a_minute_refill_and_others_are_untouched():
    clock = Clock()
    limits = TenantLimits({"small": Limit(rpm=2)}, clock=clock)
    limits.admit("small")
    limits.admit("small")
    with pytest.raises(RateLimited) as refused:
        limits.admit("small")
    assert refused.value.kind == "requests" and refused.value.retry_after_s == pytest.approx(30)
    headers = dict(refused.value.headers())
    assert headers[b"retry-after"] == b"30" and headers[b"x-ratelimit-limit-requests"] == b"2"
    error = json.loads(refused.value.body())["error"]
    assert (error["type"], error["code"]) == ("requests", "rate_limit_exceeded")
    for _ in range(10):
        limits.admit("anyone else")  # no default limit: not limited
    clock.now += 30  # one request's worth refilled
    limits.admit("small")
    with pytest.raises(RateLimited):
        limits.admit("small")
    assert limits.limited == {("small", "requests"): 2}


def test_tokens_are_charged_when_spent_and_refused_while_in_debt():
    clock = Clock()
    limits = TenantLimits(default=Limit(rpm=0, tpm=600), clock=clock)
    limits.admit("t")
    limits.spent("t", 900)  # one answer overspent: in debt by 300 tokens
    with pytest.raises(RateLimited) as refused:
        limits.admit("t")
    assert refused.value.kind == "tokens" and refused.value.retry_after_s == pytest.approx(30)
    clock.now += 31
    limits.admit("t")


def test_a_limit_is_rpm_colon_tpm():
    assert tenants.parse_tenant_limits("a=60, b=10:5000") == {
        "a": Limit(60, 0), "b": Limit(10, 5000)}  # fmt: skip
    for bad in ("a", "=5", "a=x", "a=1:2:3", "a=-1", "a=inf"):
        with pytest.raises(ValueError):
            tenants.parse_tenant_limits([bad])


def test_an_answers_usage_is_charged_to_the_request_being_served():
    limits = TenantLimits({"t": Limit(tpm=100)}, clock=Clock())
    limits.admit("t")
    token = tenants.USAGE_SINK.set(lambda n: limits.spent("t", n))
    try:
        tenants.charge({"prompt_tokens": 30, "completion_tokens": 5, "total_tokens": 35})
    finally:
        tenants.USAGE_SINK.reset(token)
    assert limits.tenants["t"].tokens.level == pytest.approx(65)
    tenants.charge({"total_tokens": 10})  # no request being served: nothing charged
