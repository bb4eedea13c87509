"""Every router process follows the database: what another process, the admin of another
process or the Celery discovery refresh changed there is applied here within ``SYNC_INTERVAL_S``:
the policy (switched on the dashboard, maybe served by another router process), the workers
(added, drained, refreshed or removed elsewhere), and each target's KV usage
(``Target.kv_usage``, which the admission control's saturation rule reads) from the latest
``RankSample`` the scrape job wrote for its rank (apps/routing/jobs.py: every
``SCRAPE_INTERVAL_S``, in this process without a broker, else on the Celery worker).

So a target's KV usage is as old as one scrape interval plus one sync interval (about 4 s by
default), never older than ``kv_usage_max_age_s()``: past that, or when the engine did not
answer its last scrape, or says no KV capacity, it is unknown (None), and the saturation rule
ignores the target. It is read only where the saturation rule is on (``--saturation-kv-usage``);
the rest of a sync is one trip to the database's thread (the policy and the workers' rows).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterable
from datetime import timedelta

from asgiref.sync import sync_to_async
from django.conf import settings
from django.utils import timezone

from apps.replicas.discovery import stable_info
from apps.replicas.models import RankSample
from apps.replicas.services import worker_list
from apps.routing.live import LiveFleet
from apps.routing.models import RoutingSettings

logger = logging.getLogger(__name__)

SYNC_INTERVAL_S = 2.0

# How old a rank's latest sample may be for its KV usage to count (at least three scrape
# intervals, when those are longer). The scrape writes one every SCRAPE_INTERVAL_S (2 s); a
# latest one older than this means nothing scrapes any more (no Celery worker running, the
# embedded jobs stuck) or the rank's rows are gone, and a frozen "full" must not hold every new
# request back until its queue timeout. 30 s rides out a few missed scrapes (one of an engine
# that does not answer takes its 5 s timeout; a Celery worker restarts) and the clock skew
# between the scraper's host, whose clock stamps the sample, and this router's.
KV_USAGE_MAX_AGE_S = 30.0


def kv_usage_max_age_s() -> float:
    return max(KV_USAGE_MAX_AGE_S, 3 * settings.CONTROL_PLANE["SCRAPE_INTERVAL_S"])


def kv_usage_by_rank(rank_ids: Iterable[int], now=None) -> dict[int, float]:
    """{Rank id: fraction of its KV cache in use (0..1)} from each rank's latest sample, for the
    ranks whose latest sample is fresh (``kv_usage_max_age_s``), says the engine answered
    (``up``) and knows its capacity (``kv_blocks_total`` > 0); the others are left out. One
    query, whatever the number of ranks (sync: call it through ``sync_to_async``)."""
    rank_ids = list(rank_ids)
    if not rank_ids:
        return {}
    cutoff = (now or timezone.now()) - timedelta(seconds=kv_usage_max_age_s())
    rows = (
        RankSample.latest_of(rank_ids)
        .filter(at__gte=cutoff, up=True, kv_blocks_total__gt=0)  # the newest, if fresh: else none
        .order_by()
        .values_list("rank_id", "kv_blocks_used", "kv_blocks_total")
    )
    return {rank_id: min(1.0, max(0.0, used / total)) for rank_id, used, total in rows}


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
        self.live = LiveFleet(router)  # reads the rows into the router's views
        self.installed: dict[int, tuple] = {}  # worker id -> fingerprint of what was installed

    async def sync(self, adopt_policy: bool = False) -> int:
        """Apply the rows, then the KV usage; returns how many workers the database holds.
        ``adopt_policy``: also switch to the policy the database records (as ``policy_adopt``
        does, read in the same trip to the database's thread)."""
        router = self.router
        policy, rows, usage = await sync_to_async(self._read)(adopt_policy)
        if policy is not None and policy != router.config.policy:
            router.set_policy(policy)
        seen = set()
        for worker, rank_ids in rows:
            seen.add(worker.id)
            fingerprint = _fingerprint(worker, rank_ids)
            if self.installed.get(worker.id) == fingerprint:
                continue
            old = router.fleet.workers.get(worker.id)
            self.live.worker_saved(worker, rank_ids)
            new = router.fleet.workers.get(worker.id)
            if old is not None and new is not None and new is not old:  # health is live state
                new.keep_live_state(old)
            if worker.server_info:  # undiscovered workers stay pending until the health loop
                self.installed[worker.id] = fingerprint
        for worker_id in set(router.fleet.workers) - seen:
            router.remove_worker(worker_id)
            self.installed.pop(worker_id, None)
            logger.info("worker %s removed elsewhere: forgotten here too", worker_id)
        if usage is not None:
            for target in router.fleet.all_targets():  # the fleet as it is now, installed
                target.kv_usage = usage.get(target.rank_id)
        return len(seen)

    def _read(self, adopt_policy: bool):
        """(the recorded policy or None, the workers with their rank ids, each rank's KV usage
        or None), in one trip to the database's thread: a trip costs the router's loop more
        than a query does. The KV usage is read only where something reads it (the saturation
        rule, ``RouterConfig.saturation_kv_usage``): an idle router's every sync is its CPU."""
        policy = RoutingSettings.load().policy if adopt_policy else None
        rows = worker_list()
        usage = None
        if self.router.config.saturation_kv_usage > 0:
            usage = kv_usage_by_rank({r for _, ids in rows for r in ids.values()})
        return policy, rows, usage

    async def run(self) -> None:
        while True:
            try:
                await self.sync(adopt_policy=True)
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("syncing from the database failed")
            await asyncio.sleep(SYNC_INTERVAL_S)
