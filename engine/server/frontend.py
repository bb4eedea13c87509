"""The front's view of its DP ranks: processes, health, load, and request streams.

Each rank has two one-way pipes. A reader thread per rank turns what the rank sends into calls
on the event loop; everything else runs on the loop, so the load counters need no locks.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing as mp
import threading
import time
from dataclasses import dataclass, field, replace

from engine.config import EngineConfig
from engine.llm_engine import RequestOutput
from engine.sampling_params import SamplingParams
from engine.server.ipc import (
    AbortRequest,
    AddRequest,
    Embed,
    Embedded,
    Outputs,
    RankReady,
    RankStats,
    ReleaseHeld,
    Shutdown,
)
from engine.server.rank import rank_main
from serving import tracing

logger = logging.getLogger(__name__)

LOAD_BALANCE_POLICIES = ("least_requests", "round_robin", "least_tokens")


def _trace(times: list, out: RequestOutput, parent, rank: int, prompt_tokens: int) -> None:
    """Note a traced request's first token; at its end, make its spans (serving/tracing.py)."""
    now = time.time_ns()
    if times[1] is None:
        times[1] = now
        times[2] = out.prefill_chunks
    if out.finished:
        attributes = {"dpmesh.rank": rank, "gen_ai.usage.input_tokens": prompt_tokens,
                      "dpmesh.cached_tokens": out.num_cached_tokens,
                      "gen_ai.usage.output_tokens": out.num_output_tokens}  # fmt: skip
        tracing.engine_request_spans(parent, times[0], times[1], now, times[2], attributes)


class RankUnavailable(Exception):
    """The chosen rank is not serving (dead or not started)."""


