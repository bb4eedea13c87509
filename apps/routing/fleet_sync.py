"""Every router process follows the database: what another process, the admin of another
process or the Celery discovery refresh changed there is applied here within ``SYNC_INTERVAL_S``:
the policy (switched on the dashboard, maybe served by another router process) and the workers
(added, drained, refreshed or removed elsewhere).
"""

from __future__ import annotations

import asyncio
import json
import logging

from asgiref.sync import sync_to_async

from apps.replicas.discovery import stable_info
from apps.replicas.services import worker_list
from apps.routing.services import policy_adopt

logger = logging.getLogger(__name__)

SYNC_INTERVAL_S = 2.0


def _fingerprint(worker, rank_ids: dict) -> tuple:
    return (
        worker.url,
        worker.api_key,
        worker.dp_size,
        worker.dp_aware,
        worker.draining,
        json.dumps(stable_info(worker.server_info), sort_keys=True),
        json.dumps(worker.overrides, sort_keys=True),
        tuple(sorted(rank_ids.items(), key=str)),
    )


class FleetSync:
    """Makes a router's fleet match the Worker rows. It remembers what it installed (a
    fingerprint per worker), so only what changed is reinstalled; a reinstalled worker keeps its
    targets' load, breakers and health."""

    def __init__(self, router):
        self.router = router
        self.installed: dict[int, tuple] = {}  # worker id -> fingerprint of what was installed

    async def sync(self) -> int:
        """Apply the rows; returns how many workers the database holds."""
        router = self.router
        seen = set()
        for worker, rank_ids in await sync_to_async(worker_list)():
            seen.add(worker.id)
            fingerprint = _fingerprint(worker, rank_ids)
            if self.installed.get(worker.id) == fingerprint:
                continue
            old = router.fleet.workers.get(worker.id)
            router.worker_saved(worker, rank_ids)
            new = router.fleet.workers.get(worker.id)
            if old is not None and new is not None and new is not old:  # health is live state
                new.keep_live_state(old)
            if worker.server_info:  # undiscovered workers stay pending until the health loop
                self.installed[worker.id] = fingerprint
        for worker_id in set(router.fleet.workers) - seen:
            router.worker_removed(worker_id)
            self.installed.pop(worker_id, None)
            logger.info("worker %s removed elsewhere: forgotten here too", worker_id)
        return len(seen)

    async def run(self) -> None:
        while True:
            try:
                await policy_adopt(router=self.router, flag=None)
                await self.sync()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("syncing from the database failed")
            await asyncio.sleep(SYNC_INTERVAL_S)
