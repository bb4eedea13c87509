"""The router's in-memory view of who serves: the hot path reads this, never the database.

The database (``Worker``, ``Rank``) is the durable record; ``view_of`` reads one row and
``Fleet.put`` turns it into routing targets: one per DP rank when the worker is dp-aware, else
one for the worker.
"""

from __future__ import annotations

import os
import random
import re
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from apps.replicas.discovery import effective_info
from apps.replicas.models import target_key
from apps.routing.circuit import CircuitBreaker
from apps.routing.load import RankLoad
from engine.digests import SCHEME


@dataclass
class WorkerView:
    worker_id: int
    url: str
    api_key: str
    model: str
    model_aliases: set[str]
    dp_size: int
    dp_aware: bool
    block_size: int | None  # None: a foreign engine, no token digests
    tokenizer_path: str | None
    capacity_blocks: int | None
    # sequences each rank runs at once (the engine's max_num_seqs), when discovery knows it
    max_num_seqs: int | None = None
    healthy: bool = True
    draining: bool = False
    # changes when the engine restarts (its prefix caches are then empty)
    instance_id: str | None = None
    # the engine's KV events path, when its digests are the router's own
    kv_events: str | None = None
    flavour: str = "dpmesh"  # dpmesh, atom, sglang, vllm, openai (apps/replicas/discovery.py)
    # vLLM: one ZMQ endpoint per rank for its KV events (apps/routing/vllm_events.py)
    zmq_kv_events: tuple[str, ...] = ()
    # and its replay sockets, one per rank (None: that rank has none), when it has them
    zmq_replay: tuple[str | None, ...] = ()
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    # it refused connections (its process gone, or its host): when it answers again it may be
    # another process with empty caches (apps/routing/health.py)
    lost: bool = False

    def keep_live_state(self, old: WorkerView) -> None:
        """A reinstalled row's view takes over what the router has seen of the worker (the
        database row holds the last recorded health, not the live one)."""
        self.healthy, self.lost = old.healthy, old.lost
        self.consecutive_failures = old.consecutive_failures
        self.consecutive_successes = old.consecutive_successes


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
    # capacity discovery found), and FleetSync (apps/routing/fleet_sync.py) sets it here from the
    # latest one every 2 s, so it is a few seconds old. None: unknown (no sample newer than
    # fleet_sync.kv_usage_max_age_s(), the engine did not answer its last scrape, or its
    # capacity is unknown). The admission control's saturation rule reads it
    # (apps/routing/admission.py) and ignores a target whose usage is unknown.
    kv_usage: float | None = None
    key: str = field(init=False)  # ``url@rank``; read many times per routed request

    def __post_init__(self):
        self.key = target_key(self.worker.url, self.rank)

    def rebind(self, view: WorkerView) -> None:
        """The worker's row was reinstalled: the target keeps its load and breaker."""
        self.worker, self.key = view, target_key(view.url, self.rank)

    @property
    def available(self) -> bool:
        return self.worker.healthy and not self.worker.draining and self.breaker.allows()


class Fleet:
    """Workers and their targets, by id. Mutated only on the event loop (no locks)."""

    def __init__(self):
        self.workers: dict[int, WorkerView] = {}
        self.targets: dict[int, list[Target]] = {}
        self.rng = random.Random()
        # True while the process start-up is still restoring it from the database and adding
        # the given workers (apps/routing/process.py): /health answers 503 "starting" meanwhile
        self.loading = False
        # True once the process drains before it stops (apps/routing/drain.py): /health answers
        # 503 "draining", so load balancers stop sending here
        self.draining = False

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
        return targets

    def remove(self, worker_id: int) -> None:
        self.workers.pop(worker_id, None)
        self.targets.pop(worker_id, None)

    def all_targets(self) -> list[Target]:
        return [t for targets in self.targets.values() for t in targets]

    def candidates(self, model: str | None) -> list[Target]:
        """Available targets serving ``model`` (any model when None or when only one is served)."""
        targets = [t for t in self.all_targets() if t.available]
        if not model:
            return targets
        return [t for t in targets if model in t.worker.model_aliases]

    def models(self) -> list[str]:
        return sorted({w.model for w in self.workers.values()})

    def by_url(self, url: str) -> WorkerView | None:
        url = url.rstrip("/")
        return next((w for w in self.workers.values() if w.url == url), None)


