"""Every path users send, through a real router to a real engine of ours (DP 2):

- the pin check (apps/replicas/pin_check.py): the engine drops the rank pin on one path
  (``--debug-ignore-rank-on``, as SGLang 0.5.19 does on /v1/responses); discovery finds exactly
  that path, /workers and /metrics say so, requests there are routed without a predicted hit,
  while the other path keeps its hits;
- the pooling and scoring paths pass through (routed by load, nothing predicted cached): the
  engine's /v1/embeddings answer as it is, an engine's 404 on a path it does not serve as it is;
- tenants: a router with per-tenant limits answers the limited tenant 429 with Retry-After,
  serves the others, and loses nothing; with ``--tenant-cache-salt`` tenants share no prefix."""

from __future__ import annotations

import httpx
import pytest

from harness.procs import start_engine, wait_for
from tests.support.router_checks import counter, start_router

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pins")
    with start_engine(tmp, "--dp-size", "2", "--debug-ignore-rank-on", CHAT) as engine:
        with start_router(tmp, [engine.url], "router") as router:
            workers = lambda: httpx.get(router.url + "/workers", timeout=10).json()["workers"]  # noqa: E731
            assert wait_for(lambda: workers() and workers()[0]["pins"], timeout=60)
            yield engine, router


def predicted_after(url: str, path: str, body: dict) -> tuple[float, int]:
    """(the router's predicted cached tokens, the engine's reported ones) for one request."""
    name = "dpmesh_router_predicted_cached_tokens_total"
    before = counter(url, name)
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return counter(url, name) - before, r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_the_path_that_drops_the_pin_is_found_and_shown(fleet):
    engine, router = fleet
    (worker,) = httpx.get(router.url + "/workers", timeout=10).json()["workers"]
    assert worker["pins"] == {COMPLETIONS: True, CHAT: False}
    served = worker["server_info"]["pin_check"]
    assert served[COMPLETIONS]["served"] == [0, 0, 1, 1]
    text = httpx.get(router.url + "/metrics", timeout=10).text
    assert f'dpmesh_router_pin_honoured{{path="{CHAT}",worker="{engine.url}"}} 0.0' in text
    assert f'dpmesh_router_pin_honoured{{path="{COMPLETIONS}",worker="{engine.url}"}} 1.0' in text


def test_no_hit_is_predicted_where_the_pin_is_dropped(fleet):
    _, router = fleet
    words = " ".join(f"pin{i % 11} check{i}" for i in range(120))
    chat = {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": words}]}
    for _ in range(3):
        predicted, _ = predicted_after(router.url, CHAT, chat)
        assert predicted == 0
    completion = {"model": "tiny", "max_tokens": 1, "prompt": "other " + words}
    predicted_after(router.url, COMPLETIONS, completion)
    predicted, reported = predicted_after(router.url, COMPLETIONS, completion)
    assert predicted > 0 and predicted == reported  # the pin holds here: placement believed


def test_embeddings_pass_through_the_router_with_their_load_counted(fleet):
    import openai

    from tests.support.router_checks import assert_idle

    engine, router = fleet
    inputs = ["through the router", "and straight"]
    direct = httpx.post(engine.url + "/v1/embeddings", json={"input": inputs}, timeout=30).json()
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="none")
    before = counter(router.url, "dpmesh_router_requests_total")
    routed = client.embeddings.with_raw_response.create(model="tiny", input=inputs)
    assert routed.headers["x-routed-target"].startswith(engine.url)
    got = routed.parse()
    for mine, theirs in zip(got.data, direct["data"], strict=True):
        assert (
            max(abs(a - b) for a, b in zip(mine.embedding, theirs["embedding"], strict=True)) < 1e-5
        )
    assert counter(router.url, "dpmesh_router_requests_total") - before == 1
    predicted = counter(router.url, "dpmesh_router_predicted_cached_tokens_total")
    client.embeddings.create(model="tiny", input=inputs)
    assert counter(router.url, "dpmesh_router_predicted_cached_tokens_total") == predicted
    assert_idle(router.url)
    # a path the engine does not serve: its own 404, in OpenAI's error shape
    r = httpx.post(router.url + "/v1/rerank", json={"query": "q", "documents": ["d"]}, timeout=30)
    assert r.status_code == 404 and "error" in r.json()
    assert_idle(router.url)


def test_a_limited_tenant_gets_429s_and_the_others_are_served(fleet, tmp_path):
    from tests.support.router_checks import assert_idle, healthy_targets

    engine, _ = fleet
    flags = ("--tenant-limit", "small=2", "--tenant-limit", "thrifty=100:40", "--tenant-cache-salt")
    with start_router(tmp_path, [engine.url], "limited", *flags) as router:
        # ready when it answers /metrics; its engine is found a moment later (503 until then)
        assert wait_for(lambda: healthy_targets(router.url), timeout=60)
        body = {"model": "tiny", "prompt": "a tenant's request", "max_tokens": 2}

        def post(tenant: str, prompt: str = "a tenant's request") -> httpx.Response:
            return httpx.post(router.url + COMPLETIONS, json={**body, "prompt": prompt},
                              timeout=60, headers={"X-Tenant-Id": tenant})  # fmt: skip

        assert [post("small").status_code for _ in range(2)] == [200, 200]
        refused = post("small")
        assert refused.status_code == 429, refused.text
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.headers["x-ratelimit-limit-requests"] == "2"
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert all(post("other").status_code == 200 for _ in range(4))  # not limited
        long = " ".join(f"word{i}" for i in range(60))
        assert post("thrifty", long).status_code == 200  # spends more than its 40 tokens...
        tokens = post("thrifty")
        assert tokens.status_code == 429 and tokens.json()["error"]["type"] == "tokens"
        # --tenant-cache-salt: each tenant's prefixes are its own, in the engine and the router
        shared = " ".join(f"shared{i} prefix" for i in range(60))

        def cached(tenant: str) -> int:
            r = post(tenant, shared)
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert cached("acme") == 0 and cached("acme") > 0
        assert cached("globex") == 0
        text = httpx.get(router.url + "/metrics", timeout=10).text
        assert 'dpmesh_router_tenant_rate_limited_total{kind="requests",tenant="small"} 1.0' in text
        assert_idle(router.url)


def test_a_responses_continuation_goes_where_its_conversation_is(fleet):
    """/v1/responses through the router: routed on its input, and each continuation (stream or
    not) sent to the rank that served the response it continues, where its prefix is cached."""
    import openai

    from tests.support.router_checks import assert_idle

    _, router = fleet
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="none")
    words = " ".join(f"colour{i}" for i in range(40))
    first = client.responses.with_raw_response.create(
        model="tiny", input=words, max_output_tokens=4, temperature=0)  # fmt: skip
    where, previous = first.headers["x-routed-target"], first.parse()
    for stream in (False, True, False):
        raw = client.responses.with_raw_response.create(
            model="tiny", input="go on", previous_response_id=previous.id, max_output_tokens=4,
            temperature=0, stream=stream,
        )  # fmt: skip
        assert raw.headers["x-routed-target"] == where
        if stream:
            events = list(raw.parse())
            assert events[-1].type == "response.completed"
            answer = events[-1].response
        else:
            answer = raw.parse()
        assert answer.usage.input_tokens_details.cached_tokens > 0
        previous = answer
    assert_idle(router.url)
