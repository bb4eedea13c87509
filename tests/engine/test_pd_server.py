"""Prefill/decode disaggregation over real HTTP (engine/server/pd.py): a ``--disaggregation-mode
prefill`` engine and a ``decode`` one (tiny model, fp32, DP 2 each, real processes), driven with
vLLM's two-step ``kv_transfer_params`` as vllm-router sends them; the decode leg's greedy output
equals an ordinary request's, and nothing stays held."""

from __future__ import annotations

import json
import random
import shutil
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from engine import kv_transfer
from harness.procs import free_port, metrics, start, start_engine, wait_for

pytestmark = pytest.mark.slow

DP = 2
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron".split()
# what vllm-router's two-step mode sends the prefill worker (vLLM's toy proxy does the same)
PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@pytest.fixture(scope="module")
def pd(pd_engines):
    return pd_engines


def prompt_text(seed: int, words: int = 90) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def body_for(chat: bool, text: str, stream: bool = False, **extra) -> dict:
    body = {"model": "tiny", "max_tokens": 8, "temperature": 0, "stream": stream, **extra}
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    return body


def post(url: str, body: dict, chat: bool) -> httpx.Response:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return httpx.post(url + path, json=body, timeout=60)


def text_of(answer: dict, chat: bool) -> str:
    choice = answer["choices"][0]
    return choice["message"]["content"] if chat else choice["text"]


def streamed(response: httpx.Response, chat: bool) -> tuple[str, dict]:
    text, usage = [], None
    for event in response.text.split("\n\n"):
        if not event or event == "data: [DONE]":
            continue
        data = json.loads(event.removeprefix("data: "))
        if data.get("usage"):
            usage = data["usage"]
        for choice in data["choices"]:
            delta = choice.get("delta") or {}
            text.append((delta.get("content") or "") if chat else choice["text"])
    return "".join(text), usage


def prefill_leg(prefill, chat: bool, text: str, rank: int | None = None) -> dict:
    extra = {} if rank is None else {"data_parallel_rank": rank}
    body = body_for(chat, text, kv_transfer_params=PREFILL_PARAMS, **{**extra, "max_tokens": 1})
    r = post(prefill.url, body, chat)
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_host"] == "127.0.0.1"
    assert params["remote_dp_rank"] == int(r.headers["x-data-parallel-rank"])
    return params


