"""A real ``manage.py runengine --simulate`` over HTTP passes the engine's contract tests that do
not depend on what the model says: the tests of test_server_api.py run here again against a
simulated server (rank hints on every path, bad input, aborts, the openai client), and those of
test_kv_events.py and test_rank_failure.py with ``--simulate`` added to their engine. Then what
only a simulated server has: /server_info's ``simulate``, cached tokens on the pinned rank, exactly
max_tokens over HTTP, and no torch in the front or the ranks."""

import httpx
import pytest

from harness.procs import metrics, start_engine
from tests.engine import test_kv_events, test_rank_failure
from tests.engine.test_server_api import (  # noqa: F401  (collected here, against a sim engine)
    DP,
    MAX_MODEL_LEN,
    post,
    sse_events,
    test_aborted_streams_and_bad_input_leave_nothing_held,
    test_bad_input_gets_openai_error,
    test_invalid_rank_in_body_is_400,
    test_invalid_rank_in_header_is_400,
    test_openai_client_unmodified,
    test_requested_rank_serves,
    test_server_info_and_models,
    test_unhinted_requests_spread_over_ranks,
    test_wrong_method_and_path,
)

pytestmark = pytest.mark.slow

PROFILE = "h100-llama3.1-8b"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """test_server_api's engine, simulated: the same flags plus --simulate."""
    tmp = tmp_path_factory.mktemp("sim-engine")
    with start_engine(
        tmp,
        "--simulate",
        PROFILE,
        "--dp-size",
        str(DP),
        "--num-kv-blocks",
        "256",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-body-bytes",
        "65536",
    ) as server:
        yield server


def simulated(start):
    """``start_engine`` with ``--simulate cpu-tiny`` first: another test module's engine, run
    simulated."""
    return lambda tmp_path, *args, **kw: start(tmp_path, "--simulate", "cpu-tiny", *args, **kw)


def test_kv_events_follow_the_prefix_cache_simulated(tmp_path, monkeypatch):
    monkeypatch.setattr(test_kv_events, "start_engine", simulated(start_engine))
    test_kv_events.test_kv_events_follow_the_prefix_cache(tmp_path)


def test_dead_rank_fails_its_requests_and_health_simulated(tmp_path, monkeypatch):
    monkeypatch.setattr(test_rank_failure, "start_engine", simulated(start_engine))
    test_rank_failure.test_dead_rank_fails_its_requests_and_health(tmp_path)


def test_server_info_reports_the_simulation(engine):
    info = httpx.get(engine.url + "/server_info").json()
    sim = info["simulate"]
    assert sim["profile"] == PROFILE and sim["speedup"] == 1.0 and sim["sources"]
    assert sim["step_time"]["base_s"] == 6.48e-3 and sim["kv_tokens_per_rank"] == 450_907
    # the flags override the profile's capacity and length
    assert (info["dp_size"], info["num_kv_blocks_per_rank"]) == (DP, 256)
    assert (info["max_model_len"], info["vocab_size"]) == (MAX_MODEL_LEN, 4096)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_pinned_rank_holds_the_cached_prefix(engine, endpoint):
    words = " ".join(f"w{i}" for i in range(80))
    if endpoint == "chat":
        body = {"messages": [{"role": "user", "content": words}], "max_tokens": 3}
    else:
        body = {"prompt": words, "max_tokens": 3}

    def cached(rank: int) -> int:
        r = post(engine.url, endpoint, {**body, "data_parallel_rank": rank})
        assert r.status_code == 200 and r.headers["x-data-parallel-rank"] == str(rank)
        assert r.json()["usage"]["completion_tokens"] == 3
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    before = metrics(engine.url)
    assert cached(1) == 0
    hit = cached(1)
    assert hit > 0 and hit % 16 == 0  # whole blocks, on the rank that computed them
    assert cached(0) == 0  # the other rank never saw the prompt
    after = metrics(engine.url)
    assert after[("cached_tokens", 1)] - before[("cached_tokens", 1)] == hit
    assert after[("cached_tokens", 0)] == before[("cached_tokens", 0)]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("prompt", ["a text prompt", [11, 12, 13, 14, 15]])
def test_exactly_max_tokens_over_http(engine, stream, prompt):
    body = {"prompt": prompt, "max_tokens": 37, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    r = post(engine.url, "completions", body)
    assert r.status_code == 200, r.text
    if stream:
        events = sse_events(r.text)
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        use = events[-1]["usage"]
    else:
        assert r.json()["choices"][0]["finish_reason"] == "length"
        use = r.json()["usage"]
    assert use["completion_tokens"] == 37


def test_neither_front_nor_ranks_load_torch(engine):
    pids = [engine.proc.pid] + [
        r["pid"] for r in httpx.get(engine.url + "/server_info").json()["ranks"]
    ]
    for pid in pids:
        with open(f"/proc/{pid}/maps") as fh:
            maps = fh.read()
        assert "libtorch" not in maps, f"process {pid} has torch loaded"
