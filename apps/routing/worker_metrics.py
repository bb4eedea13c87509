"""/metrics of a router served by ``--workers N``: the numbers of all N processes, not of whichever
one the scrape's connection happened to reach.

Each worker writes its own /metrics text into a directory its supervisor made
(``apps/routing/process.py`` ``serve_workers``), every ``PUBLISH_S``, atomically (a temporary file
renamed). The worker that answers a scrape renders its own families live and adds the others'
files: counters and histograms are summed series by series, and so are the gauges of what each
process holds itself (``SUMMED_GAUGES``: the requests in flight from it, its admission queue);
every other gauge says what the fleet is (targets up, the index, the policy, the time model), and
is the answering worker's view. ``dpmesh_router_workers`` says how many processes a scrape added.

The counters stay monotonic across a worker's death: the supervisor folds the dead worker's last
file into ``retired.prom`` (counters and histograms only; a dead process holds nothing in flight)
before it forks the worker again, and every scrape adds that file too. The history before the
router started (the Rank rows, ``feeds/persist.restore_stats``) is counted once: only worker 0's
first start takes it, every other start counts from zero. What a worker counted in its last
``PUBLISH_S`` before it died is lost, as a crashed process loses it anyway.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from apps.routing.metrics import PREFIX, RouterCollector

logger = logging.getLogger(__name__)

PUBLISH_S = 1.0
RETIRED = "retired.prom"
# what each process holds itself: the fleet holds their sum
SUMMED_GAUGES = frozenset(
    f"{PREFIX}_{name}"
    for name in ("inflight_requests", "inflight_prompt_tokens", "queue_depth", "admitted_requests")
)
_COUNTED = frozenset({"counter", "histogram", "summary"})

_share: tuple[Path, int] | None = None  # (directory, this worker's index) in a worker of N


def configure(directory: Path, index: int) -> None:
    """This process is worker ``index`` of a router whose workers publish into ``directory``."""
    global _share
    _share = (Path(directory), index)


def shared() -> bool:
    return _share is not None


def worker_file(directory: Path, index: int) -> Path:
    return directory / f"worker-{index}.prom"


def _own(router) -> list[Metric]:
    return list(RouterCollector(router).collect())


def _write(path: Path, families: list[Metric]) -> None:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    scratch = path.with_name(f".{path.name}.{os.getpid()}")
    scratch.write_bytes(generate_latest(registry))
    os.replace(scratch, path)


def _read(path: Path) -> list[Metric]:
    """The families of a published file; none when it is missing or unreadable."""
    try:
        return list(text_string_to_metric_families(path.read_text()))
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as exc:
        logger.warning("router metrics: cannot read %s: %s", path, exc)
        return []


def _summed(family: Metric) -> bool:
    return family.type in _COUNTED or family.name in SUMMED_GAUGES


def _counts_only(families: list[Metric]) -> list[Metric]:
    return [f for f in families if f.type in _COUNTED]


def merge(own: list[Metric], others: list[list[Metric]]) -> list[Metric]:
    """``own``'s families in their order, each series of a summed family (``_summed``) plus the
    same series of ``others``; a series or a summed family only the others have is added after.
    Every other family is ``own``'s as it is."""
    merged: dict[str, tuple[Metric, dict]] = {}  # name -> (family, series key -> sample)

    def take(family: Metric, add: bool) -> None:
        entry = merged.get(family.name)
        if entry is None:
            copy = Metric(family.name, family.documentation, family.type)
            entry = merged[family.name] = (copy, {})
        series = entry[1]
        for sample in family.samples:
            key = (sample.name, tuple(sorted(sample.labels.items())))
            if key in series and add:
                old = series[key]
                series[key] = old._replace(value=old.value + sample.value)
            elif key not in series:
                series[key] = sample._replace(timestamp=None, exemplar=None)

    for family in own:
        take(family, add=False)
    for families in others:
        for family in families:
            if _summed(family):
                take(family, add=True)
    out = []
    for family, series in merged.values():
        family.samples = list(series.values())
        out.append(family)
    return out


def _siblings() -> tuple[list[list[Metric]], list[Metric]]:
    """The other live workers' published families (one list each, unreadable ones left out) and
    the retired counts, as a worker of ``--workers N`` reads them (``([], [])`` outside)."""
    if _share is None:
        return [], []
    directory, index = _share
    own = worker_file(directory, index)
    live = [_read(path) for path in sorted(directory.glob("worker-*.prom")) if path != own]
    return [f for f in live if f], _counts_only(_read(directory / RETIRED))


def render(router) -> bytes:
    """/metrics: this process's families, and under ``--workers`` the fleet's (see above)."""
    own, (live, retired) = _own(router), _siblings()
    workers = 1 + len(live)
    others = [*live, retired] if _share is not None else []
    families = merge(own, others) if others else own
    count = Metric(
        f"{PREFIX}_workers",
        "Router processes whose numbers this answer adds up (runrouter --workers N)",
        "gauge",
    )
    count.add_sample(f"{PREFIX}_workers", {}, workers)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families([*families, count]))
    return generate_latest(registry)


def fleet_admission(snapshot: dict) -> dict:
    """The dashboard's admission figures (``Admission.snapshot``) with the other workers' added
    under ``--workers``: their queues, admitted requests and refusals (a dead worker's refusals
    too); ``saturated`` and ``draining`` stay this worker's view. Outside ``--workers``: as it
    is."""
    if _share is None:
        return snapshot
    out = {**snapshot, "rejected_by_reason": dict(snapshot.get("rejected_by_reason") or {})}
    live, retired = _siblings()
    held = (f"{PREFIX}_queue_depth", f"{PREFIX}_admitted_requests")
    for families, alive in [*((f, True) for f in live), (retired, False)]:
        for family in families:
            for sample in family.samples:
                if alive and sample.name in held:  # a dead worker holds nothing now
                    key = sample.name.removeprefix(f"{PREFIX}_")
                    out[key] = out.get(key, 0) + int(sample.value)
                elif sample.name == f"{PREFIX}_rejected_requests_total":
                    reason = sample.labels.get("reason", "")
                    rejected = out["rejected_by_reason"]
                    rejected[reason] = rejected.get(reason, 0) + int(sample.value)
    out["rejected_requests"] = sum(out["rejected_by_reason"].values())
    return out


def publish(router) -> None:
    """Write this worker's families for the others' scrapes (no-op outside ``--workers``)."""
    if _share is not None:
        directory, index = _share
        _write(worker_file(directory, index), _own(router))


async def publish_loop(router) -> None:
    while True:
        try:
            publish(router)
        except OSError as exc:  # the directory went away: the supervisor is stopping
            logger.warning("router metrics: cannot publish: %s", exc)
        await asyncio.sleep(PUBLISH_S)


def retire(directory: Path, index: int) -> None:
    """Worker ``index`` died: fold its last counts into ``RETIRED`` and remove its file (the
    supervisor calls this before it forks the worker again)."""
    path = worker_file(directory, index)
    dead = _counts_only(_read(path))
    if dead:
        _write(directory / RETIRED, merge(_counts_only(_read(directory / RETIRED)), [dead]))
    path.unlink(missing_ok=True)


class _Families:
    """A collector that yields the families it was given."""

    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self):
        return iter(self.families)