@dataclass
class RankCounters:
    """What the front saw a rank finish: the per-rank numbers behind /metrics."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generation_tokens: int = 0
    errors: int = 0
    aborts: int = 0
    pretokenized: int = 0  # requests whose prompt ids came with them (a router's): not encoded
    # requests that came with a router's prediction of their cached prompt tokens (openai_api
    # PREDICTED_HEADER): the tokens predicted, what the rank had of them, and the shortfall
    predicted_requests: int = 0
    predicted_tokens: int = 0
    predicted_cached_tokens: int = 0
    mispredicted_tokens: int = 0


@dataclass
class RankState:
    rank: int
    process: mp.process.BaseProcess | None = None
    inbox: object = None  # Connection the front writes
    ready: bool = False
    dead_reason: str | None = None
    info: RankReady | None = None
    stats: RankStats | None = None
    inflight_requests: int = 0
    inflight_tokens: int = 0
    counters: RankCounters = field(default_factory=RankCounters)
    streams: dict[str, asyncio.Queue] = field(default_factory=dict)
    # digests the rank's prefix cache holds (its KV events)
    cached: set[int] = field(default_factory=set)

    @property
    def alive(self) -> bool:
        return self.ready and self.dead_reason is None


KV_SUBSCRIBER_BACKLOG = (
    10_000  # event batches a /kv_events reader may fall behind before it is cut off
)


class KVSubscription:
    """One reader of the engine's KV events: a snapshot of every rank's cached digests, then each
    rank's events in order. A reader that falls ``KV_SUBSCRIBER_BACKLOG`` batches behind is cut
    off (``overflowed``) rather than buffered without bound; it reconnects for a new snapshot."""

    def __init__(self, snapshot: dict[int, list[int]]):
        self.snapshot = snapshot
        self.queue: asyncio.Queue = asyncio.Queue(KV_SUBSCRIBER_BACKLOG)
        self.overflowed = False

    def push(self, item) -> None:
        if self.overflowed:
            return
        try:
            self.queue.put_nowait(item)
        except asyncio.QueueFull:
            self.overflowed = True
            self.queue = asyncio.Queue(1)
            self.queue.put_nowait(None)  # the reader's wake-up: it ends the stream


class RankFailed(Exception):
    """Raised from a request stream whose rank refused it (400) or died under it (503)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class EngineClient:
    """Starts the rank processes and routes requests to them."""

    def __init__(self, config: EngineConfig, dp_size: int, load_balance: str = "least_requests"):
        if load_balance not in LOAD_BALANCE_POLICIES:
            raise ValueError(f"--dp-load-balance must be one of {LOAD_BALANCE_POLICIES}")
        self.config, self.dp_size, self.load_balance = config, dp_size, load_balance
        self.ranks = [RankState(r) for r in range(dp_size)]
        self.stopping = False  # shutdown() asked the ranks to stop: their exits are no deaths
        self._cursor = itertools.count()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.kv_subscriptions: set[KVSubscription] = set()

    # ----- lifecycle -------------------------------------------------------------------------
    def start(self, threads_per_rank: int) -> None:
        ctx = mp.get_context("spawn")
        for state in self.ranks:
            inbox_r, inbox_w = ctx.Pipe(duplex=False)
            outbox_r, outbox_w = ctx.Pipe(duplex=False)
            # rank r on GPU r
            device = f"cuda:{state.rank}" if self.config.device == "cuda" else self.config.device
            cfg = replace(
                self.config,
                num_threads=threads_per_rank,
                seed=self.config.seed + state.rank,
                device=device,
            )
            proc = ctx.Process(
                target=rank_main,
                args=(state.rank, cfg, inbox_r, outbox_w),
                name=f"dp-rank-{state.rank}",
                daemon=True,
            )
            proc.start()
            inbox_r.close()  # the child owns these ends; closing ours lets EOF reach us if it dies
            outbox_w.close()
            state.process, state.inbox = proc, inbox_w
            threading.Thread(
                target=self._reader,
                args=(state, outbox_r),
                name=f"rank-{state.rank}-reader",
                daemon=True,
            ).start()

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def shutdown(self) -> None:
        self.stopping = True
        for state in self.ranks:
            try:
                state.inbox.send(Shutdown())
            except (OSError, AttributeError):
                pass
        for state in self.ranks:
            if state.process is not None:
                state.process.join(timeout=5)
                if state.process.is_alive():
                    state.process.terminate()

    def wait_ready(self, timeout: float) -> bool:
        """True once every rank is ready; False at the first that died starting (its exit is
        noticed here: the event loop that ``_on_death`` is queued on does not run yet)."""
        import time

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for s in self.ranks:
                code = s.process.exitcode if s.process is not None and not s.ready else None
                if code is not None and s.dead_reason is None:
                    s.dead_reason = f"process exited with code {code} while starting"
            if all(s.ready for s in self.ranks) or any(s.dead_reason for s in self.ranks):
                break
            time.sleep(0.05)
        return all(s.alive for s in self.ranks)

    @property
    def healthy(self) -> bool:
        return all(s.alive for s in self.ranks)

    def health_reason(self) -> str:
        reasons = [
            f"rank {s.rank}: {s.dead_reason or 'starting'}" for s in self.ranks if not s.alive
        ]
        return "; ".join(reasons) or "ok"

    # ----- messages from ranks (reader thread → loop) -------------------------------------------
    def _reader(self, state: RankState, conn) -> None:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            if isinstance(msg, RankReady):
                # set from this thread: /health may run before bind
                state.info, state.ready = msg, True
                continue
            if isinstance(msg, Embedded):
                self._call(self._on_embedded, state, msg)
                continue
            self._call(self._on_outputs, state, msg)
        state.process.join(timeout=5)
        code = state.process.exitcode
        self._call(self._on_death, state, f"process exited with code {code}")

    def _call(self, fn, *args) -> None:
        if self.loop is None:
            fn(*args)
            return
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop closed first: the server is stopping, no one is waiting
            if not (self.stopping or self.loop.is_closed()):
                raise

    def _on_outputs(self, state: RankState, msg: Outputs) -> None:
        if msg.stats is not None:
            state.stats = msg.stats
        if msg.kv_events:
            self._on_kv_events(state, msg.kv_events)
        for rid, error in msg.errors.items():
            queue = state.streams.get(rid)
            if queue is not None:
                message, status = error if isinstance(error, tuple) else (error, 400)
                queue.put_nowait(RankFailed(message, status))
        for out in msg.outputs:
            queue = state.streams.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)

    @staticmethod
    def _on_embedded(state: RankState, msg: Embedded) -> None:
        queue = state.streams.get(msg.request_id)
        if queue is not None:  # else its client left meanwhile
            queue.put_nowait(msg)

    def _on_kv_events(self, state: RankState, events: list[tuple[str, list[int]]]) -> None:
        for kind, digests in events:
            if kind == "stored":
                state.cached.update(digests)
            else:
                state.cached.difference_update(digests)
        for sub in self.kv_subscriptions:
            sub.push((state.rank, events))

    # ----- KV events for routers (GET /kv_events) ------------------------------------------------
    def kv_subscribe(self) -> KVSubscription:
        """A consistent start: the snapshot and the events after it (taken on the loop, where
        events are applied, so none falls between the two)."""
        sub = KVSubscription({s.rank: list(s.cached) for s in self.ranks})
        self.kv_subscriptions.add(sub)
        return sub

    def kv_unsubscribe(self, sub: KVSubscription) -> None:
        self.kv_subscriptions.discard(sub)

    def _on_death(self, state: RankState, reason: str) -> None:
        if state.cached:  # its KV pool is gone with it
            self._on_kv_events(state, [("removed", list(state.cached))])
        if state.dead_reason is None:
            state.dead_reason = reason
            if self.stopping:  # asked to stop: not an error
                logger.info("DP rank %d exited (%s) on shutdown", state.rank, reason)
            else:
                logger.error(
                    "DP rank %d died: %s; failing %d in-flight requests",
                    state.rank,
                    reason,
                    len(state.streams),
                )
        for queue in state.streams.values():
            queue.put_nowait(RankFailed(f"DP rank {state.rank} died: {reason}", 503))

    # ----- choosing a rank -----------------------------------------------------------------------
    def choose_rank(self, hint: int | None) -> int:
        if hint is not None:
            if not self.ranks[hint].alive:
                raise RankUnavailable(
                    f"data_parallel_rank {hint} is not serving "
                    f"({self.ranks[hint].dead_reason or 'starting'})"
                )
            return hint
        alive = [s for s in self.ranks if s.alive]
        if not alive:
            raise RankUnavailable(f"no DP rank is serving: {self.health_reason()}")
        start = next(self._cursor)
        rotated = [alive[(start + i) % len(alive)] for i in range(len(alive))]
        if self.load_balance == "round_robin":
            return rotated[0].rank
        if self.load_balance == "least_tokens":
            key = lambda s: (s.inflight_tokens, s.inflight_requests)  # noqa: E731
        else:
            key = lambda s: (s.inflight_requests, s.inflight_tokens)  # noqa: E731
        return min(rotated, key=key).rank  # min keeps the first of equals: the rotation breaks ties

    # ----- request streams -----------------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        rank: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        predicted: int | None = None,
        trace: tuple | None = None,
        **transfer,
    ):
        """Yield RequestOutputs of one request on ``rank``. Load is held from here until the
        generator closes, whichever way it closes (finish, error, client disconnect).
        ``predicted``: the cached prompt tokens a router predicted for it; ``trace``: (the
        client's trace context or None) when traces are exported (serving/tracing.py); ``transfer``:
        ``AddRequest``'s prefill/decode fields (``hold_kv``, ``pull``, ``cached_tokens``)."""
        state = self.ranks[rank]
        if not state.alive:
            raise RankUnavailable(f"DP rank {rank} is not serving")
        queue: asyncio.Queue = asyncio.Queue()
        state.streams[request_id] = queue
        state.inflight_requests += 1
        state.inflight_tokens += len(prompt_token_ids)
        finished = False
        times = [time.time_ns(), None, None] if trace is not None else None  # arrival, first token
        try:
            state.inbox.send(AddRequest(request_id, prompt_token_ids, params, **transfer))
            while not finished:
                item = await queue.get()
                if times is not None and not isinstance(item, Exception):
                    _trace(times, item, trace[0], rank, len(prompt_token_ids))
                if isinstance(item, Exception):
                    state.counters.errors += 1
                    finished = True  # the rank no longer holds it: nothing to abort
                    raise item
                finished = item.finished
                if finished:
                    self._count(state, item, request_id, predicted)
                yield item
        finally:
            state.streams.pop(request_id, None)
            state.inflight_requests -= 1
            state.inflight_tokens -= len(prompt_token_ids)
            if not finished and state.dead_reason is None:
                state.counters.aborts += 1
                try:
                    state.inbox.send(AbortRequest(request_id))
                except OSError:
                    pass

    def release_held(self, rank: int, key: str) -> None:
        """Give up the blocks a prefill holds on ``rank`` under ``key`` (from any thread: the
        message is sent from the loop, the one writer of a rank's pipe)."""
        self._call(self._send_release, self.ranks[rank], key)

    @staticmethod
    def _send_release(state: RankState, key: str) -> None:
        if state.alive:
            try:
                state.inbox.send(ReleaseHeld(key))
            except OSError:
                pass  # the rank is gone, and its blocks with it

    async def embed(self, request_id: str, rank: int, inputs: list[list[int]]):
        """The embeddings of ``inputs`` (token ids) computed on ``rank``, one vector each; its load
        held meanwhile. RankFailed: the rank died, or cannot embed (400)."""
        state = self.ranks[rank]
        if not state.alive:
            raise RankUnavailable(f"DP rank {rank} is not serving")
        queue: asyncio.Queue = asyncio.Queue()
        tokens = sum(map(len, inputs))
        state.streams[request_id] = queue
        state.inflight_requests += 1
        state.inflight_tokens += tokens
        try:
            state.inbox.send(Embed(request_id, inputs))
            item = await queue.get()
            if isinstance(item, Exception):
                state.counters.errors += 1
                raise item
            if item.error is not None:
                raise RankFailed(item.error, 400)
            state.counters.requests += 1
            state.counters.prompt_tokens += tokens
            return item.vectors
        finally:
            state.streams.pop(request_id, None)
            state.inflight_requests -= 1
            state.inflight_tokens -= tokens

    @staticmethod
    def _count(state: RankState, out: RequestOutput, request_id: str, predicted=None) -> None:
        c = state.counters
        c.requests += 1
        c.prompt_tokens += out.num_prompt_tokens
        c.cached_tokens += out.num_cached_tokens
        c.generation_tokens += out.num_output_tokens
        if predicted is not None:
            c.predicted_requests += 1
            c.predicted_tokens += predicted
            c.predicted_cached_tokens += min(predicted, out.num_cached_tokens)
            short = predicted - out.num_cached_tokens
            if short > 0:
                c.mispredicted_tokens += short
                logger.info("rank %d: request %s had %d cached prompt tokens of the %d the "
                            "router predicted", state.rank, request_id, out.num_cached_tokens,
                            predicted)  # fmt: skip
