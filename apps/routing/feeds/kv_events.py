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
import functools
import json
import logging
import time
from collections import Counter

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from apps.replicas.targets import target_key
from apps.routing.decision.dispatch import DispatchObserver
from apps.routing.feeds import vllm_events
from apps.routing.feeds.vllm_events import RankDecoder
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
        self.followed: set[str] = set()  # target keys whose events arrived
        self.decoders: dict[str, RankDecoder] = {}  # vLLM targets: engine hashes -> digests
        self.gaps: dict[str, int] = {}  # vLLM targets: how often messages were lost
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
        decoder = self.decoders.get(key)
        if decoder is not None:  # a vLLM rank: what the router sent, to check the events against
            decoder.routed(digests)

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
            if view.kv_events or view.zmq_kv_events:
                family.add_metric([view.url], int(view.worker_id in self.connected))
        yield family
        precise = GaugeMetricFamily(
            f"{PREFIX}_kv_events_precise",
            "1 while the target's prefix index follows its engine's KV events (precise mode); "
            "0: approximate (the router's own decisions only)",
            labels=["target"],
        )
        mismatch = GaugeMetricFamily(
            f"{PREFIX}_kv_events_mismatch",
            "1 when the engine's KV events cannot match the router's digests (block size, "
            "tokenizer): the reason is the label",
            labels=["target", "reason"],
        )
        for target in self.router.fleet.all_targets():
            if not (target.worker.kv_events or target.worker.zmq_kv_events):
                continue
            state = self.target_state(target.key)
            precise.add_metric([target.key], int(state["precise"]))
            if state.get("kv_events_mismatch"):
                mismatch.add_metric([target.key, state["kv_events_mismatch"]], 1)
        yield precise
        yield mismatch

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
        """What to follow, per worker: our engine's SSE stream, or a vLLM's ZMQ publishers."""
        out = {}
        for view in self.router.fleet.workers.values():
            if not view.dp_aware:
                continue
            if view.kv_events:  # (url, path, key, instance): a restart starts a new reader
                out[view.worker_id] = (view.url, view.kv_events, view.api_key, view.instance_id)
            elif view.zmq_kv_events:
                out[view.worker_id] = (
                    "zmq", view.url, view.zmq_kv_events, view.block_size, view.zmq_replay
                )  # fmt: skip
        return out

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
        if spec[0] == "zmq":
            return await self._follow_vllm(worker_id, *spec[1:])
        url, path, api_key, _ = spec
        backoff = 0.5
        while True:
            try:
                await self._read(worker_id, url + path, api_key)
                # the engine ended the stream (this reader fell behind): start over now
                backoff = 0.5
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
            # a snapshot can be longer than any line limit
            async for chunk in response.content.iter_any():
                buffer += chunk
                *events, buffer = buffer.split(b"\n\n")
                for event in events:
                    for line in event.split(b"\n"):
                        if line.startswith(b"data: "):
                            self.apply(worker_id, json.loads(line[len(b"data: ") :]))

    async def _follow_vllm(
        self, worker_id: int, url: str, endpoints: tuple, block_size, replay: tuple = ()
    ) -> None:
        """One ZMQ reader per rank (vLLM binds one publisher per rank: base port + rank), with
        the rank's replay socket when it has one."""
        readers = []
        for rank, endpoint in enumerate(endpoints):
            key = target_key(url, rank)
            decoder = self.decoders[key] = RankDecoder(block_size)
            handler = functools.partial(self._on_vllm_message, worker_id, key, decoder)
            replay_at = replay[rank] if rank < len(replay) else None
            readers.append(
                asyncio.ensure_future(vllm_events.follow(endpoint, handler, replay=replay_at))
            )
        self.connected.add(worker_id)
        try:
            await asyncio.gather(*readers)
        finally:
            for reader in readers:
                reader.cancel()
            self.connected.discard(worker_id)

    def _on_vllm_message(self, worker_id: int, key: str, decoder: RankDecoder, seq, payload):
        if not any(t.key == key for t in self.router.fleet.targets.get(worker_id, ())):
            return
        batch = decoder.decode(seq, payload)
        if batch.gap:  # messages were lost: what they removed is still in the index
            self.gaps[key] = self.gaps.get(key, 0) + 1
            logger.warning("KV events of %s: messages lost before seq %d", key, seq)
        stored = [d for kind, digests in batch.events if kind == "stored" for d in digests]
        if stored:
            decoder.check_language(stored)
        self.apply_events(key, batch.events, snapshot=[] if batch.cleared else None)

    def apply(self, worker_id: int, message: dict) -> bool:
        """Apply one message of our engine's stream to the index; False when it names no
        target here."""
        view = self.router.fleet.workers.get(worker_id)
        rank = message.get("rank")
        if view is None or not isinstance(rank, int):
            return False
        key = target_key(view.url, rank)
        if not any(t.key == key for t in self.router.fleet.targets.get(worker_id, ())):
            return False
        self.apply_events(key, message.get("events") or (), snapshot=message.get("snapshot"))
        return True

    def apply_events(self, key: str, events, snapshot: list[int] | None = None) -> None:
        """A rank's cache changes, in the router's digests: ``snapshot`` (all it holds now)
        replaces the rank's set; stored blocks are inserted; removed ones removed, unless a
        request routed there is about to store them again (deferred, see the module's doc)."""
        index = self.router.index
        self.followed.add(key)
        if snapshot is not None:
            index.replace(key, snapshot)
            for item in [item for item in self.deferred if item[0] == key]:
                del self.deferred[item]
        now = self.clock()
        pending = self.pending.get(key) or {}
        for kind, digests in events:
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

    def target_state(self, key: str) -> dict:
        """For /workers: whether the index of ``key`` follows the engine's events, and why not."""
        decoder = self.decoders.get(key)
        state = {"precise": key in self.followed and not (decoder and decoder.mismatch)}
        if decoder is not None:
            state["kv_events_mismatch"] = decoder.mismatch
            state["kv_events_gaps"] = self.gaps.get(key, 0)
        return state
