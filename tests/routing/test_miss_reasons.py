"""Miss reasons through a real router in front of a real engine of ours (DP 2, a copy of the tiny
model whose chat template drops the reasoning of earlier assistant turns, as Qwen3's does):

- a session's second turn, whose template rewrote the first turn's answer, is reported as
  diverged at the token where the two renderings part;
- a prefix the engine evicted (a small KV pool, its KV events followed) as evicted;
- a hot prefix copied to the other rank under load (its rank's 3 seats taken) as placed
  elsewhere;
- a salted request whose prompt is cached without the salt as another tenant key;
- in every answer the reasons add up to the prompt tokens minus the engine's cached ones, the
  router's /metrics counts them per target, and the engine counts the router's prediction
  against what it had."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from apps.routing.decision.misses import REASONS
from apps.routing.decision.request_shape import load_tokenizer
from harness.procs import start_engine, wait_for
from tests.support.router_checks import ADMIN_KEY, counter, healthy_targets, prom, start_router

pytestmark = pytest.mark.slow

BLOCK = 16
# earlier assistant turns lose what precedes '</think>' once a later user turn follows them
REASONING_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- set content = m['content'] -%}"
    "{%- if m['role'] == 'assistant' and loop.index0 < ns.last_user and '</think>' in content -%}"
    "{%- set content = content.split('</think>')[-1] -%}"
    "{%- endif -%}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def reasoning_model(tmp: Path) -> Path:
    from engine.tiny import ensure_tiny_model

    source = ensure_tiny_model()
    model = tmp / "tiny-reasoning"
    model.mkdir()
    for item in source.iterdir():
        if item.name == "model.safetensors":
            (model / item.name).symlink_to(item)
        elif item.is_file():
            shutil.copy(item, model / item.name)
    (model / "chat_template.jinja").write_text(REASONING_TEMPLATE)
    return model


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("misses")
    model = reasoning_model(tmp)
    flags = ("--model", str(model), "--served-model-name", "tiny", "--dp-size", "2",
             "--num-kv-blocks", "128", "--max-num-seqs", "3",
             "--threads-per-rank", "1")  # fmt: skip
    with start_engine(tmp, *flags) as engine:
        with start_router(tmp, [engine.url], "router") as router:
            assert wait_for(lambda: len(healthy_targets(router.url)) == 2, timeout=60)
            yield engine, router, model


def reasons_of(response: httpx.Response) -> dict:
    """The x-dpmesh-cache-misses header as {name: value}, checked against the usage."""
    assert response.status_code == 200, response.text
    fields = dict(p.split("=", 1) for p in response.headers["x-dpmesh-cache-misses"].split("; "))
    assert fields.pop("basis") == "engine"
    out = {k: int(v) for k, v in fields.items() if k in REASONS}
    usage = response.json()["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert sum(out.values()) == usage["prompt_tokens"] - cached, (out, usage)
    return {**out, "cached": cached, **{k: int(v) for k, v in fields.items() if k not in REASONS}}


def post(url: str, body: dict, **headers) -> httpx.Response:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    return httpx.post(url + path, json={"model": "tiny", "max_tokens": 2, **body},
                      headers=headers, timeout=60)  # fmt: skip


def words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def test_a_turn_whose_template_dropped_the_reasoning_diverges_where_it_was(fleet):
    _, router, model = fleet
    tokenizer = load_tokenizer(str(model))
    question = {"role": "user", "content": "plan a trip " + words("city", 30)}
    answer = {"role": "assistant", "content": "<think>" + words("thought", 40) + "</think>go"}
    first = [question, answer, {"role": "user", "content": "and then?"}][:2]
    second = [question, answer, {"role": "user", "content": "and then?"}]
    # the first turn continues the assistant's message (a tool step): its reasoning is kept
    got = reasons_of(post(router.url, {"messages": first}, **{"X-Session-ID": "trip"}))
    assert "diverged" not in got
    got = reasons_of(post(router.url, {"messages": second}, **{"X-Session-ID": "trip"}))
    render = lambda m: tokenizer.encode(  # noqa: E731
        tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )
    a, b = render(first), render(second)
    at = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    lost = min(len(a) // BLOCK, (len(b) - 1) // BLOCK) * BLOCK  # held then, reachable now
    assert got["diverged"] == lost - at // BLOCK * BLOCK
    assert got["cached"] == at // BLOCK * BLOCK
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    latest = httpx.get(router.url + "/misses", headers=admin, timeout=10).json()["divergences"][0]
    assert latest["session"] == "h:trip" and latest["token"] == at
    assert "thought0" in latest["previous"]["from"] and "thought0" not in latest["current"]["from"]
    assert latest["previous"]["before"] == latest["current"]["before"]
    # without the admin key, where and how much, but not the prompts' text
    (open_view,) = httpx.get(router.url + "/misses", timeout=10).json()["divergences"][:1]
    assert open_view["token"] == at and "previous" not in open_view


def test_an_evicted_prefix_is_evicted(fleet):
    _, router, _ = fleet
    prompt = words("evict", 120)
    first = post(router.url, {"prompt": prompt})
    rank = first.headers["x-data-parallel-rank"]
    for i in range(10):  # ~200 blocks of other prompts through the same rank's 128
        body = {"prompt": words(f"flood{i}x", 80)}
        assert post(router.url, body, **{"X-data-parallel-rank": rank}).status_code == 200
    got = reasons_of(post(router.url, {"prompt": prompt}, **{"X-data-parallel-rank": rank}))
    assert got["cached"] == 0 and set(got) == {"evicted", "tail", "cached"}, got
    assert got["evicted"] == reasons_of(first).get("never_seen"), got  # all it could have had


def test_a_salted_prompt_cached_unsalted_is_another_tenant_key(fleet):
    _, router, _ = fleet
    prompt = words("tenant", 80)
    plain = reasons_of(post(router.url, {"prompt": prompt}))
    salted = reasons_of(post(router.url, {"prompt": prompt, "cache_salt": "acme"}))
    assert salted["cached"] == 0
    assert salted["tenant_key"] == (plain["cached"] + plain.get("never_seen", 0))


def test_a_hot_prefix_copied_under_load_is_placed_elsewhere(fleet):
    _, router, _ = fleet
    shared = words("hot", 40)
    reasons_of(post(router.url, {"prompt": shared + " first"}))

    def one(i: int) -> dict:
        body = {"prompt": f"{shared} then {i}", "max_tokens": 96, "ignore_eos": True}
        r = post(router.url, body)
        return {**reasons_of(r), "rank": r.headers["x-data-parallel-rank"]}

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(one, range(16)))
    copies = [g for g in got if g.get("placed_elsewhere")]
    assert copies, got  # the holder's seats were taken: the prefix was copied to the other rank
    held = max(g["cached"] for g in got)  # the shared prefix's cacheable tokens
    assert all(g["placed_elsewhere"] + g["cached"] == held for g in copies), copies
    assert {g["rank"] for g in got} == {"0", "1"}


def test_metrics_count_the_reasons_and_the_engine_counts_the_prediction(fleet):
    engine, router, _ = fleet
    text = httpx.get(router.url + "/metrics", timeout=10).text
    assert 'reason="diverged"' in text and 'reason="tenant_key"' in text
    name = "dpmesh_router_miss_tokens_total"
    total = lambda r: sum(v for n, labels, v in prom(router.url)  # noqa: E731
                          if n == name and labels["reason"] == r)  # fmt: skip
    assert total("diverged") > 0 and total("tenant_key") > 0 and total("placed_elsewhere") > 0
    predicted = counter(engine.url, "dpmesh_engine_router_predicted_tokens_total")
    had = counter(engine.url, "dpmesh_engine_router_predicted_cached_tokens_total")
    assert predicted > 0 and 0 < had <= predicted
