"""The router's state and its one decision: which target serves this request.

One ``Router`` per router process, built by the process start (apps/routing/process.py) and
handed to what needs it: the ASGI app puts it in each request's scope (controlplane/asgi.py), the
background loops are given it. Tests build their own.

It is also the process's ``FleetRuntime`` (apps/replicas/runtime.py): the replicas app's services
tell it when the record of who serves changes (``worker_saved`` ...), and it installs that in its
fleet and index.
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from apps.replicas.runtime import SCOPE_KEY, runtime_of
from apps.routing.dispatch import Dispatch, DispatchObserver
from apps.routing.fleet import Fleet, Target, view_of
from apps.routing.index import PrefixDemand, PrefixIndex, ServedVolume
from apps.routing.policies import POLICIES, Policy, make_policy
from apps.routing.request_shape import RequestShape, shape_request, tokenizer_or_none
from apps.routing.sessions import SessionTable
from apps.routing.stats import RouterStats

logger = logging.getLogger(__name__)


class NoTarget(Exception):
    """No available target serves the requested model."""


@dataclass
class RouterConfig:
    policy: str = "cache_aware"
    dp_aware: bool = True
    tokenizer_path: str | None = None
    cache_threshold: float = 0.3  # accepted for SGLang compatibility (see docs/routing.md)
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    decode_weight: float = 16.0
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
    # admission control (apps/routing/admission.py); 0: no limit, rule off
    max_concurrent_requests: int = 0
    queue_size: int = 100
    queue_timeout_s: float = 60.0
    saturation_queued_prefill_tokens: int = 0
    saturation_kv_usage: float = 0.0
    drain_timeout_s: float = 25.0  # on SIGTERM/SIGINT (apps/routing/drain.py)

    @classmethod
    def from_settings(cls, **overrides) -> RouterConfig:
        """The settings' ``CONTROL_PLANE`` values, then each override that is not None."""
        cp = settings.CONTROL_PLANE
        base = cls(
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

    @classmethod
    def from_options(cls, opts: dict) -> RouterConfig:
        """From ``runrouter``'s options (apps/routing/process.py ``add_router_arguments``)."""
        return cls.from_settings(
            dp_aware=bool(opts.get("dp_aware")),
            **{field: opts.get(option) for option, field in OPTION_FIELDS.items()},
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


class Router:
    def __init__(self, config: RouterConfig | None = None, rng: random.Random | None = None):
        self.config = config or RouterConfig.from_settings()
        self.rng = rng or random.Random()
        self.fleet = Fleet()
        self.index = PrefixIndex(ttl_s=self.config.prefix_ttl_s)
        self.demand = PrefixDemand()
        self.volume = ServedVolume()  # each target's prompt tokens of the last minutes
        self.sessions = SessionTable(ttl_s=self.config.session_ttl_s)
        self.stats = RouterStats()
        self.policy: Policy = self._make_policy(self.config.policy)
        # told of every decision and prefill end (apps/routing/shared_index.py, kv_events.py)
        self.observers: list[DispatchObserver] = []

    def _make_policy(self, name: str) -> Policy:
        if name == "cache_aware":
            return make_policy(name, rng=self.rng, decode_weight=self.config.decode_weight)
        return make_policy(name, rng=self.rng)

    def set_policy(self, name: str) -> None:
        """Switch the policy for the next requests (the index keeps learning either way)."""
        self.policy = self._make_policy(name)
        self.config.policy = name
        logger.info("routing policy is now %s", name)

    def sync_capacity(self) -> None:
        """Bound each target's index by its engine's KV capacity (after targets were put)."""
        for target in self.fleet.all_targets():
            self.index.set_capacity(target.key, target.worker.capacity_blocks)

    def route(
        self,
        body: dict,
        chat: bool,
        model: str | None,
        exclude: set[str] = frozenset(),
        rank: int | None = None,
        session: str | None = None,
        ids: dict[str, list[int] | None] | None = None,
    ) -> Dispatch:
        """Choose a target and commit: begin its load, insert the request's blocks into the index
        for it (the engine caches them as it prefills), tell the observers. The returned dispatch
        owns the request's end. ``rank``: only that DP rank of a worker (the client's pin);
        ``session``: the client's session id (apps/routing/sessions.py), kept on its rank;
        ``ids``: the prompt's token ids per tokenizer path, when already computed
        (``tokenizer_paths`` and request_shape.tokenize_off_loop)."""

        def allowed(t: Target) -> bool:
            return t.key not in exclude and (rank is None or t.rank == rank)

        candidates = [t for t in self.fleet.candidates(model) if allowed(t)]
        if not candidates and model and len(self.fleet.models()) == 1:
            candidates = [t for t in self.fleet.candidates(None) if allowed(t)]
        if not candidates:
            self.stats.no_target += 1
            raise NoTarget(
                f"no available worker serves model {model!r}" if model else "no available worker"
            )
        shapes, matched, shared = self._match(body, chat, candidates, ids)
        primary = shapes[candidates[0].key]
        # how hot the shared prefix is (counting this request): the policy copies only a hot one
        prefix = primary.digests[shared - 1] if 0 < shared <= len(primary.digests) else None
        self.demand.add(prefix)
        primary.prefix_share = self.demand.share(prefix) if prefix is not None else None
        primary.volume_excess = self.volume.excess([t.key for t in candidates])
        home = self.sessions.home(session, candidates) if session else None
        target = home or self.policy.choose(candidates, primary, matched, shared)
        if session:
            self.sessions.record(session, target.key, kept=home is not None)
        shape = shapes[target.key]
        predicted = (
            min(
                matched.get(target.key, 0) * primary.block_tokens // shape.block_tokens,
                shape.hittable_blocks,
            )
            * shape.block_tokens
        )
        # A session's turn: its private history is already there (it continues), or a chat request
        # with none anywhere (a conversation starts here and its next turns will follow). Counting
        # starts at once matters: a burst of new conversations is placed before any of them has a
        # second turn, and placing them by in-flight requests alone lets the rank that answers
        # fastest collect more conversations than the others.
        continues = matched.get(target.key, 0) > shared
        ticket = target.load.begin(
            shape.prompt_tokens, shape.prompt_tokens - predicted, continues or chat
        )
        self.index.insert(target.key, shape.digests)
        self.volume.add(target.key, shape.prompt_tokens)
        for observer in self.observers:
            observer.routed(target.key, shape.digests)
        self.stats.dispatched(target.key, shape.prompt_tokens, predicted)
        return Dispatch(
            target,
            shape,
            predicted,
            ticket,
            trial=target.breaker.dispatched(),
            stats=self.stats,
            observers=self.observers,
        )

    def tokenizer_paths(self, model: str | None) -> set[str]:
        """The tokenizers the candidates for ``model`` digest prompts with."""
        paths = {self.tokenizer_path_of(t) for t in self.fleet.candidates(model)}
        if not paths and model:
            paths = {self.tokenizer_path_of(t) for t in self.fleet.candidates(None)}
        return {p for p in paths if p}

    def tokenizer_path_of(self, target: Target) -> str | None:
        """The tokenizer this router digests ``target``'s prompts with (None: text digests)."""
        worker = target.worker
        if not (worker.block_size or self.config.tokenizer_path):
            return None
        return self.config.tokenizer_path or worker.tokenizer_path

    def _match(self, body: dict, chat: bool, candidates: list[Target], ids=None):
        """The request's shape for each candidate (workers may differ in tokenizer or block size:
        each is matched in its own digests), the matches in units of the first candidate's blocks,
        and the shared-prefix depth in those units."""
        groups: dict[tuple, list[Target]] = {}
        for t in candidates:
            groups.setdefault((t.worker.tokenizer_path, t.worker.block_size), []).append(t)
        shapes, matched, shared = {}, {}, 0
        unit = None
        for members in groups.values():
            shape = self._shape(body, chat, members[0], ids)
            unit = unit or shape.block_tokens
            for t in members:
                shapes[t.key] = shape
            for key, blocks in self.index.match(shape.digests, [t.key for t in members]).items():
                matched[key] = min(blocks, shape.hittable_blocks) * shape.block_tokens // unit
            shared = max(
                shared, self.index.shared_blocks(shape.digests) * shape.block_tokens // unit
            )
        return shapes, matched, shared

    def _shape(self, body: dict, chat: bool, target: Target, ids=None) -> RequestShape:
        worker = target.worker
        return shape_request(
            body,
            chat,
            self.config.tokenizer_path or worker.tokenizer_path,
            worker.block_size or (16 if self.config.tokenizer_path else None),
            ids,
        )

    # ----- the FleetRuntime the replicas app's services tell (apps/replicas/runtime.py) ----------
    @property
    def dp_aware(self) -> bool:
        return self.config.dp_aware

    def worker_saved(self, worker, rank_ids: dict[int | None, int]) -> None:
        """Serve a discovered worker's targets (a worker not discovered yet waits for the health
        loop). Targets that survive keep their load and breaker; an engine that restarted (its
        instance id changed) has empty caches, so the index forgets what it believed there."""
        if not worker.server_info:
            return
        old = self.fleet.workers.get(worker.id)
        before = {t.key for t in self.fleet.targets.get(worker.id, [])}
        view = view_of(worker, self.config.tokenizer_path)
        restarted = (
            old is not None and old.instance_id is not None and view.instance_id != old.instance_id
        )
        targets = self.fleet.put(view, rank_ids)
        # emptied (restarted), or gone (dp_size or dp-awareness changed)
        stale = before if restarted else before - {t.key for t in targets}
        for key in stale:
            self.index.remove_rank(key)
        if restarted:
            logger.info("worker %s restarted: forgetting what its ranks had cached", worker.url)
        for target in targets:
            self.index.set_capacity(target.key, target.worker.capacity_blocks)
        if view.tokenizer_path or self.config.tokenizer_path:
            warm_tokenizer(self.config.tokenizer_path or view.tokenizer_path)

    def worker_cache_lost(self, worker_id: int) -> None:
        """The worker's engine may have restarted unseen: forget what its ranks held."""
        for target in self.fleet.targets.get(worker_id, []):
            self.index.remove_rank(target.key)

    def worker_removed(self, worker_id: int) -> None:
        for target in self.fleet.targets.get(worker_id, []):
            self.index.remove_rank(target.key)
            self.volume.forget(target.key)
        self.fleet.remove(worker_id)

    def worker_draining(self, worker_id: int, draining: bool) -> None:
        view = self.fleet.workers.get(worker_id)
        if view is not None:
            view.draining = draining

    def worker_live(self, worker_id: int) -> dict | None:
        view = self.fleet.workers.get(worker_id)
        if view is None:
            return None
        targets = [
            {
                "key": t.key,
                "rank": t.rank,
                "circuit": t.breaker.state,
                "inflight_requests": t.load.requests,
                "inflight_prompt_tokens": t.load.prompt_tokens,
                "index_blocks": self.index.size(t.key),
                **{k: v for o in self.observers for k, v in o.target_state(t.key).items()},
            }
            for t in self.fleet.targets.get(worker_id, [])
        ]
        return {"health": "healthy" if view.healthy else "unhealthy", "targets": targets}


def warm_tokenizer(path: str) -> None:
    """Load a worker's tokenizer at discovery, off the event loop when there is one, so that its
    first request does not pay for it (it is cached: apps/routing/request_shape.py)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        tokenizer_or_none(path)
        return
    loop.run_in_executor(None, tokenizer_or_none, path)


def router_of(request_or_scope) -> Router:
    """The router serving a Django request (or in a Channels scope): the process put it there
    (controlplane/asgi.py)."""
    if isinstance(request_or_scope, dict):
        return request_or_scope[SCOPE_KEY]
    router = runtime_of(request_or_scope)
    if router is None:
        raise RuntimeError("this request was not served by a router process (no router in scope)")
    return router
