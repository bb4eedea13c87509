"""/metrics under ``--workers N`` (apps/routing/worker_metrics.py): whichever worker answers, the
counters and histograms are the sum over the workers, the per-process gauges too, the fleet's
gauges are the answering worker's; a dead worker's counts stay. In-process, with two routers
standing for two workers; tests/routing/test_shared_index.py runs the real ``--workers 2``."""

from __future__ import annotations

import random

import pytest

from apps.routing import worker_metrics
from apps.routing.decision.config import RouterConfig
from apps.routing.decision.router import Router
from tests.routing.helpers import worker_view


def router(requests: int, open_requests: int = 0) -> Router:
    r = Router(RouterConfig(policy="round_robin"), rng=random.Random(0))
    r.fleet.put(worker_view(1, dp_size=2))
    for _ in range(requests):
        r.route({"prompt": "x"}, False, None).finish(ok=True)
    for _ in range(open_requests):
        r.route({"prompt": "y"}, False, None)  # in flight, not finished
    for _ in range(requests):
        r.stats.responded("/v1/completions", 200)
        r.stats.overhead.observe(0.001)
    return r


def value(text: str, series: str) -> float:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{series} not in /metrics:\n{text}")


@pytest.fixture
def share(tmp_path, monkeypatch):
    monkeypatch.setattr(worker_metrics, "_share", None)
    return tmp_path


def test_alone_the_answer_is_the_process_own(share):
    text = worker_metrics.render(router(3)).decode()
    assert (
        value(text, 'dpmesh_router_http_responses_total{endpoint="/v1/completions",status="200"}')
        == 3
    )
    assert value(text, "dpmesh_router_workers") == 1


def test_a_worker_answers_for_all_workers_and_keeps_a_dead_ones_counts(share):
    a, b = router(3, open_requests=1), router(5, open_requests=2)
    b.fleet.workers[1].healthy = False  # the fleet's state: the answering worker's view counts
    worker_metrics.configure(share, 1)
    worker_metrics.publish(b)
    worker_metrics.configure(share, 0)
    text = worker_metrics.render(a).decode()
    responses = 'dpmesh_router_http_responses_total{endpoint="/v1/completions",status="200"}'
    assert value(text, responses) == 8
    assert value(text, "dpmesh_router_overhead_seconds_count") == 8
    assert value(text, 'dpmesh_router_overhead_seconds_bucket{le="0.001"}') == 8
    assert value(text, "dpmesh_router_workers") == 2
    requests = sum(
        value(
            text,
            f'dpmesh_router_requests_total{{rank="{k}",target="{t.key}",worker="{t.worker.url}"}}',
        )
        for k, t in enumerate(a.fleet.all_targets())
    )
    assert requests == 3 + 1 + 5 + 2
    inflight = sum(
        value(
            text,
            f'dpmesh_router_inflight_requests{{rank="{k}",target="{t.key}",worker="{t.worker.url}"}}',
        )
        for k, t in enumerate(a.fleet.all_targets())
    )
    assert inflight == 3  # each process's own, summed
    assert "dpmesh_router_worker_healthy{" in text and " 0.0" not in "".join(
        line for line in text.splitlines() if line.startswith("dpmesh_router_worker_healthy{")
    )
    # worker 1 dies: its counts move to the retired file, still counted; nothing in flight
    worker_metrics.retire(share, 1)
    assert not worker_metrics.worker_file(share, 1).exists()
    text = worker_metrics.render(a).decode()
    assert value(text, responses) == 8 and value(text, "dpmesh_router_workers") == 1
    inflight = sum(
        value(
            text,
            f'dpmesh_router_inflight_requests{{rank="{k}",target="{t.key}",worker="{t.worker.url}"}}',
        )
        for k, t in enumerate(a.fleet.all_targets())
    )
    assert inflight == 1
    # forked again, it counts from zero and the sum goes on from 8
    worker_metrics.configure(share, 1)
    worker_metrics.publish(router(2))
    worker_metrics.configure(share, 0)
    assert value(worker_metrics.render(a).decode(), responses) == 10


def test_the_dashboard_s_admission_figures_add_up_the_workers(share):
    from apps.routing.proxy.admission import make_admission

    a, b = router(1), router(1)
    own, other = make_admission(a), make_admission(b)
    own.rejected["queue_full"] = 2
    other.rejected["queue_full"], other.rejected["timeout"] = 3, 1
    other.in_flight = 4  # what the other worker holds now
    assert worker_metrics.fleet_admission(own.snapshot()) == own.snapshot()  # alone: its own
    worker_metrics.configure(share, 1)
    worker_metrics.publish(b)
    worker_metrics.configure(share, 0)
    fleet = worker_metrics.fleet_admission(own.snapshot())
    assert fleet["admitted_requests"] == 4 and fleet["queue_depth"] == 0
    assert fleet["rejected_by_reason"] == {"queue_full": 5, "timeout": 1, "draining": 0}
    assert fleet["rejected_requests"] == 6
    worker_metrics.retire(share, 1)  # it died: its refusals stay, what it held does not
    fleet = worker_metrics.fleet_admission(own.snapshot())
    assert fleet["admitted_requests"] == 0 and fleet["rejected_requests"] == 6
