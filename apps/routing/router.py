"""The router's state and its one decision: which target serves this request.

One ``Router`` per process, created by ``runrouter`` / ``serve`` (``configure``) or lazily with
the settings' defaults; tests build their own and install it with ``set_router``.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field

from django.conf import settings

from apps.replicas.fleet import Fleet, Target
from apps.routing.digests import RequestShape, shape_request
from apps.routing.index import PrefixIndex
from apps.routing.load import LoadTicket
from apps.routing.policies import Policy, make_policy
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
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 5.0
    max_retries: int = 3
    retry_backoff_s: float = 0.05
    health_check_interval_s: float = 10.0
    health_failure_threshold: int = 3
    health_success_threshold: int = 2
    stats_persist_interval_s: float = 5.0

    @classmethod
    def from_settings(cls, **overrides) -> RouterConfig:
        cp = settings.CONTROL_PLANE
        base = cls(
            policy=cp.get("POLICY", "cache_aware"),
            cache_threshold=cp.get("CACHE_THRESHOLD", 0.3),
            balance_abs_threshold=cp.get("BALANCE_ABS_THRESHOLD", 64),
            balance_rel_threshold=cp.get("BALANCE_REL_THRESHOLD", 1.5),
            health_check_interval_s=cp.get("HEALTH_CHECK_INTERVAL_S", 10.0),
            request_timeout_s=cp.get("REQUEST_TIMEOUT_S", 600.0),
        )
        for key, value in overrides.items():
            if value is not None:
                setattr(base, key, value)
        return base


@dataclass
class Routed:
    """A dispatched request: where it went, what the index predicted, and its load ticket."""

    target: Target
    shape: RequestShape
    predicted_tokens: int
    ticket: LoadTicket
    finished: bool = field(default=False)
    started: float = field(default_factory=time.perf_counter)
    first_token_seen: bool = field(default=False)
    trial: bool = field(default=False)  # the half-open circuit's one trial request
    prefilled: bool = field(default=False)  # its first token arrived, or it ended


class Router:
    def __init__(self, config: RouterConfig | None = None, rng: random.Random | None = None):
        self.config = config or RouterConfig.from_settings()
        self.rng = rng or random.Random()
        self.fleet = Fleet()
        self.index = PrefixIndex(ttl_s=self.config.prefix_ttl_s)
        self.stats = RouterStats()
        self.policy: Policy = self._make_policy(self.config.policy)
        self.db_fingerprints: dict[
            int, tuple
        ] = {}  # worker id -> what was installed (background.sync_fleet)
        self.index_listeners: list = []  # called with (target key, digests) after each routed insert
        self.index_sync = (
            None  # apps.routing.shared_index.IndexSync when several processes share (REDIS_URL)
        )
        self.kv_feed = (
            None  # apps.routing.kv_events.KVEventsFeed: engines' KV events into the index
        )
        self.background_tasks: list = []  # the process's loops (apps/replicas/serving.py startup)
        self.persisted: dict[
            str, dict[str, int]
        ] = {}  # target key -> counters in the database (persist.py)
        # True from process start until startup() has restored the fleet, added the given workers and
        # adopted the recorded policy (apps/replicas/serving.py): /health answers 503 meanwhile
        self.starting = False

    def _make_policy(self, name: str) -> Policy:
        if name == "cache_aware":
            return make_policy(name, rng=self.rng, decode_weight=self.config.decode_weight)
        policy = make_policy(name)
        policy.rng = self.rng
        return policy

    def set_policy(self, name: str) -> None:
        """Switch the policy for the next requests (the index keeps learning either way)."""
        self.policy = self._make_policy(name)
        self.config.policy = name
        logger.info("routing policy is now %s", name)

    def sync_capacity(self) -> None:
        for target in self.fleet.all_targets():
            self.index.set_capacity(target.key, target.worker.capacity_blocks)

    def route(
        self, body: dict, chat: bool, model: str | None, exclude: set[str] = frozenset()
    ) -> Routed:
        """Choose a target and commit: begin its load, and insert the request's blocks into the
        index for it (the engine caches them as it prefills)."""
        candidates = [t for t in self.fleet.candidates(model) if t.key not in exclude]
        if not candidates and model and len(self.fleet.models()) == 1:
            candidates = [t for t in self.fleet.candidates(None) if t.key not in exclude]
        if not candidates:
            raise NoTarget(
                f"no available worker serves model {model!r}" if model else "no available worker"
            )
        shapes, matched, shared = self._match(body, chat, candidates)
        primary = shapes[candidates[0].key]
        target = self.policy.choose(candidates, primary, matched, shared)
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
        for listener in self.index_listeners:
            listener(target.key, shape.digests)
        self.stats.dispatched(target.key, shape.prompt_tokens, predicted)
        return Routed(target, shape, predicted, ticket, trial=target.breaker.dispatched())

    def _match(self, body: dict, chat: bool, candidates: list[Target]):
        """The request's shape for each candidate (workers may differ in tokenizer or block size:
        each is matched in its own digests), the matches in units of the first candidate's blocks,
        and the shared-prefix depth in those units."""
        groups: dict[tuple, list[Target]] = {}
        for t in candidates:
            groups.setdefault((t.worker.tokenizer_path, t.worker.block_size), []).append(t)
        shapes, matched, shared = {}, {}, 0
        unit = None
        for members in groups.values():
            shape = self._shape(body, chat, members[0])
            unit = unit or shape.block_tokens
            for t in members:
                shapes[t.key] = shape
            for key, blocks in self.index.match(shape.digests, [t.key for t in members]).items():
                matched[key] = min(blocks, shape.hittable_blocks) * shape.block_tokens // unit
            shared = max(
                shared, self.index.shared_blocks(shape.digests) * shape.block_tokens // unit
            )
        return shapes, matched, shared

    def _shape(self, body: dict, chat: bool, target: Target) -> RequestShape:
        worker = target.worker
        return shape_request(
            body,
            chat,
            self.config.tokenizer_path or worker.tokenizer_path,
            worker.block_size or (16 if self.config.tokenizer_path else None),
        )

    def _prefilled(self, routed: Routed) -> None:
        """The engine has computed (or given up on) the request's prompt: tell the KV-event
        feed, which keeps blocks routed there but not yet stored from being evicted in the index."""
        if not routed.prefilled:
            routed.prefilled = True
            if self.kv_feed is not None:
                self.kv_feed.prefilled(routed.target.key, routed.shape.digests)

    def first_token(self, routed: Routed) -> None:
        self._prefilled(routed)
        routed.target.load.first_token(routed.ticket)
        if not routed.first_token_seen:
            routed.first_token_seen = True
            self.stats.ttft.observe(time.perf_counter() - routed.started)

    def finish(
        self, routed: Routed, *, ok: bool, usage: dict | None = None, aborted: bool = False
    ) -> None:
        """End the request's load (idempotent) and record what the engine reported; ``aborted``:
        the client left first (counted apart from the target's errors)."""
        if routed.finished:
            return
        routed.finished = True
        self._prefilled(routed)
        routed.target.load.end(routed.ticket)
        self.stats.latency.observe(time.perf_counter() - routed.started)
        if ok:
            routed.target.breaker.record_success()
        if routed.trial:
            routed.target.breaker.trial_done()
        cached = None
        if usage:
            details = usage.get("prompt_tokens_details") or {}
            cached = details.get("cached_tokens")
        self.stats.finished(
            routed.target.key, ok=ok, cached_tokens=cached, aborted=aborted and not ok
        )


_router: Router | None = None


def get_router() -> Router:
    global _router
    if _router is None:
        _router = Router()
    return _router


def set_router(router: Router | None) -> Router | None:
    """Install ``router`` as the process's router (tests, management commands)."""
    global _router
    _router = router
    return router
