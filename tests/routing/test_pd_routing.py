"""Prefill/decode routing (apps/routing/proxy/pd.py) over real processes: our engine in both
roles (DP 2 each) behind ``runrouter --pd-disaggregation``, with vLLM's two-step protocol
(``--pd-protocol vllm``) and SGLang's bootstrap protocol (``--pd-protocol sglang``, and what
``auto`` picks when both roles are our engine)."""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager

import httpx
import pytest

from harness.procs import metrics, start_engine, wait_for
from tests.support.router_checks import assert_idle, counter, start_router

pytestmark = pytest.mark.slow

DP = 2
PROTOCOLS = ("vllm", "sglang")
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron".split()


@pytest.fixture(scope="module")
def pd(pd_engines, tmp_path_factory):
    """The shared prefill and decode engines (tests/conftest.py) behind two routers of ours in
    prefill/decode mode, one per protocol."""
    prefill, decode = pd_engines
    tmp = tmp_path_factory.mktemp("pd")
    pd_flags = ("--pd-disaggregation", "--prefill", prefill.url, "--decode", decode.url)
    with ExitStack() as stack:
        routers = {
            protocol: stack.enter_context(
                start_router(tmp, [], f"router-{protocol}", *pd_flags, "--pd-protocol", protocol)
            )
            for protocol in ("vllm", "sglang")
        }
        for router in routers.values():
            assert wait_for(lambda r=router: _targets(r.url) == 2 * DP, timeout=60)
        yield prefill, decode, routers


def _targets(url: str) -> int:
    return len(httpx.get(url + "/health", timeout=5).json().get("targets", []))


