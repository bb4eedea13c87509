"""Several router processes, one view of the engines' prefix caches and load (with ``REDIS_URL``).

Each router process keeps its own ``PrefixIndex`` and load counters (the hot path never waits on
the network). What one process routes, it also publishes on a Redis channel:

- index inserts: the target and the request's block digests, batched. Every other process applies
  them to its own index, so a prompt routed by process A is a predicted hit when it comes back
  through process B.
- load: every ``LOAD_INTERVAL_S`` when its own in-flight counts changed (else every
  ``LOAD_HEARTBEAT_S``), a snapshot of its own load per target (requests and prompt tokens in
  flight, predicted prefill not yet done, active sessions, recent requests). The others add it to
  theirs (``RankLoad.set_peer``), so a rank that process A has filled looks busy to process B too.
  A process that stops says goodbye (``goodbye``); one that died without it stops counting when
  its snapshot is older than ``LOAD_TTL_S``. The snapshot also carries the process's own served
  volume per target (prompt tokens of the last minutes, apps/routing/decision/index.py
  ``ServedVolume``), so the cost model's volume term evens out the fleet's work, not one process's
  share of it.

Publishing never blocks routing: inserts go into a bounded queue that a background task drains;
when Redis is slow or away the queue drops the oldest entries (an index is a hint), load snapshots
are simply sent again next tick, and the subscriber reconnects with backoff.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque

import msgspec
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from apps.routing.decision.dispatch import DispatchObserver
from apps.routing.metrics import PREFIX

logger = logging.getLogger(__name__)

CHANNEL = "dpmesh:index"
MAX_PENDING = 10_000  # inserts waiting to be published; beyond it the oldest are dropped
MAX_BATCH = 256
# inserts are gathered this long into one message: one Redis command (and one message for every
# other process to parse) per batch, not per request (a hint 5 ms late is as good)
PUBLISH_EVERY_S = 0.005
LOAD_INTERVAL_S = 0.05  # how often a changed load snapshot is published
LOAD_HEARTBEAT_S = 1.0  # an unchanged one is published again this often
LOAD_TTL_S = 3.0  # a peer's snapshot older than this no longer counts
INF = float("inf")
encode = msgspec.json.encode  # every message (JSON: what the others decode, whatever their version)


class Message(msgspec.Struct):
    """A message as this version sends it, checked while it is decoded (in C, not a Python check
    a digest: the peers' inserts arrive at the rate the whole fleet routes). One that does not
    fit (another version's, or junk) is read the lenient way, item by item."""

    origin: str = msgspec.field(name="from", default="")
    inserts: list[tuple[str, list[int]]] = []
    load: dict | None = None
    bye: bool = False


decode_message = msgspec.json.Decoder(Message).decode


class IndexSync(DispatchObserver):
    def __init__(self, router, redis_url: str, channel: str = CHANNEL):
        self.router, self.redis_url, self.channel = router, redis_url, channel
        self.origin = uuid.uuid4().hex  # this process: its own messages are skipped
        self._own = encode({"from": self.origin})[:-1]  # how they begin
        self.pending: deque[tuple[str, list[int]]] = deque(maxlen=MAX_PENDING)
        self.wakeup = asyncio.Event()
        self.published = self.applied = 0
        self.load_published = self.load_applied = 0
        self.peer_seen: dict[
            str, float
        ] = {}  # other process -> when its last load snapshot arrived

    # ----- the hot path's side: never awaits ------------------------------------------------------
    def routed(self, key: str, digests: list[int]) -> None:
        if digests:
            self.pending.append((key, digests))
            self.wakeup.set()

    def metric_families(self):
        counters = [
            ("index_sync_published", "Prefix-index inserts published to the other router "
             "processes", self.published),
            ("index_sync_applied", "Prefix-index inserts received from the other router "
             "processes and applied here", self.applied),
            ("load_sync_published", "Load snapshots published to the other router processes",
             self.load_published),
            ("load_sync_applied", "Load snapshots received from the other router processes",
             self.load_applied),
        ]  # fmt: skip
        for name, help_text, value in counters:
            yield CounterMetricFamily(f"{PREFIX}_{name}", help_text, value=value)
        yield GaugeMetricFamily(
            f"{PREFIX}_peers",
            "Other router processes whose load counts here",
            value=len(self.peer_seen),
        )

    # ----- background tasks -----------------------------------------------------------------------
    def start(self) -> list[asyncio.Task]:
        self.router.observers.append(self)
        return [
            asyncio.ensure_future(self._publish_loop()),
            asyncio.ensure_future(self._subscribe_loop()),
            asyncio.ensure_future(self._load_loop()),
        ]

    async def _client(self):
        import redis.asyncio as redis

        return redis.Redis.from_url(self.redis_url)

    async def _publish_loop(self) -> None:
        client = await self._client()
        while True:
            await self.wakeup.wait()
            await asyncio.sleep(PUBLISH_EVERY_S)
            self.wakeup.clear()
            while self.pending:
                batch = same_once(
                    [self.pending.popleft() for _ in range(min(MAX_BATCH, len(self.pending)))]
                )
                message = encode({"from": self.origin, "inserts": batch})
                try:
                    await client.publish(self.channel, message)
                    self.published += len(batch)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # Redis away: drop this batch, keep routing
                    logger.warning("publishing %d index inserts failed: %s", len(batch), exc)
                    await asyncio.sleep(1.0)

    def load_snapshot(self) -> dict[str, list]:
        """This process's own load per target, where there is any (peers' load is never
        re-published)."""
        now = time.monotonic()
        out = {}
        volume = self.router.volume
        for t in self.router.fleet.all_targets():
            load = t.load
            sessions, recent = load.own_active_sessions(now), load.own_recent_requests(now)
            served = volume.own(t.key)
            if (
                load.requests
                or load.prompt_tokens
                or load.pending_prefill_tokens
                or sessions > 0.01
                or recent > 0.01
                or served >= 1
            ):
                out[t.key] = [
                    load.requests,
                    load.prompt_tokens,
                    load.pending_prefill_tokens,
                    round(sessions, 3),
                    round(recent, 3),
                    round(served),
                ]
        return out

    async def _load_loop(self) -> None:
        client = await self._client()
        last, last_at = None, 0.0
        while True:
            await asyncio.sleep(LOAD_INTERVAL_S)
            now = time.monotonic()
            self.expire_peers(now)
            snapshot = self.load_snapshot()
            counts = {key: values[:3] for key, values in snapshot.items()}
            if counts == last and now - last_at < LOAD_HEARTBEAT_S:
                continue
            try:
                await client.publish(self.channel, encode({"from": self.origin, "load": snapshot}))
                last, last_at = counts, now
                self.load_published += 1
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away: the next tick tries again
                logger.warning("publishing the load snapshot failed: %s", exc)
                await asyncio.sleep(1.0)

    async def goodbye(self, timeout: float = 1.0) -> None:
        """Tell the others this process is stopping: its load stops counting at once, not after
        ``LOAD_TTL_S`` (called on shutdown; a process that dies without it is expired)."""
        try:
            client = await self._client()
            await asyncio.wait_for(
                client.publish(
                    self.channel, encode({"from": self.origin, "load": {}, "bye": True})
                ),
                timeout,
            )
        except Exception as exc:  # Redis away: the others expire this process's load
            logger.warning("could not say goodbye to the other router processes: %s", exc)

    def expire_peers(self, now: float | None = None) -> list[str]:
        """Forget the load of processes not heard from in ``LOAD_TTL_S`` (stopped or cut off)."""
        now = time.monotonic() if now is None else now
        gone = [origin for origin, at in self.peer_seen.items() if now - at > LOAD_TTL_S]
        for origin in gone:
            del self.peer_seen[origin]
            self.router.volume.drop_peer(origin)
            for t in self.router.fleet.all_targets():
                t.load.drop_peer(origin)
        return gone

    async def _subscribe_loop(self) -> None:
        backoff = 0.5
        while True:
            try:
                client = await self._client()
                async with client.pubsub() as pubsub:
                    await pubsub.subscribe(self.channel)
                    backoff = 0.5
                    async for message in pubsub.listen():
                        if message.get("type") == "message":
                            self.apply(message["data"])
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.warning("index subscription lost (%s); reconnecting in %.1f s", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(10.0, backoff * 2)

    def apply(self, raw: bytes | str) -> int:
        """Apply another process's inserts to this index; returns how many were applied."""
        if isinstance(raw, bytes) and raw.startswith(self._own):  # its own, not parsed
            return 0
        try:
            typed = decode_message(raw)
        except msgspec.DecodeError:  # a ValidationError too: read leniently below
            typed = None
        if typed is not None and typed.load is None:
            return 0 if typed.origin == self.origin else self._apply_inserts(typed.inserts)
        try:
            message = msgspec.json.decode(raw)
        except msgspec.DecodeError:
            return 0
        if not isinstance(message, dict) or message.get("from") == self.origin:
            return 0
        if "load" in message:
            applied = self.apply_load(message["from"], message["load"])
            if message.get("bye"):
                self.peer_seen.pop(message["from"], None)
                self.router.volume.drop_peer(message["from"])
            return applied
        inserts = [
            item
            for item in message.get("inserts") or ()
            if isinstance(item, list)
            and len(item) == 2
            and isinstance(item[0], str)
            and isinstance(item[1], list)
            and all(isinstance(d, int) and not isinstance(d, bool) for d in item[1])
        ]
        return self._apply_inserts(inserts)

    def _apply_inserts(self, inserts) -> int:
        known = {t.key for t in self.router.fleet.all_targets()}  # not yet installed here: skipped
        insert, applied = self.router.index.insert, 0
        for key, digests in inserts:
            if key in known:
                insert(key, digests)
                applied += 1
        self.applied += applied
        return applied

    def apply_load(self, origin, snapshot) -> int:
        """Take another process's load snapshot: it replaces what that process published before."""
        if not isinstance(origin, str) or not isinstance(snapshot, dict):
            return 0
        self.peer_seen[origin] = time.monotonic()
        applied = 0
        volumes = {}
        for t in self.router.fleet.all_targets():
            values = snapshot.get(t.key)
            if (  # five numbers from a router before the served volume was shared, else six
                isinstance(values, list)
                and len(values) in (5, 6)
                and all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < INF
                    for v in values
                )
            ):
                requests, tokens, prefill, sessions, recent = values[:5]
                t.load.set_peer(
                    origin, int(requests), int(tokens), int(prefill), float(sessions), float(recent)
                )
                if len(values) == 6:
                    volumes[t.key] = float(values[5])
                applied += 1
            else:
                t.load.drop_peer(origin)
        self.router.volume.set_peer(origin, volumes)
        self.load_applied += 1
        return applied


def same_once(batch: list[tuple[str, list[int]]]) -> list[tuple[str, list[int]]]:
    """``batch`` with an insert that repeats the one just before it on the same target left out
    (a prompt sent again and again): applying it twice in a row changes nothing (the index's
    ``insert``)."""
    out: list[tuple[str, list[int]]] = []
    latest: dict[str, list[int]] = {}
    for key, digests in batch:
        if latest.get(key) != digests:
            out.append((key, digests))
            latest[key] = digests
    return out
