"""One DP rank process: its own scheduler, block manager, model runner and KV pool."""

from __future__ import annotations

import logging
import os
import queue
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from multiprocessing.connection import Connection

from engine import kv_transfer
from engine.block_manager import BlockStored
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sequence import Sequence
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

logger = logging.getLogger(__name__)

STATS_PERIOD_S = 0.25


def configure_rank_logging(rank: int) -> None:
    logging.basicConfig(
        level=os.environ.get("ENGINE_LOG_LEVEL", "INFO"),
        stream=sys.stderr,
        force=True,
        format=f"%(asctime)s %(levelname)s [DP{rank}] %(name)s: %(message)s",
    )
    for noisy in ("transformers", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


@dataclass
class TransferCounts:
    """What a rank's KV transfers moved (engine/kv_transfer.py), for /metrics."""

    blocks_sent: int = 0
    bytes_sent: int = 0
    blocks_pulled: int = 0
    bytes_pulled: int = 0
    pull_seconds: float = 0.0


def snapshot(engine: LLMEngine, rank: int, moved: TransferCounts | None = None) -> RankStats:
    usage = engine.block_manager.usage()
    total = engine.cache_stats.total
    sched = engine.scheduler
    return RankStats(
        rank=rank,
        num_running=len(sched.running),
        num_waiting=sum(1 for s in sched.waiting if not s.is_finished),
        kv_blocks_used=usage.used,
        kv_blocks_cached=usage.cached_free,
        kv_blocks_total=usage.total,
        num_preemptions=sched.num_preemptions,
        prefix_cache_requests=total.requests,
        prefix_cache_prompt_tokens=total.total_tokens,
        prefix_cache_cached_tokens=total.cached_tokens,
        kv_held_requests=len(engine.held),
        **({f"kv_{k}": v for k, v in asdict(moved).items()} if moved else {}),
    )


def kv_events(events) -> list[tuple[str, list[int]]]:
    """The block manager's events as the front keeps them: only the digests travel."""
    return [("stored" if isinstance(e, BlockStored) else "removed", e.digests) for e in events]


class RankLoop:
    """Drains the inbox, steps the engine, ships outputs. Blocks on the inbox only when idle.

    With prefill/decode disaggregation (engine/kv_transfer.py) it also offers a prefill's held
    blocks to the rank's ``KVServer`` and releases them once pulled or expired, and on a decode
    rank runs each request's pull in a thread before the request joins the engine."""

    PULL_THREADS = 64  # a pull of SGLang's protocol waits for its prefill: many wait at once
    EXPIRE_PERIOD_S = 1.0

    def __init__(
        self,
        rank: int,
        engine: LLMEngine,
        inbox: Connection,
        outbox: Connection,
        kv_server: kv_transfer.KVServer | None = None,
    ):
        self.rank, self.engine, self.inbox, self.outbox = rank, engine, inbox, outbox
        self.errors: dict[str, str | tuple[str, int]] = {}
        self.stats_dirty = True
        self.last_stats = 0.0
        self.kv_server = kv_server
        self.pulls: dict[str, AddRequest] = {}  # decode requests whose KV is on its way
        self.pulled: queue.SimpleQueue = queue.SimpleQueue()
        self.pull_pool: ThreadPoolExecutor | None = None
        self.last_expiry = 0.0
        self.moved = TransferCounts()

    def handle(self, msg) -> bool:
        """Apply one message; False means shut down."""
        if isinstance(msg, Shutdown):
            return False
        if isinstance(msg, AddRequest):
            if msg.pull is not None:
                self._start_pull(msg)
            else:
                self._add(msg)
        elif isinstance(msg, Embed):
            self._embed(msg)
            return True
        elif isinstance(msg, AbortRequest):
            if self.pulls.pop(msg.request_id, None) is None:
                req = self.engine.requests.get(msg.request_id)
                if req is not None and req.hold_key is not None and self.kv_server is not None:
                    self.kv_server.fail(req.hold_key, "the prefill was aborted")
                self.engine.abort_request(msg.request_id)
        elif isinstance(msg, ReleaseHeld):
            # withdrawn from the transfer server first: a pull that has it releases it itself
            offered = self.kv_server is None or self.kv_server.take(msg.key)
            if offered and self.engine.release_held(msg.key):
                logger.info("KV held under %s released: its decode leg will not come", msg.key)
        self.stats_dirty = True
        return True

    def _add(self, msg: AddRequest) -> None:
        try:
            self.engine.add_request(
                msg.request_id,
                msg.prompt_token_ids,
                msg.params,
                hold_key=msg.hold_key,
                cached_tokens=msg.cached_tokens,
            )
        except ValueError as exc:  # the front validates first; this is the last line of defence
            self.errors[msg.request_id] = str(exc)
            if msg.hold_key is not None and self.kv_server is not None:
                self.kv_server.fail(msg.hold_key, str(exc))

    def _embed(self, msg: Embed) -> None:
        """Embed between steps (a forward pass per input, no KV kept): the answer at once."""
        embed = getattr(self.engine.runner, "embed", None)
        if embed is None:
            answer = Embedded(msg.request_id, None, "a simulated engine computes no embeddings")
        else:
            try:
                answer = Embedded(msg.request_id, embed(msg.inputs))
            except (RuntimeError, ValueError) as exc:
                answer = Embedded(msg.request_id, None, f"embedding failed: {exc}")
        self.outbox.send(answer)

    # ----- decode: pull, then run ----------------------------------------------------------
    def _start_pull(self, msg: AddRequest) -> None:
        """Ask the prefill rank for the prompt's full blocks this rank does not cache (at most
        those a hit can use: the last prompt token is always computed here)."""
        engine, pull = self.engine, msg.pull
        ids = msg.prompt_token_ids
        seq = Sequence(ids, msg.params, block_size=engine.config.block_size)
        usable = (len(ids) - 1) // engine.config.block_size
        if pull.num_blocks is not None:
            usable = min(usable, pull.num_blocks)
        first = len(engine.block_manager.cached_prefix(seq, usable))
        wanted = list(range(first, usable))
        digests = [seq.digest(i) for i in wanted]
        if self.pull_pool is None:
            self.pull_pool = ThreadPoolExecutor(self.PULL_THREADS, thread_name_prefix="kv-pull")
        self.pulls[msg.request_id] = msg
        layout = engine.runner.kv_layout
        self.pull_pool.submit(self._pull, msg, first, wanted, digests, layout)

    def _pull(self, msg: AddRequest, first: int, wanted, digests, layout) -> None:
        pull, started = msg.pull, time.monotonic()
        try:
            data, cached = kv_transfer.pull(
                pull.host, pull.port, pull.request_id, wanted, digests, layout, pull.wait_s
            )
            modeled = getattr(self.engine.runner, "transfer_s", None)  # a simulated engine's
            if modeled is not None:
                time.sleep(max(0.0, modeled(len(wanted)) - (time.monotonic() - started)))
            seconds = time.monotonic() - started
            self.pulled.put((msg, first, len(wanted), data, cached, None, seconds))
        except kv_transfer.TransferError as exc:
            self.pulled.put((msg, first, len(wanted), b"", 0, exc, 0.0))

    def _finish_pulls(self) -> None:
        while True:
            try:
                msg, first, count, data, cached, error, seconds = self.pulled.get_nowait()
            except queue.Empty:
                return
            if self.pulls.pop(msg.request_id, None) is None:
                continue  # aborted while pulling
            self.stats_dirty = True
            if error is not None:
                self.errors[msg.request_id] = (str(error), error.status)
                continue
            if count:
                self.moved.blocks_pulled += count
                self.moved.bytes_pulled += len(data)
                self.moved.pull_seconds += seconds
                got = self.engine.import_prefix(
                    msg.prompt_token_ids, first, data, count, msg.params
                )
                logger.info(
                    "KV pulled for %s: %d blocks (%d cached here), %.1f MiB in %.1f ms%s",
                    msg.request_id,
                    count,
                    first,
                    len(data) / 2**20,
                    seconds * 1000,
                    "" if got else "; not kept (no room, or the local prefix was evicted)",
                )
            if msg.cached_tokens is None:  # what the prefill side had cached, as it says
                msg = replace(msg, cached_tokens=cached)
            self._add(msg)

    # ----- prefill: offer, release, expire ----------------------------------------------------
    def _offer(self) -> None:
        for key, held in self.engine.take_new_holds():
            self.kv_server.offer(key, held.block_ids, held.digests, held.cached_tokens)

    def _release_served(self) -> None:
        while True:
            try:
                served = self.kv_server.done.get_nowait()
            except queue.Empty:
                break
            self.engine.release_held(served.request_id)
            self.stats_dirty = True
            self.moved.blocks_sent += served.blocks
            self.moved.bytes_sent += served.nbytes
            if served.blocks:
                logger.info(
                    "KV sent for %s: %d blocks, %.1f MiB in %.1f ms",
                    served.request_id,
                    served.blocks,
                    served.nbytes / 2**20,
                    served.seconds * 1000,
                )
        now = time.monotonic()
        if now - self.last_expiry >= self.EXPIRE_PERIOD_S:
            self.last_expiry = now
            if self.engine.expire_held(now, self.kv_server.take):
                self.stats_dirty = True

    # ----- the loop --------------------------------------------------------------------------
    def drain(self) -> bool:
        busy = self.engine.has_unfinished_requests()
        # waiting on pulls, or holding blocks to release: look again soon
        timeout = 0 if busy else 0.002 if self.pulls else 0.05 if self.engine.held else 1.0
        while self.inbox.poll(timeout):
            if not self.handle(self.inbox.recv()):
                return False
            timeout = 0
        if self.pulls:
            self._finish_pulls()
        if self.kv_server is not None:
            self._release_served()
        return True

    def ship(self, outputs) -> None:
        now = time.monotonic()
        idle = not self.engine.has_unfinished_requests()
        stats = None
        if (idle and self.stats_dirty) or now - self.last_stats >= STATS_PERIOD_S:
            stats = snapshot(self.engine, self.rank, self.moved)
            self.last_stats, self.stats_dirty = now, False
        events = kv_events(self.engine.block_manager.drain_events())
        if outputs or self.errors or stats or events:
            self.outbox.send(Outputs(self.rank, outputs, self.errors, stats, events or None))
            self.errors = {}

    def run(self) -> None:
        while self.drain():
            outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
            if outputs:
                self.stats_dirty = True
                if self.kv_server is not None:
                    self._offer()
            self.ship(outputs)


def rank_main(rank: int, config: EngineConfig, inbox: Connection, outbox: Connection) -> None:
    """Entry point of a rank process (spawned)."""
    configure_rank_logging(rank)
    engine = LLMEngine(config, log_prefix="")
    engine.kv_transfer_timeout_s = config.kv_transfer_timeout_s
    kv_server = None
    if config.disaggregation_mode == "prefill":
        kv_server = kv_transfer.KVServer(
            config.kv_transfer_host, 0, engine.runner.kv_layout, engine.runner.export_blocks
        )
        logger.info("KV transfer: serving pulls on %s:%d", config.kv_transfer_host, kv_server.port)
    outbox.send(
        RankReady(
            rank,
            engine.block_manager.num_blocks,
            engine.max_model_len,
            os.getpid(),
            kv_server.port if kv_server else None,
        )
    )
    logger.info(
        "rank %d ready: %d KV blocks, %d threads",
        rank,
        engine.block_manager.num_blocks,
        config.num_threads or 0,
    )
    try:
        RankLoop(rank, engine, inbox, outbox, kv_server).run()
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass  # the front went away or we were told to stop
    logger.info("rank %d stopped", rank)