def prompt_text(seed: int, words: int = 90) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def body_for(chat: bool, text: str, stream: bool = False) -> dict:
    body = {"model": "tiny", "max_tokens": 8, "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    return body


def post(url: str, body: dict, chat: bool) -> httpx.Response:
    return httpx.post(url + ("/v1/chat/completions" if chat else "/v1/completions"), json=body,
                      timeout=60)  # fmt: skip


def answer_of(response: httpx.Response, chat: bool, stream: bool) -> tuple[str, dict]:
    if not stream:
        data = response.json()
        choice = data["choices"][0]
        return (choice["message"]["content"] if chat else choice["text"]), data["usage"]
    text, usage = [], None
    for event in response.text.split("\n\n"):
        if not event or event == "data: [DONE]":
            continue
        data = json.loads(event.removeprefix("data: "))
        usage = data.get("usage") or usage
        for choice in data["choices"]:
            delta = choice.get("delta") or {}
            text.append((delta.get("content") or "") if chat else choice["text"])
    return "".join(text), usage


def prompts_per_rank(url: str) -> list[float]:
    m = metrics(url)
    return [m.get(("prompt_tokens", r), 0.0) for r in range(DP)]


@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_both_legs_through_our_router_decode_as_one_engine_does(pd, protocol, chat, stream):
    prefill, decode, routers = pd
    router = routers[protocol]
    # a seed of its own (no other test's: a shared prompt would be cached; hash() of a str
    # changes from run to run and once matched another case's seed mod 10,000)
    text = prompt_text(40_000 + 4 * PROTOCOLS.index(protocol) + 2 * chat + stream)
    before = prompts_per_rank(prefill.url)
    r = post(router.url, body_for(chat, text, stream), chat)
    assert r.status_code == 200, r.text
    got, usage = answer_of(r, chat, stream)
    single = post(prefill.url, body_for(chat, text), chat).json()  # the co-located answer
    assert got == answer_of_single(single, chat) and got
    # the prefill rank the router chose is the one whose metrics counted the prompt
    chosen = int(r.headers["x-prefill-target"].rsplit("@", 1)[1])
    counted = [a - b for a, b in zip(prompts_per_rank(prefill.url), before, strict=True)]
    assert counted[chosen] >= usage["prompt_tokens"], (counted, chosen)
    assert r.headers["x-routed-target"].startswith(decode.url)
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0  # nothing was cached anywhere
    assert wait_for(lambda: _held(prefill.url) == 0, timeout=10)


def answer_of_single(answer: dict, chat: bool) -> str:
    choice = answer["choices"][0]
    return choice["message"]["content"] if chat else choice["text"]


def _held(url: str) -> float:
    m = metrics(url)
    return sum(m.get(("kv_transfer_held_requests", r), 0) + m.get(("kv_blocks_used", r), 0)
               for r in range(DP))  # fmt: skip


@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
def test_a_shared_prefix_keeps_its_prefill_rank_and_reports_the_prefill_sides_hits(pd, protocol):
    prefill, _, routers = pd
    shared = prompt_text(41_000 + PROTOCOLS.index(protocol), 120)
    seen, cached = set(), []
    for i in range(6):
        r = post(routers[protocol].url, body_for(False, f"{shared} {WORDS[i]} {WORDS[-i]}"), False)
        assert r.status_code == 200, r.text
        seen.add(r.headers["x-prefill-target"])
        cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert len(seen) == 1, seen  # cache-aware on the prefill side
    assert cached[0] == 0 and all(c >= 7 * 16 for c in cached[1:]), cached


def test_no_worker_of_a_role_is_a_503_not_a_hang(pd, tmp_path):
    prefill, _, _ = pd
    with start_router(tmp_path, [], "lonely", "--pd-disaggregation", "--prefill",
                      prefill.url) as router:  # fmt: skip
        assert wait_for(lambda: _targets(router.url) == DP, timeout=60)
        r = post(router.url, body_for(False, "hello there"), False)
        assert r.status_code == 503 and "no available decode worker" in r.text, r.text
        assert wait_for(lambda: _held(prefill.url) == 0, timeout=10)


@pytest.mark.parametrize("protocol", ["auto", "vllm"])
def test_a_prefill_worker_killed_under_load_loses_no_request(pd, tmp_path, protocol):
    """Two prefill workers, one SIGKILLed while requests flow: those sent to it go to the other
    (in one step, the default here, with the decode leg again and a new room; in two, the
    prefill leg alone), none hangs, nothing stays held."""
    prefill, decode, _ = pd
    with start_engine(tmp_path, "--dp-size", "1", "--num-kv-blocks", "64",
                      "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", "0",
                      name="doomed") as doomed:  # fmt: skip
        flags = ("--pd-disaggregation", "--prefill", prefill.url, "--prefill", doomed.url,
                 "--decode", decode.url, "--policy", "round_robin",
                 "--pd-protocol", protocol)  # fmt: skip
        with start_router(tmp_path, [], "two-prefills", *flags) as router:
            assert wait_for(lambda: _targets(router.url) == 2 * DP + 1, timeout=60)
            for i in range(3):
                r = post(router.url, body_for(False, prompt_text(5000 + i)), False)
                assert r.status_code == 200, r.text
            doomed.kill()
            for i in range(6):
                r = post(router.url, body_for(False, prompt_text(6000 + i)), False)
                assert r.status_code == 200, r.text
                assert r.headers["x-prefill-target"].startswith(prefill.url)
            log = router.log()  # the retry ran, not only the health check
            assert "another prefill worker" in log
            assert ("both legs again" in log) == (protocol == "auto"), log
    assert wait_for(lambda: _held(prefill.url) == 0, timeout=10)
    assert wait_for(lambda: _held(decode.url) == 0, timeout=10)


@contextmanager
def _a_second_decode_worker(pd, tmp_path, name: str):
    """(a decode worker of its own, DP 1, to kill; a router with it beside the shared one, the
    decode legs round robin between them)."""
    prefill, decode, _ = pd
    role = ("--disaggregation-mode", "decode")
    with start_engine(tmp_path, "--dp-size", "1", *role, name=name) as doomed:
        flags = ("--pd-disaggregation", "--prefill", prefill.url, "--decode", decode.url,
                 "--decode", doomed.url, "--decode-policy", "round_robin")  # fmt: skip
        with start_router(tmp_path, [], f"{name}-router", *flags) as router:
            assert wait_for(lambda: _targets(router.url) == 2 * DP + 1, timeout=60)
            yield doomed, router


def test_a_decode_worker_gone_before_its_leg_goes_to_another_with_the_same_room(pd, tmp_path):
    """One step (``auto`` for our engine in both roles): a decode worker killed between requests,
    its death not yet noticed. The decode leg sent to it goes to the other decode worker, which
    pulls the same room's KV from the prefill; the prefill ran once for each request."""
    prefill, decode, _ = pd
    with _a_second_decode_worker(pd, tmp_path, "gone-decode") as (doomed, router):
        for i in range(2):  # round robin: one decode leg on each worker
            r = post(router.url, body_for(False, prompt_text(7500 + i)), False)
            assert r.status_code == 200, r.text
        doomed.kill()
        before = sum(metrics(prefill.url).get(("requests", r), 0) for r in range(DP))
        for i in range(4):
            r = post(router.url, body_for(i % 2 == 1, prompt_text(7600 + i)), i % 2 == 1)
            assert r.status_code == 200, r.text
            assert r.headers["x-routed-target"].startswith(decode.url)
        after = sum(metrics(prefill.url).get(("requests", r), 0) for r in range(DP))
        assert after - before == 4  # no prefill ran twice
        assert "another decode worker, the same room" in router.log()
        assert_idle(router.url, timeout=10)
    assert wait_for(lambda: _held(prefill.url) == 0, timeout=10)


def test_a_decode_worker_killed_mid_workload_hangs_nothing_and_leaks_nothing(pd, tmp_path):
    """Two decode workers, one SIGKILLed while streams run on it: its streams end (an error event
    or a retry elsewhere), none hangs; requests sent 5 s later all succeed; nothing stays held on
    the prefill side (a prefill whose decode died is retried elsewhere or released, at once or at
    the KV timeout, 3 s here) and the router's load is back to 0."""
    prefill, decode, _ = pd
    with _a_second_decode_worker(pd, tmp_path, "doomed-decode") as (doomed, router):

        def one(i: int) -> str:
            body = {**body_for(False, prompt_text(7000 + i), stream=True), "max_tokens": 48,
                    "ignore_eos": True}  # fmt: skip
            r = httpx.post(router.url + "/v1/completions", json=body, timeout=60)
            return f"{r.status_code} {'error' if 'error' in r.text else 'ok'}"

        with ThreadPoolExecutor(6) as pool:
            jobs = [pool.submit(one, i) for i in range(12)]
            time.sleep(1.0)
            doomed.kill()
            outcomes = [job.result(timeout=90) for job in jobs]  # none hangs
        assert "200 ok" in outcomes, outcomes
        time.sleep(5)
        for i in range(6):
            r = post(router.url, body_for(False, prompt_text(8000 + i)), False)
            assert r.status_code == 200, r.text
            assert r.headers["x-routed-target"].startswith(decode.url)
        assert_idle(router.url, timeout=10)
    assert wait_for(lambda: _held(prefill.url) == 0, timeout=15), _held(prefill.url)
    assert wait_for(lambda: _held(decode.url) == 0, timeout=10)


def test_a_prefill_whose_decode_leg_will_not_come_is_released_at_once(pd, tmp_path):
    """The only decode worker SIGKILLed, its death not yet noticed: in either protocol the prefill
    runs and holds its blocks, the decode leg fails with nowhere else to go (an error, not a
    hang), and the router tells the prefill worker's bootstrap listener to give the blocks back
    (the engine logs it), not leaving them to the KV timeout."""
    prefill, _, _ = pd
    role = ("--disaggregation-mode", "decode")
    released = "its decode leg will not come"
    with start_engine(tmp_path, "--dp-size", "1", *role, name="only-decode") as doomed, \
            ExitStack() as stack:  # fmt: skip
        flags = ("--pd-disaggregation", "--prefill", prefill.url, "--decode", doomed.url)
        routers = [stack.enter_context(start_router(tmp_path, [], f"only-decode-{p}", *flags,
                                                    "--pd-protocol", p))
                   for p in ("auto", "vllm")]  # fmt: skip
        for router in routers:
            assert wait_for(lambda r=router: _targets(r.url) == DP + 1, timeout=60)
            r = post(router.url, body_for(False, prompt_text(7700)), False)
            assert r.status_code == 200, r.text
        doomed.kill()
        before = prefill.log().count(released)
        for i, router in enumerate(routers):
            r = post(router.url, body_for(False, prompt_text(7800 + i)), False)
            assert r.status_code in (502, 503) and "error" in r.json(), r.text
            assert_idle(router.url, timeout=10)
        assert wait_for(lambda: prefill.log().count(released) >= before + 2, timeout=10), (
            prefill.log()[-3000:]
        )
    assert wait_for(lambda: _held(prefill.url) == 0, timeout=10)


def test_workers_and_metrics_say_each_workers_role(pd):
    prefill, decode, routers = pd
    url = routers["vllm"].url
    workers = httpx.get(url + "/workers", timeout=10).json()["workers"]
    roles = {w["url"]: w["role"] for w in workers}
    assert roles == {prefill.url: "prefill", decode.url: "decode"}
    assert all(w["pins"] == {} for w in workers)  # a PD leg is not probed (pin_check.py)
    text = httpx.get(url + "/metrics", timeout=10).text
    assert f'dpmesh_router_target_role{{rank="1",role="decode",target="{decode.url}@1"' in text


def test_a_session_keeps_both_of_its_legs_where_they_started(pd):
    """Unrelated prompts of one session (``X-Session-ID``): each leg stays on the rank it started
    on, though nothing in the prompts would keep it there."""
    _, _, routers = pd
    url = routers["vllm"].url
    kept = lambda: counter(url, "dpmesh_router_session_requests_total")  # noqa: E731
    before, legs = kept(), set()
    for i in range(4):
        r = httpx.post(url + "/v1/completions", json=body_for(False, prompt_text(9100 + i)),
                       headers={"X-Session-ID": "pd-session-1"}, timeout=60)  # fmt: skip
        assert r.status_code == 200, r.text
        legs.add((r.headers["x-prefill-target"], r.headers["x-routed-target"]))
    assert len(legs) == 1, legs
    assert kept() - before == 8  # each leg of each request went through its own session entry
