"""OpenTelemetry traces through a real router and a real engine of ours (DP 2), exported over
OTLP/HTTP to a real receiver (harness/otlp_sink.py, the SDK's own protobuf): a client's
``traceparent`` is the parent of the router's request span; admission, routing and the attempt
are its children; the engine's request span is the attempt's child, with queue, prefill (its
chunks) and decode under it: one trace id throughout, the times in order, the outcome (tokens,
cached tokens, miss reasons) on the attempt. With no endpoint configured nothing is exported
(the CPU side of that is a benchmark: bench/runs/stream_relay.py)."""

from __future__ import annotations

import json
import secrets
import sys

import httpx
import pytest

from harness.procs import free_port, start, wait_for
from tests.support.router_checks import healthy_targets, start_router

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("traces")
    out = tmp / "spans.jsonl"
    port = free_port()
    sink_cmd = [sys.executable, "-m", "harness.otlp_sink", "--port", str(port), "--out", str(out)]
    with start(sink_cmd, f"http://127.0.0.1:{port}", tmp / "sink.log", timeout=60):
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
               "OTEL_BSP_SCHEDULE_DELAY": "100"}  # fmt: skip
        engine_port = free_port()
        engine_cmd = [sys.executable, "manage.py", "runengine", "--port", str(engine_port),
                      "--dp-size", "2", "--threads-per-rank", "1"]  # fmt: skip
        with start(engine_cmd, f"http://127.0.0.1:{engine_port}", tmp / "engine.log",
                   timeout=240, env=env) as engine:  # fmt: skip
            with start_router(tmp, [engine.url], "router", env=env) as router:
                assert wait_for(lambda: len(healthy_targets(router.url)) == 2, timeout=60)
                yield router, out


def trace_of(out, trace_id: str, want: int, timeout: float = 20.0) -> dict[str, dict]:
    """The spans of ``trace_id`` by name, once at least ``want`` have arrived."""

    def spans():
        if not out.exists():
            return []
        lines = out.read_text().splitlines()
        return [s for s in map(json.loads, lines) if s["trace_id"] == trace_id]

    assert wait_for(lambda: len(spans()) >= want, timeout=timeout), spans()
    got = spans()
    by_name = {s["name"]: s for s in got}
    assert len(by_name) == len(got), [s["name"] for s in got]  # one of each
    return by_name


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_is_one_trace_through_router_and_engine(traced, stream):
    router, out = traced
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    headers = {"traceparent": f"00-{trace_id}-{client_span}-01"}
    body = {"model": "tiny", "prompt": " ".join(f"word{i}" for i in range(80)),
            "max_tokens": 8, "stream": stream}  # fmt: skip
    r = httpx.post(router.url + "/v1/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200
    spans = trace_of(out, trace_id, 8)
    request, admission = spans["dpmesh.router.request"], spans["dpmesh.router.admission"]
    route, attempt = spans["dpmesh.router.route"], spans["dpmesh.router.attempt"]
    engine = spans["dpmesh.engine.request"]
    queue, prefill = spans["dpmesh.engine.queue"], spans["dpmesh.engine.prefill"]
    decode = spans["dpmesh.engine.decode"]
    # the parents: client -> router request -> its steps; the attempt -> the engine's request
    assert request["parent_span_id"] == client_span
    assert request["service"] == "dpmesh-router" and engine["service"] == "dpmesh-engine"
    for child in (admission, route, attempt):
        assert child["parent_span_id"] == request["span_id"], child["name"]
    assert engine["parent_span_id"] == attempt["span_id"]
    for child in (queue, prefill, decode):
        assert child["parent_span_id"] == engine["span_id"], child["name"]
    # the times, in order
    assert request["start_ns"] <= admission["start_ns"] <= route["start_ns"] <= attempt["start_ns"]
    assert attempt["start_ns"] <= engine["start_ns"] <= engine["end_ns"] <= attempt["end_ns"]
    assert queue["end_ns"] <= prefill["start_ns"] + 1 and prefill["end_ns"] <= decode["start_ns"]
    assert decode["end_ns"] == engine["end_ns"] and attempt["end_ns"] <= request["end_ns"]
    # what each says
    assert route["attributes"]["dpmesh.target"] == r.headers["x-routed-target"]
    assert "dpmesh.predicted_cached_tokens" in route["attributes"]
    usage = attempt["attributes"]
    assert usage["dpmesh.ok"] is True and usage["gen_ai.usage.output_tokens"] == 8
    assert usage["gen_ai.usage.input_tokens"] == engine["attributes"]["gen_ai.usage.input_tokens"]
    cached = usage["dpmesh.cached_tokens"]
    reasons = {k: v for k, v in usage.items() if k.startswith("dpmesh.miss.")}
    assert sum(reasons.values()) == usage["gen_ai.usage.input_tokens"] - cached
    chunks = [e for e in prefill["events"] if e["name"] == "chunk"]
    assert chunks and sum(e["attributes"]["tokens"] for e in chunks) == (
        usage["gen_ai.usage.input_tokens"] - cached
    )
    assert request["attributes"]["http.response.status_code"] == 200
    if stream:
        (first,) = [e for e in attempt["events"] if e["name"] == "first_token"]
        assert prefill["end_ns"] <= first["time_ns"] <= attempt["end_ns"]


def test_a_request_without_traceparent_starts_its_own_trace(traced):
    router, out = traced
    before = out.read_text().count("\n") if out.exists() else 0
    body = {"model": "tiny", "prompt": "no parent here", "max_tokens": 2}
    assert httpx.post(router.url + "/v1/completions", json=body, timeout=60).status_code == 200

    def new_roots():
        lines = out.read_text().splitlines()[before:] if out.exists() else []
        spans = map(json.loads, lines)
        return [s for s in spans if s["name"] == "dpmesh.router.request"
                and s["parent_span_id"] is None]  # fmt: skip

    assert wait_for(lambda: new_roots(), timeout=20)
