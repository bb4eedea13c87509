"""What one dashboard push costs: ``build_snapshot`` over a full chart window.

    .venv/bin/python -m bench.runs.dashboard_push [--ranks 4] [--samples 300] [--repeats 20]

Builds a throwaway SQLite database with one worker of ``--ranks`` ranks and ``--samples`` scrapes
per rank (300 = the default 10-minute window at a 2 s scrape interval), then times the snapshot
the websocket sends every scrape interval to each open dashboard, and prints its JSON size.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="dpmesh-snapshot-")
    os.environ["DATABASE_URL"] = f"sqlite:///{tmp}/bench.sqlite3"
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    import django

    django.setup()
    from datetime import timedelta

    from django.core.management import call_command
    from django.utils import timezone

    from apps.replicas.models import Rank, RankSample, Worker
    from apps.routing.decision.config import RouterConfig
    from apps.routing.decision.router import Router
    from apps.routing.live import LiveFleet
    from apps.routing.selectors import build_snapshot

    call_command("migrate", verbosity=0)
    router = Router(RouterConfig())
    worker = Worker.objects.create(
        url="http://127.0.0.1:9", dp_size=args.ranks, server_info={"dp_size": args.ranks}
    )
    ids = {r: Rank.objects.create(worker=worker, rank=r).id for r in range(args.ranks)}
    LiveFleet(router).worker_saved(worker, ids)
    now = timezone.now()
    RankSample.objects.bulk_create(
        RankSample(
            rank_id=ids[r],
            at=now - timedelta(seconds=2 * i),
            requests=10_000 - i,
            prompt_tokens=1_000_000 - 100 * i,
            cached_tokens=700_000 - 60 * i,
        )
        for i in range(args.samples)
        for r in range(args.ranks)
    )
    build_snapshot(router)  # warm
    started = time.perf_counter()
    for _ in range(args.repeats):
        snapshot = build_snapshot(router)
    per = (time.perf_counter() - started) / args.repeats
    print(
        f"build_snapshot: {per * 1000:.1f} ms per push, "
        f"{len(json.dumps(snapshot)) / 1024:.0f} KiB of JSON "
        f"({args.ranks} ranks x {args.samples} samples)"
    )


if __name__ == "__main__":
    main()
