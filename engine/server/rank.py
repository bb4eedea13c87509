"""One DP rank process: its own scheduler, block manager, model runner and KV pool."""

from __future__ import annotations

import logging
import os
import sys
import time
from multiprocessing.connection import Connection

from engine.block_manager import BlockStored
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.server.ipc import AbortRequest, AddRequest, Outputs, RankReady, RankStats, Shutdown

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


def snapshot(engine: LLMEngine, rank: int) -> RankStats:
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
    )


def kv_events(events) -> list[tuple[str, list[int]]]:
    """The block manager's events as the front keeps them: only the digests travel."""
    return [("stored" if isinstance(e, BlockStored) else "removed", e.digests) for e in events]


class RankLoop:
    """Drains the inbox, steps the engine, ships outputs. Blocks on the inbox only when idle."""

    def __init__(self, rank: int, engine: LLMEngine, inbox: Connection, outbox: Connection):
        self.rank, self.engine, self.inbox, self.outbox = rank, engine, inbox, outbox
        self.errors: dict[str, str] = {}
        self.stats_dirty = True
        self.last_stats = 0.0

    def handle(self, msg) -> bool:
        """Apply one message; False means shut down."""
        if isinstance(msg, Shutdown):
            return False
        if isinstance(msg, AddRequest):
            try:
                self.engine.add_request(msg.request_id, msg.prompt_token_ids, msg.params)
            except ValueError as exc:  # the front validates first; this is the last line of defence
                self.errors[msg.request_id] = str(exc)
        elif isinstance(msg, AbortRequest):
            self.engine.abort_request(msg.request_id)
        self.stats_dirty = True
        return True

    def drain(self) -> bool:
        timeout = 0 if self.engine.has_unfinished_requests() else 1.0
        while self.inbox.poll(timeout):
            if not self.handle(self.inbox.recv()):
                return False
            timeout = 0
        return True

    def ship(self, outputs) -> None:
        now = time.monotonic()
        idle = not self.engine.has_unfinished_requests()
        stats = None
        if (idle and self.stats_dirty) or now - self.last_stats >= STATS_PERIOD_S:
            stats, self.last_stats, self.stats_dirty = snapshot(self.engine, self.rank), now, False
        events = kv_events(self.engine.block_manager.drain_events())
        if outputs or self.errors or stats or events:
            self.outbox.send(Outputs(self.rank, outputs, self.errors, stats, events or None))
            self.errors = {}

    def run(self) -> None:
        while self.drain():
            outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
            if outputs:
                self.stats_dirty = True
            self.ship(outputs)


def rank_main(rank: int, config: EngineConfig, inbox: Connection, outbox: Connection) -> None:
    """Entry point of a rank process (spawned)."""
    configure_rank_logging(rank)
    engine = LLMEngine(config, log_prefix="")
    outbox.send(RankReady(rank, engine.block_manager.num_blocks, engine.max_model_len, os.getpid()))
    logger.info(
        "rank %d ready: %d KV blocks, %d threads",
        rank,
        engine.block_manager.num_blocks,
        config.num_threads or 0,
    )
    try:
        RankLoop(rank, engine, inbox, outbox).run()
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass  # the front went away or we were told to stop
    logger.info("rank %d stopped", rank)
