"""What one router process is configured with: the routing knobs (SGLang's flags where they exist),
the health loop's, the admission control's and the drain's. Plain data: ``apps/routing/flags.py``
fills it from the settings and ``runrouter``'s options."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RouterConfig:
    policy: str = "cache_aware"
    dp_aware: bool = True
    tokenizer_path: str | None = None
    cache_threshold: float = 0.3  # accepted for SGLang compatibility (see docs/routing.md)
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    decode_weight: float = 16.0
    # CacheAware's choice checked against the learned time model (Router._quicker)
    time_check: bool = True
    prefix_ttl_s: float = 600.0
    session_ttl_s: float = 600.0
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 5.0
    max_retries: int = 3
    retry_backoff_s: float = 0.05
    health_check_interval_s: float = 10.0
    health_failure_threshold: int = 3
    health_success_threshold: int = 2
    stats_persist_interval_s: float = 5.0
    # admission control (apps/routing/proxy/admission.py); 0: no limit, rule off
    max_concurrent_requests: int = 0
    queue_size: int = 100
    queue_timeout_s: float = 60.0
    saturation_queued_prefill_tokens: int = 0
    saturation_kv_usage: float = 0.0
    drain_timeout_s: float = 25.0  # on SIGTERM/SIGINT (apps/routing/proxy/drain.py)
    # per-tenant rate limits (apps/routing/proxy/tenants.py): "TENANT=RPM[:TPM]" entries, and
    # "RPM[:TPM]" for every other tenant (None: only the listed ones are limited)
    tenant_limits: tuple[str, ...] = ()
    default_tenant_limit: str | None = None
    # a request without a cache_salt gets its tenant as one (Dynamo's x-tenant-id mapping): one
    # tenant's cached prefixes are never another's, in the engine and in the router's index
    tenant_cache_salt: bool = False
    # prefill/decode disaggregation (apps/routing/proxy/pd.py): each request's prefill leg goes to
    # a prefill worker's rank (``prefill_policy``, else ``policy``), its decode leg to a decode
    # worker's (``decode_policy``, else ``policy``); ``pd_protocol``: "auto" (by the workers'
    # flavours: SGLang's bootstrap for SGLang and for ours in both roles, vLLM's
    # kv_transfer_params for the rest: wire.pd_protocol), "vllm" or "sglang"
    pd: bool = False
    pd_protocol: str = "auto"
    prefill_policy: str | None = None
    decode_policy: str | None = None