def held_and_used(url: str) -> tuple[float, float]:
    m = metrics(url)
    held = sum(m.get(("kv_transfer_held_requests", r), 0) for r in range(DP))
    used = sum(m.get(("kv_blocks_used", r), 0) for r in range(DP))
    return held, used


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_the_two_step_exchange_decodes_as_one_engine_does(pd, chat, stream):
    prefill, decode = pd
    text = prompt_text(hash((chat, stream)) % 1000)
    params = prefill_leg(prefill, chat, text, rank=1)
    assert params["remote_dp_rank"] == 1 and len(params["remote_block_ids"]) >= 3
    r = post(decode.url, body_for(chat, text, stream, kv_transfer_params=params,
             **({"stream_options": {"include_usage": True}} if stream else {})), chat)  # fmt: skip
    assert r.status_code == 200, r.text
    got, usage = streamed(r, chat) if stream else (text_of(r.json(), chat), r.json()["usage"])
    # the single-role answer, from the prefill worker (it serves ordinary requests too)
    single = post(prefill.url, body_for(chat, text), chat).json()
    assert got == text_of(single, chat) and got
    assert usage["prompt_tokens"] == single["usage"]["prompt_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == params["remote_num_cached_tokens"]
    assert wait_for(lambda: held_and_used(prefill.url) == (0, 0), timeout=10), held_and_used(
        prefill.url
    )
    m = metrics(decode.url)
    assert sum(m.get(("kv_transfer_blocks_pulled", r), 0) for r in range(DP)) > 0


def test_a_second_decode_of_the_same_prefix_pulls_only_what_it_lacks(pd):
    prefill, decode = pd
    shared = prompt_text(4242, 120)
    pulled = lambda: sum(metrics(decode.url).get(("kv_transfer_blocks_pulled", r), 0)  # noqa: E731
                         for r in range(DP))  # fmt: skip
    before = pulled()
    params = prefill_leg(prefill, False, shared + " omega", rank=0)
    r = post(decode.url, body_for(False, shared + " omega", data_parallel_rank=0,
             kv_transfer_params=params), False)  # fmt: skip
    assert r.status_code == 200, r.text
    first = wait_for(lambda: pulled() - before, timeout=5)
    assert first >= 6
    params = prefill_leg(prefill, False, shared + " psi chi", rank=0)
    assert params["remote_num_cached_tokens"] > 0  # the prefill side hit its own cache
    r = post(decode.url, body_for(False, shared + " psi chi", data_parallel_rank=0,
             kv_transfer_params=params), False)  # fmt: skip
    assert r.status_code == 200, r.text
    assert (
        r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        == params["remote_num_cached_tokens"]
    )
    single = post(prefill.url, body_for(False, shared + " psi chi"), False).json()
    assert text_of(r.json(), False) == text_of(single, False)
    time.sleep(0.5)  # stats every 0.25 s
    assert pulled() - before - first <= 1  # at most the block the new suffix changed


def test_wrong_roles_bad_and_stale_parameters_are_400s_in_openai_shape(pd):
    prefill, decode = pd
    text = prompt_text(77)
    r = post(decode.url, body_for(False, text, kv_transfer_params=PREFILL_PARAMS), False)
    assert r.status_code == 400 and "--disaggregation-mode decode" in r.json()["error"]["message"]
    params = prefill_leg(prefill, False, text)
    r = post(prefill.url, body_for(False, text, kv_transfer_params=params), False)
    assert r.status_code == 400 and "asks for a decode worker" in r.json()["error"]["message"]
    bad = {**params, "remote_port": "eighty"}
    r = post(decode.url, body_for(False, text, kv_transfer_params=bad), False)
    assert r.status_code == 400 and "remote_port" in r.json()["error"]["message"]
    assert post(decode.url, body_for(False, text, kv_transfer_params=params), False).is_success
    # pulled once: the same parameters again hold nothing
    r = post(decode.url, body_for(False, text, kv_transfer_params=params), False)
    assert r.status_code == 400 and "no KV is held" in r.json()["error"]["message"], r.text
    assert wait_for(lambda: held_and_used(prefill.url) == (0, 0), timeout=10)
    assert wait_for(lambda: held_and_used(decode.url)[1] == 0, timeout=10)


def test_a_prefill_nobody_pulls_is_released_after_the_timeout(pd):
    prefill, _ = pd
    prefill_leg(prefill, True, prompt_text(99))
    assert held_and_used(prefill.url)[0] == 1 or wait_for(
        lambda: held_and_used(prefill.url)[0] == 1, timeout=2
    )
    assert wait_for(lambda: held_and_used(prefill.url) == (0, 0), timeout=10)


def ask_bootstrap(prefill, ask: dict) -> dict:
    port = sglang_fields(prefill, 0)["bootstrap_port"]
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        kv_transfer.send_frame(conn, ask)
        return kv_transfer.recv_frame(conn)


def test_a_router_releases_a_hold_whose_decode_will_not_come(pd):
    """The bootstrap listener's ``release`` (what our router sends when no decode leg will pull):
    by request id and rank (vLLM's protocol) or by room (SGLang's), the rank logs it and holds
    nothing; a release of nothing held is fine; a malformed one says what it needs."""
    prefill, _ = pd
    released = "its decode leg will not come"
    before = prefill.log().count(released)
    params = prefill_leg(prefill, False, prompt_text(4242))
    ask = {"op": "release", "request_id": params["remote_request_id"],
           "rank": params["remote_dp_rank"]}  # fmt: skip
    assert ask_bootstrap(prefill, ask) == {"ok": True}
    room = 4243  # rank 1 of 2
    r = post(prefill.url, body_for(False, prompt_text(4243), **sglang_fields(prefill, room)), False)
    assert r.status_code == 200, r.text
    assert ask_bootstrap(prefill, {"op": "release", "room": room}) == {"ok": True}
    # (a hold the 3 s KV timeout frees logs another line: only the release counts here)
    assert wait_for(lambda: prefill.log().count(released) == before + 2, timeout=10)
    assert wait_for(lambda: held_and_used(prefill.url)[0] == 0, timeout=10)
    assert ask_bootstrap(prefill, {"op": "release", "room": room}) == {"ok": True}  # gone now
    bad = ask_bootstrap(prefill, {"op": "release", "request_id": "x"})
    assert bad["ok"] is False and "'rank'" in bad["error"], bad
    assert ask_bootstrap(prefill, {"op": "release", "room": 1, "rank": 9})["ok"] is False


def test_server_info_and_kv_transfer_info_say_the_role_and_where_to_pull(pd):
    prefill, decode = pd
    info = httpx.get(prefill.url + "/server_info", timeout=10).json()
    assert info["disaggregation_mode"] == "prefill"
    assert all(r["kv_transfer_port"] > 0 for r in info["ranks"])
    kv = httpx.get(prefill.url + "/kv_transfer_info", timeout=10).json()
    assert kv["disaggregation_mode"] == "prefill" and kv["block_size"] == info["block_size"]
    assert [r["kv_transfer_port"] for r in kv["ranks"]] == [
        r["kv_transfer_port"] for r in info["ranks"]
    ]
    assert httpx.get(decode.url + "/server_info", timeout=10).json()["disaggregation_mode"] == (
        "decode"
    )


@pytest.fixture(scope="module")
def vllm_router(pd, tmp_path_factory):
    """vllm-router (PyPI, requirements.txt) in its vLLM prefill/decode mode in front of ours."""
    exe = shutil.which("vllm-router", path=str(Path(sys.executable).parent))
    assert exe, "vllm-router is a test dependency (requirements.txt)"
    prefill, decode = pd
    port = free_port()
    cmd = [exe, "--host", "127.0.0.1", "--port", str(port), "--vllm-pd-disaggregation",
           "--kv-connector", "nixl", "--prefill", prefill.url, "--decode", decode.url,
           "--policy", "round_robin", "--prometheus-port", str(free_port())]  # fmt: skip
    log = tmp_path_factory.mktemp("vllm-router") / "router.log"
    with start(cmd, f"http://127.0.0.1:{port}", log, timeout=60) as router:
        yield router


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_vllm_router_drives_our_prefill_and_decode_workers_unchanged(pd, vllm_router, chat, stream):
    prefill, decode = pd
    pulled = lambda: sum(metrics(decode.url).get(("kv_transfer_blocks_pulled", r), 0)  # noqa: E731
                         for r in range(DP))  # fmt: skip
    before = pulled()
    text = prompt_text(500 + 2 * chat + stream)
    r = post(vllm_router.url, body_for(chat, text, stream), chat)
    assert r.status_code == 200, f"{r.status_code} {r.text}\n{vllm_router.log()}"
    got = streamed(r, chat)[0] if stream else text_of(r.json(), chat)
    single = post(prefill.url, body_for(chat, text), chat).json()
    assert got == text_of(single, chat) and got
    assert wait_for(lambda: pulled() > before, timeout=5), "the decode worker pulled nothing"
    assert wait_for(lambda: held_and_used(prefill.url) == (0, 0), timeout=10)


def sglang_fields(prefill, room: int) -> dict:
    port = httpx.get(prefill.url + "/server_info", timeout=10).json()[
        "disaggregation_bootstrap_port"
    ]
    return {"bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": room}


def test_sglang_legs_sent_at_once_decode_as_one_engine_does(pd):
    prefill, decode = pd
    text = prompt_text(31337)
    room = 12345  # rank 1 of 2 (room % dp_size)
    body = body_for(False, text, **sglang_fields(prefill, room))
    with ThreadPoolExecutor(2) as pool:
        decoded = pool.submit(post, decode.url, body, False)  # the decode leg first
        time.sleep(0.3)
        prefilled = pool.submit(post, prefill.url, body, False)
        p, d = prefilled.result(), decoded.result()
    assert p.status_code == 200 and d.status_code == 200, (p.text, d.text)
    assert p.headers["x-data-parallel-rank"] == "1"
    assert p.json()["usage"]["completion_tokens"] == 1  # the prefill leg only prefills
    single = post(prefill.url, body_for(False, text), False).json()
    assert text_of(d.json(), False) == text_of(single, False)
    assert d.json()["usage"]["completion_tokens"] == 8
    assert wait_for(lambda: held_and_used(prefill.url) == (0, 0), timeout=10)


def test_a_sglang_decode_leg_whose_prefill_never_comes_fails_without_hanging(pd):
    prefill, decode = pd
    started = time.monotonic()
    body = body_for(False, prompt_text(8080), **sglang_fields(prefill, 777))
    r = post(decode.url, body, False)
    assert r.status_code == 400 and "no KV is held" in r.json()["error"]["message"], r.text
    assert time.monotonic() - started < 15  # the wait is --kv-transfer-timeout-secs (3 s here)
    assert wait_for(lambda: held_and_used(decode.url)[1] == 0, timeout=10)
    gone = {**body, "bootstrap_port": free_port()}
    r = post(decode.url, gone, False)
    assert r.status_code == 502 and "bootstrap" in r.json()["error"]["message"], r.text


@pytest.fixture(scope="module")
def sglang_router(pd, tmp_path_factory):
    """sglang-router (PyPI, requirements.txt) in its prefill/decode mode in front of ours."""
    exe = shutil.which("sglang-router", path=str(Path(sys.executable).parent))
    assert exe, "sglang-router is a test dependency (requirements.txt)"
    prefill, decode = pd
    bootstrap = str(sglang_fields(prefill, 0)["bootstrap_port"])
    port = free_port()
    cmd = [exe, "launch", "--host", "127.0.0.1", "--port", str(port), "--pd-disaggregation",
           "--prefill", prefill.url, bootstrap, "--decode", decode.url, "--policy", "round_robin",
           "--log-level", "warn", "--prometheus-port", str(free_port())]  # fmt: skip
    log = tmp_path_factory.mktemp("sglang-router") / "router.log"
    with start(cmd, f"http://127.0.0.1:{port}", log, timeout=60) as router:
        yield router


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_sglang_router_drives_our_prefill_and_decode_workers_unchanged(
    pd, sglang_router, chat, stream
):
    prefill, decode = pd
    pulled = lambda: sum(metrics(decode.url).get(("kv_transfer_blocks_pulled", r), 0)  # noqa: E731
                         for r in range(DP))  # fmt: skip
    before = pulled()
    text = prompt_text(900 + 2 * chat + stream)
    r = post(sglang_router.url, body_for(chat, text, stream), chat)
    assert r.status_code == 200, f"{r.status_code} {r.text}\n{sglang_router.log()}"
    got = streamed(r, chat)[0] if stream else text_of(r.json(), chat)
    single = post(prefill.url, body_for(chat, text), chat).json()
    assert got == text_of(single, chat) and got
    assert wait_for(lambda: pulled() > before, timeout=5), "the decode worker pulled nothing"
    assert wait_for(lambda: held_and_used(prefill.url) == (0, 0), timeout=10)


def test_a_prefill_worker_killed_before_the_pull_fails_the_decode_leg_with_a_502(
    pd, tmp_path_factory
):
    _, decode = pd
    with start_engine(tmp_path_factory.mktemp("doomed"), "--dp-size", "1", "--num-kv-blocks",
                      "64", "--disaggregation-mode", "prefill",
                      "--disaggregation-bootstrap-port", "0") as doomed:  # fmt: skip
        params = prefill_leg(doomed, False, prompt_text(1234))
        doomed.kill()
    r = post(decode.url, body_for(False, prompt_text(1234), kv_transfer_params=params), False)
    assert r.status_code == 502 and "pulling KV" in r.json()["error"]["message"], r.text
    assert wait_for(lambda: held_and_used(decode.url)[1] == 0, timeout=10)
    assert httpx.get(decode.url + "/health", timeout=5).status_code == 200


def test_a_client_gone_while_its_sglang_decode_waits_leaks_nothing_on_either_side(pd):
    prefill, decode = pd
    body = body_for(False, prompt_text(2468), **sglang_fields(prefill, 4242))
    with pytest.raises(httpx.ReadTimeout):  # the client gives up while the decode leg waits
        httpx.post(decode.url + "/v1/completions", json=body, timeout=0.5)
    assert post(prefill.url, body, False).status_code == 200  # the prefill comes after all
    assert wait_for(lambda: held_and_used(prefill.url) == (0, 0), timeout=10)
    assert wait_for(lambda: held_and_used(decode.url)[1] == 0, timeout=10)
    m = metrics(decode.url)
    assert all(m.get(("inflight_requests", r), 0) == 0 for r in range(DP))
