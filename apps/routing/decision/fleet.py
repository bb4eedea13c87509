"""The router's in-memory view of who serves: the hot path reads this, never the database.

The database (``Worker``, ``Rank``) is the durable record; apps/routing/records.py reads one row
into a ``WorkerView`` and
``Fleet.put`` turns it into routing targets: one per DP rank when the worker is dp-aware, else
one for the worker.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from apps.replicas.targets import target_key
from apps.routing.decision.circuit import CircuitBreaker
from apps.routing.decision.load import RankLoad


@dataclass
class WorkerView:
    worker_id: int
    url: str
    api_key: str
    model: str
    model_aliases: set[str]  # the names a request's ``model`` may use, its adapters' included
    dp_size: int
    dp_aware: bool
    block_size: int | None  # None: a foreign engine, no token digests
    tokenizer_path: str | None  # what the router digests its prompts with
    capacity_blocks: int | None
    # sequences each rank runs at once (the engine's max_num_seqs), when discovery knows it
    max_num_seqs: int | None = None
    # the longest prompt + output it takes, in tokens, and the largest request body, in bytes,
    # when discovery knows them (apps/routing/proxy/limits.py)
    max_model_len: int | None = None
    max_body_bytes: int | None = None
    # the engine's own tokenizer files, when readable here (None: only the router's
    # --tokenizer-path, or none): ids made with it are the ids the engine would compute
    own_tokenizer_path: str | None = None
    healthy: bool = True
    draining: bool = False
    # changes when the engine restarts (its prefix caches are then empty)
    instance_id: str | None = None
    # the engine's KV events path, when its digests are the router's own
    kv_events: str | None = None
    flavour: str = "dpmesh"  # dpmesh, atom, sglang, vllm, openai (apps/replicas/discovery.py)
    # prefill/decode disaggregation: "prefill", "decode" or None (both in one), from its
    # /server_info or its registration; a prefill worker's bootstrap port (SGLang's protocol)
    role: str | None = None
    bootstrap_port: int | None = None
    tp_size: int | None = None  # ATOM's prefill worker: its /kv_transfer_info (the decode leg)
    # per path, whether the worker serves a pinned request on that rank (apps/replicas/
    # pin_check.py; a path not checked is absent): where it does not, placement is not believed
    pin_check: dict[str, bool] = field(default_factory=dict)
    # a completion's text prompt goes to it as the router's token ids (proxy/wire.py ``ids_for``):
    # our engine, beside the text; a vLLM whose /tokenize agreed (apps/routing/feeds/prompt_ids.py)
    prompt_ids: bool = False
    # the body fields the chosen rank goes in (proxy/wire.py ``rank_fields``: by flavour/version)
    rank_fields: tuple[str, ...] = ("data_parallel_rank",)
    # LoRA adapters it serves (a request names one as its ``model``): their blocks are keyed
    # apart from the base model's and each other's (engine/digests.py ``namespace``)
    adapters: frozenset[str] = frozenset()
    # vLLM: one ZMQ endpoint per rank for its KV events (apps/routing/feeds/vllm_events.py)
    zmq_kv_events: tuple[str, ...] = ()
    # and its replay sockets, one per rank (None: that rank has none), when it has them
    zmq_replay: tuple[str | None, ...] = ()
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    # it refused connections (its process gone, or its host): when it answers again it may be
    # another process with empty caches (apps/routing/feeds/health.py)
    lost: bool = False

    def keep_live_state(self, old: WorkerView) -> None:
        """A reinstalled row's view takes over what the router has seen of the worker (the
        database row holds the last recorded health, not the live one)."""
        self.healthy, self.lost = old.healthy, old.lost
        self.consecutive_failures = old.consecutive_failures
        self.consecutive_successes = old.consecutive_successes
        if self.flavour == "vllm" and old.own_tokenizer_path == self.own_tokenizer_path:
            self.prompt_ids = old.prompt_ids  # until its /tokenize is asked again


@dataclass(eq=False)
class Target:
    """One place a request can go: ``worker`` plus, when dp-aware, the DP rank to inject."""

    worker: WorkerView
    rank: int | None
    rank_id: int | None = None  # the Rank row, for persisted stats
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    load: RankLoad = field(default_factory=RankLoad)
    # The fraction of the rank's KV cache in use as its engine last said (0..1): the scrape job
    # writes it into RankSample rows (ours: its block counts; vLLM: kv_cache_usage_perc times the
    # capacity discovery found), and FleetSync (apps/routing/feeds/fleet_sync.py) sets it here from
    # the latest one every 2 s, so it is a few seconds old. None: unknown (no sample newer than
    # fleet_sync.kv_usage_max_age_s(), the engine did not answer its last scrape, or its
    # capacity is unknown). The admission control's saturation rule reads it
    # (apps/routing/proxy/admission.py) and ignores a target whose usage is unknown.
    kv_usage: float | None = None
    key: str = field(init=False)  # ``url@rank``; read many times per routed request

    def __post_init__(self):
        self.key = target_key(self.worker.url, self.rank)

    def rebind(self, view: WorkerView) -> None:
        """The worker's row was reinstalled: the target keeps its load and breaker."""
        self.worker, self.key = view, target_key(view.url, self.rank)

    @property
    def available(self) -> bool:
        worker = self.worker
        return worker.healthy and not worker.draining and self.breaker.allows()


class Fleet:
    """Workers and their targets, by id. Mutated only on the event loop (no locks)."""

    def __init__(self):
        self.workers: dict[int, WorkerView] = {}
        self.targets: dict[int, list[Target]] = {}
        self.rng = random.Random()
        # True while the process start-up is still restoring it from the database and adding
        # the given workers (apps/routing/process.py): /health answers 503 "starting" meanwhile
        self.loading = False
        # True once the process drains before it stops (apps/routing/proxy/drain.py): /health
        # answers 503 "draining", so load balancers stop sending here
        self.draining = False
        self._all: tuple[Target, ...] | None = None  # all_targets, until the next put or remove

    def put(self, view: WorkerView, rank_ids: dict[int | None, int] | None = None) -> list[Target]:
        """Add or replace a worker. Targets that survive keep their load, breaker and position."""
        old = {t.rank: t for t in self.targets.get(view.worker_id, [])}
        ranks = list(range(view.dp_size)) if view.dp_aware else [None]
        targets = []
        for rank in ranks:
            target = old.get(rank) or Target(view, rank)
            target.rebind(view)
            target.rank_id = (rank_ids or {}).get(rank, target.rank_id)
            targets.append(target)
        self.workers[view.worker_id] = view
        self.targets[view.worker_id] = targets
        self._all = None
        return targets

    def remove(self, worker_id: int) -> None:
        self.workers.pop(worker_id, None)
        self.targets.pop(worker_id, None)
        self._all = None

    def all_targets(self) -> tuple[Target, ...]:
        """Every target, in the order workers were put (read several times per request: kept
        until the fleet changes)."""
        if self._all is None:
            self._all = tuple(t for targets in self.targets.values() for t in targets)
        return self._all

    def candidates(self, model: str | None, role: str | None = None) -> list[Target]:
        """Available targets serving ``model`` (any model when None or when only one is served);
        with ``role``, only those of workers in that prefill/decode role."""
        targets = [t for t in self.all_targets() if t.available]
        if role is not None:
            targets = [t for t in targets if t.worker.role == role]
        if not model:
            return targets
        return [t for t in targets if model in t.worker.model_aliases]

    def models(self) -> list[str]:
        return sorted({w.model for w in self.workers.values()})
