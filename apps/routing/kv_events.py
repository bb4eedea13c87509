"""Precise prefix index: follow each engine's KV events (``GET /kv_events``) into the index.

Our engine publishes, per DP rank, a snapshot of the block digests its prefix cache holds and then
every block it stores or evicts (engine/server/app.py). A router that computes the same digests
(the engine's ``prefix_digest`` scheme, from the engine's own tokenizer and block size) applies
them to its ``PrefixIndex``: a snapshot replaces the rank's set, stored blocks are inserted,
evicted ones removed. Without this the index only knows where the router sent prompts, so it
keeps predicting hits for blocks the engine evicted under memory pressure, and for a rank whose
process died.

The events lag the routing. A block the engine evicts just before a request routed there is
admitted is removed from the index while that request is about to store it again; under memory
pressure that sends its siblings elsewhere, to miss. So while a request routed to a rank has not
been prefilled (no first token yet, not ended), a removal of its digests there is deferred: it is
dropped if the engine stores the digest again, else applied ``RELEASE_TAIL_S`` after the last
such request was prefilled (its token and the engine's events travel on different connections).

One reader task per worker that offers the events; a worker without them (vLLM, SGLang, an engine
whose digests differ) stays in approximate mode. Readers reconnect with backoff, and start over
from a new snapshot when the engine restarts (its ``instance_id`` changes). The engine sends a
keep-alive comment every 10 s, so a reader that hears nothing for ``READ_TIMEOUT_S`` reconnects.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from apps.replicas.models import target_key
from apps.routing.dispatch import DispatchObserver
from apps.routing.metrics import PREFIX
from controlplane import http

logger = logging.getLogger(__name__)

READ_TIMEOUT_S = 35.0
RECONCILE_INTERVAL_S = 0.25  # also how often deferred removals are checked
RELEASE_TAIL_S = 0.5  # after the prefill: the stored event may still be on its way
MAX_DEFER_S = 30.0  # a deferred removal is applied by then, whatever happened


class KVEventsFeed(DispatchObserver):
    def __init__(self, router):
        self.router = router
        self.readers: dict[
            int, tuple[tuple, asyncio.Task]
        ] = {}  # worker id -> (what it follows, task)
        self.connected: set[int] = set()
        self.applied = 0  # messages (snapshots and event batches) applied to the index
        self.followed: set[str] = set()  # target keys whose snapshot arrived
        self.pending: dict[
            str, Counter
        ] = {}  # target key -> digest -> routed requests not yet prefilled
        # (target key, digest) -> [when its removal arrived, when its last pending request was
        # prefilled]
        self.deferred: dict[tuple[str, int], list] = {}
        self.clock = time.monotonic
        router.observers.append(self)

    def routed(self, key: str, digests: list[int]) -> None:
        """The digests of a request just routed to ``key``."""
        if key in self.followed:
            self.pending.setdefault(key, Counter()).update(digests)

    def metric_families(self):
        yield CounterMetricFamily(
            f"{PREFIX}_kv_events_applied",
            "KV event messages (snapshots and batches) from engines applied to the prefix index",
            value=self.applied,
        )
        family = GaugeMetricFamily(
            f"{PREFIX}_kv_events_connected",
            "1 while the router follows the worker's KV events",
            labels=["worker"],
        )
        for view in self.router.fleet.workers.values():
            if view.kv_events:
                family.add_metric([view.url], int(view.worker_id in self.connected))
        yield family

    def prefilled(self, key: str, digests: list[int]) -> None:
        """That request's prompt is computed (its first token arrived) or it ended."""
        pending = self.pending.get(key)
        if not pending:
            return
        now = self.clock()
        for digest in digests:
            left = pending.get(digest, 0) - 1
            if left > 0:
                pending[digest] = left
                continue
            pending.pop(digest, None)
            entry = self.deferred.get((key, digest))
            if entry is not None:
                entry[1] = now

    def flush(self, now: float | None = None) -> int:
        """Apply the deferred removals that are due: the tail after their last pending request was
        prefilled is over (the engine did not store them again), or they waited ``MAX_DEFER_S``."""
        now = self.clock() if now is None else now
        due = [
            item
            for item, (arrived, released) in self.deferred.items()
            if (released is not None and now - released >= RELEASE_TAIL_S)
            or now - arrived >= MAX_DEFER_S
        ]
        for key, digest in due:
            del self.deferred[(key, digest)]
            self.router.index.remove(key, [digest])
        return len(due)

    # ----- which workers to follow ---------------------------------------------------------------
    def wanted(self) -> dict[int, tuple]:
        return {
            view.worker_id: (view.url, view.kv_events, view.api_key, view.instance_id)
            for view in self.router.fleet.workers.values()
            if view.kv_events and view.dp_aware
        }

    def reconcile(self) -> None:
        """Start a reader for each worker that offers events, stop the others (removed, changed,
        restarted: a restarted engine's reader starts over from a new snapshot)."""
        wanted = self.wanted()
        for worker_id, (spec, task) in list(self.readers.items()):
            if wanted.get(worker_id) != spec:
                task.cancel()
                del self.readers[worker_id]
                self.connected.discard(worker_id)
        for worker_id, spec in wanted.items():
            if worker_id not in self.readers:
                self.readers[worker_id] = (
                    spec,
                    asyncio.ensure_future(self._follow(worker_id, spec)),
                )

    async def run(self) -> None:
        try:
            while True:
                self.reconcile()
                self.flush()
                await asyncio.sleep(RECONCILE_INTERVAL_S)
        finally:
            for _, task in self.readers.values():
                task.cancel()

    # ----- one worker -----------------------------------------------------------------------------
    async def _follow(self, worker_id: int, spec: tuple) -> None:
        url, path, api_key, _ = spec
        backoff = 0.5
        while True:
            try:
                await self._read(worker_id, url + path, api_key)
                backoff = (
                    0.5  # the engine ended the stream (this reader fell behind): start over now
                )
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # engine down or restarting: the health loop says so too
                logger.debug("KV events of %s: %r; reconnecting in %.1f s", url, exc, backoff)
            self.connected.discard(worker_id)
            await asyncio.sleep(backoff)
            backoff = min(10.0, backoff * 2)

    async def _read(self, worker_id: int, url: str, api_key: str) -> None:
        timeout = http.timeout(connect=5.0, read=READ_TIMEOUT_S)
        async with http.client.get().get(
            url, headers=http.auth_headers(api_key), timeout=timeout
        ) as response:
            if response.status != 200:
                raise RuntimeError(f"{url} answered {response.status}")
            self.connected.add(worker_id)
            logger.info("following the KV events of %s", url)
            buffer = b""
            async for (
                chunk
            ) in response.content.iter_any():  # a snapshot can be longer than any line limit
                buffer += chunk
                *events, buffer = buffer.split(b"\n\n")
                for event in events:
                    for line in event.split(b"\n"):
                        if line.startswith(b"data: "):
                            self.apply(worker_id, json.loads(line[len(b"data: ") :]))

    def apply(self, worker_id: int, message: dict) -> bool:
        """Apply one message of a worker's stream to the index; False when it names no target
        here."""
        view = self.router.fleet.workers.get(worker_id)
        rank = message.get("rank")
        if view is None or not isinstance(rank, int):
            return False
        key = target_key(view.url, rank)
        if not any(t.key == key for t in self.router.fleet.targets.get(worker_id, ())):
            return False
        index = self.router.index
        if "snapshot" in message:
            index.replace(key, message["snapshot"])
            self.followed.add(key)
            for item in [item for item in self.deferred if item[0] == key]:
                del self.deferred[item]
        now = self.clock()
        pending = self.pending.get(key) or {}
        for kind, digests in message.get("events") or ():
            if kind == "stored":
                index.insert(key, digests)
                for digest in digests:
                    self.deferred.pop((key, digest), None)
            elif kind == "removed":
                gone = []
                for digest in digests:
                    if pending.get(digest):  # a request routed there may be about to store it again
                        self.deferred[(key, digest)] = [now, None]
                    else:
                        gone.append(digest)
                index.remove(key, gone)
        self.applied += 1
        return True