def view_of(worker, tokenizer_path: str | None = None) -> WorkerView:
    """A routing view of a ``Worker`` row. Token digests need the engine's block size and a
    tokenizer this host can load: the worker's own model path, or ``tokenizer_path``."""
    info = effective_info(worker.server_info, worker.overrides)
    path = tokenizer_path or info.get("tokenizer_path") or info.get("model_path")
    if path and not os.path.isdir(path):
        path = None
    block = info.get("block_size") or info.get("page_size")
    ours = path and block and info.get("prefix_digest") == SCHEME
    aliases = {a for a in (worker.served_model_name, worker.model_id, info.get("model_path")) if a}
    return WorkerView(
        worker_id=worker.id,
        url=worker.url.rstrip("/"),
        api_key=worker.api_key,
        model=worker.model_name,
        model_aliases=aliases,
        dp_size=worker.dp_size,
        dp_aware=worker.dp_aware,
        block_size=block if path else None,
        tokenizer_path=path,
        capacity_blocks=info.get("num_kv_blocks_per_rank"),
        max_num_seqs=_positive_int(info.get("max_num_seqs")),
        draining=worker.draining,
        instance_id=info.get("instance_id"),
        kv_events=info.get("kv_events") if ours else None,
        flavour=info.get("flavour") or "dpmesh",
        zmq_kv_events=zmq_endpoints(worker.url, info) if path and block else (),
        zmq_replay=zmq_replay_endpoints(worker.url, info, worker.dp_size) if path and block else (),
        healthy=worker.health != worker.Health.UNHEALTHY,
    )


def _positive_int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def zmq_endpoints(url: str, info: dict) -> tuple[str, ...]:
    """A vLLM worker's KV-event publishers, one per rank: the registration's ``kv_events`` (one
    endpoint per rank, or the first rank's, the others on the next ports, as vLLM binds them),
    else what its ``/kv_event_sources`` says. Wildcard hosts are the worker's own host."""
    if info.get("flavour") != "vllm":
        return ()
    given = info.get("kv_events")
    dp_size = info.get("dp_size") or 1
    if isinstance(given, list):
        endpoints = list(given)
    elif isinstance(given, str) and given.startswith("tcp://"):
        endpoints = [given]
    else:
        endpoints = _from_sources(info.get("kv_event_sources"))
    if len(endpoints) == 1 and dp_size > 1:  # base port + rank
        host, _, port = endpoints[0].rpartition(":")
        if port.isdigit():
            endpoints = [f"{host}:{int(port) + r}" for r in range(dp_size)]
    return tuple(_own_host(url, e) for e in endpoints)


def zmq_replay_endpoints(url: str, info: dict, dp_size: int) -> tuple[str | None, ...]:
    """A vLLM worker's replay sockets (its ``replay_endpoint``, one per rank), when it has them:
    what ``/kv_event_sources`` says, ranks without one as None."""
    if info.get("flavour") != "vllm":
        return ()
    sources = info.get("kv_event_sources")
    by_rank = sources if isinstance(sources, dict) else {}
    found = []
    for rank in range(dp_size):
        config = by_rank.get(str(rank), by_rank.get(rank))
        replay = config.get("replay_endpoint") if isinstance(config, dict) else None
        found.append(_own_host(url, replay) if isinstance(replay, str) else None)
    return tuple(found) if any(found) else ()


def _own_host(url: str, endpoint: str) -> str:
    worker_host = urlsplit(url).hostname or "127.0.0.1"
    return re.sub(r"tcp://(\*|0\.0\.0\.0)", f"tcp://{worker_host}", endpoint)


def _from_sources(sources) -> list[str]:
    """Publisher endpoints out of vLLM's ``/kv_event_sources`` answer (per rank, its
    KVEventsConfig: the ``endpoint`` field, not the ``replay_endpoint``), whatever its nesting."""
    found: list[str] = []

    def walk(value):
        if isinstance(value, str) and value.startswith("tcp://"):
            found.append(value)
        elif isinstance(value, dict) and "endpoint" in value:
            walk(value["endpoint"])
        elif isinstance(value, dict):  # by rank: "0", "1", ... "10"
            for key in sorted(
                value,
                key=lambda k: (not str(k).isdigit(), int(k) if str(k).isdigit() else 0, str(k)),
            ):
                walk(value[key])
        elif isinstance(value, list):
            for item in value:
                walk(item)

    walk(sources)
    return list(dict.fromkeys(found))
