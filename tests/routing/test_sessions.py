"""Session affinity: a named session (``X-Session-ID``, or the OpenAI ``user`` field) stays on its
rank, even where the prefix index sees no link between its requests; it moves when its rank is
overloaded or gone; entries expire; the outcomes are counted for /metrics."""

from __future__ import annotations

import random

from apps.routing.decision.config import RouterConfig
from apps.routing.decision.router import Router
from apps.routing.decision.sessions import SessionTable, session_of
from tests.routing.helpers import Clock, targets, use_clock, worker_view


def router(dp: int = 4, clock: Clock | None = None) -> Router:
    r = Router(RouterConfig(policy="round_robin"), rng=random.Random(0))
    r.fleet.put(worker_view(1, dp_size=dp))
    if clock is not None:
        use_clock(r.fleet.all_targets(), clock)
        r.sessions.clock = clock
    return r


def test_the_header_names_the_session_before_the_user_field():
    assert session_of({"user": "ann"}, [(b"X-Session-ID", b"s-1")]) == "h:s-1"
    assert session_of({"user": "ann"}, []) == "u:ann"
    assert session_of({"user": 7}, [(b"x-other", b"v")]) is None
    assert session_of({}, [(b"x-session-id", b"")]) is None


def test_a_session_stays_where_it_started_though_its_prompts_share_nothing():
    r = router()
    first = r.route({"prompt": "alpha"}, False, None, session="h:s")
    first.finish(ok=True)
    keys = set()
    for i in range(6):  # round robin alone would visit every rank
        d = r.route({"prompt": f"unrelated {i}"}, False, None, session="h:s")
        keys.add(d.target.key)
        d.finish(ok=True)
    assert keys == {first.target.key}
    assert (r.sessions.kept, r.sessions.started, r.sessions.moved) == (6, 1, 0)


def test_an_overloaded_or_gone_rank_lets_the_session_move():
    r = router(dp=2)
    home = r.route({"prompt": "a"}, False, None, session="u:bob")
    busy = [home.target.load.begin(100, 0) for _ in range(6)]  # 6 in flight there, 0 elsewhere
    moved = r.route({"prompt": "b"}, False, None, session="u:bob")
    assert moved.target is not home.target and r.sessions.moved == 1
    moved.finish(ok=True)
    for ticket in busy:
        home.target.load.end(ticket)
    home.finish(ok=True)
    # its new rank goes down: the session chooses again among what is left
    r.fleet.workers[1].healthy = False
    r.fleet.put(worker_view(2, dp_size=1))
    again = r.route({"prompt": "c"}, False, None, session="u:bob")
    assert again.target.worker.worker_id == 2


def test_sessions_expire_after_their_ttl_and_the_table_is_bounded():
    clock = Clock()
    table = SessionTable(ttl_s=10.0, max_sessions=3, clock=clock)
    ts = targets(2, clock=clock)
    table.record("a", ts[0].key, kept=False)
    assert table.home("a", ts) is ts[0]
    clock.now += 11
    assert table.home("a", ts) is None and table.active() == 0
    for name in "bcde":
        table.record(name, ts[1].key, kept=False)
    assert table.active() == 3 and table.home("b", ts) is None  # the oldest went first


def test_session_outcomes_are_on_metrics():
    from apps.routing.metrics import render_metrics

    r = router()
    for _ in range(2):
        r.route({"prompt": "x"}, False, None, session="h:m").finish(ok=True)
    text = render_metrics(r).decode()
    assert "dpmesh_router_sessions 1.0" in text
    assert 'dpmesh_router_session_requests_total{outcome="kept"} 1.0' in text
    assert 'dpmesh_router_session_requests_total{outcome="started"} 1.0' in text


async def test_the_endpoint_reads_the_session_from_the_header_or_the_user_field():
    """Through the router's ASGI app, to a stand-in engine: one X-Session-ID stays on one rank
    of four though round robin would visit all; the OpenAI ``user`` field does the same."""
    import httpx

    from controlplane import http as http_client
    from controlplane.asgi import build_application
    from harness.standin import StandIn

    r = Router(RouterConfig(policy="round_robin"), rng=random.Random(0))
    with StandIn(dp_size=4).start() as engine:
        from apps.routing.decision.fleet import WorkerView

        r.fleet.put(
            WorkerView(1, engine.url, "", "standin", {"standin"}, 4, True, None, None, None)
        )
        app = httpx.ASGITransport(app=build_application(r))
        async with httpx.AsyncClient(transport=app, base_url="http://localhost") as client:
            body = {"model": "standin", "prompt": "hi", "max_tokens": 1}
            by_header = {
                (
                    await client.post("/v1/completions", json=body, headers={"X-Session-ID": "a"})
                ).headers["x-routed-target"]
                for _ in range(4)
            }
            by_user = {
                (await client.post("/v1/completions", json={**body, "user": "b"})).headers[
                    "x-routed-target"
                ]
                for _ in range(4)
            }
            plain = {
                (await client.post("/v1/completions", json=body)).headers["x-routed-target"]
                for _ in range(4)
            }
        await http_client.client.aclose()
    assert len(by_header) == 1 and len(by_user) == 1 and len(plain) == 4
