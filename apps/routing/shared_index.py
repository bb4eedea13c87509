"""Several router processes, one view of the engines' prefix caches (with ``REDIS_URL``).

Each router process keeps its own ``PrefixIndex`` (the hot path never waits on the network). What
one process routes, it also publishes: the target and the request's block digests, batched, on a
Redis channel. Every other process applies those inserts to its own index, so a prompt routed by
process A is a predicted hit when it comes back through process B. Load is not shared: each
process balances the requests it sees (with clients spread over processes, each sees a sample of
the whole).

Publishing never blocks routing: inserts go into a bounded queue that a background task drains;
when Redis is slow or away the queue drops the oldest entries (an index is a hint) and the
subscriber reconnects with backoff.
"""
from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections import deque

logger = logging.getLogger(__name__)

CHANNEL = "dpmesh:index"
MAX_PENDING = 10_000  # inserts waiting to be published; beyond it the oldest are dropped
MAX_BATCH = 256


class IndexSync:
    def __init__(self, router, redis_url: str, channel: str = CHANNEL):
        self.router, self.redis_url, self.channel = router, redis_url, channel
        self.origin = uuid.uuid4().hex  # this process: its own messages are skipped
        self.pending: deque[tuple[str, list[int]]] = deque(maxlen=MAX_PENDING)
        self.wakeup = asyncio.Event()
        self.published = self.applied = 0

    # ----- the hot path's side: never awaits -------------------------------------------------------
    def on_insert(self, key: str, digests: list[int]) -> None:
        if digests:
            self.pending.append((key, digests))
            self.wakeup.set()

    # ----- background tasks ------------------------------------------------------------------------
    def start(self) -> list[asyncio.Task]:
        self.router.index_listeners.append(self.on_insert)
        return [asyncio.ensure_future(self._publish_loop()), asyncio.ensure_future(self._subscribe_loop())]

    async def _client(self):
        import redis.asyncio as redis
        return redis.Redis.from_url(self.redis_url)

    async def _publish_loop(self) -> None:
        client = await self._client()
        while True:
            await self.wakeup.wait()
            self.wakeup.clear()
            while self.pending:
                batch = [self.pending.popleft() for _ in range(min(MAX_BATCH, len(self.pending)))]
                message = json.dumps({"from": self.origin, "inserts": batch})
                try:
                    await client.publish(self.channel, message)
                    self.published += len(batch)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # Redis away: drop this batch, keep routing
                    logger.warning("publishing %d index inserts failed: %s", len(batch), exc)
                    await asyncio.sleep(1.0)

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
        try:
            message = json.loads(raw)
        except ValueError:
            return 0
        if not isinstance(message, dict) or message.get("from") == self.origin:
            return 0
        known = {t.key for t in self.router.fleet.all_targets()}  # not yet installed here: skipped
        applied = 0
        for item in message.get("inserts") or ():
            if (isinstance(item, list) and len(item) == 2 and item[0] in known and isinstance(item[1], list)
                    and all(isinstance(d, int) for d in item[1])):
                self.router.index.insert(item[0], item[1])
                applied += 1
        self.applied += applied
        return applied
