"""The router's promise, end to end: a real dp-4 engine behind a real `runrouter` process, driven
by the bench client. Cache-aware routing gets the oracle's hits without piling load on one rank.

Oracle (bench/oracle.py): one engine with an unbounded prefix cache, fed the same prompts in the
same order, under the engine's block rules (full 16-token blocks, last prompt token recomputed).
"""

import asyncio

import pytest

from bench import datasets
from bench.oracle import chat_prompts, oracle_cached
from bench.runner import RunOptions, send_conversations, send_samples
from bench.summary import balance
from harness.procs import free_port, metrics, router_command, start, start_engine

pytestmark = pytest.mark.slow

DP = 4


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from engine.tiny_lora import ensure_tiny_adapter

    adapters = [f"{name}={ensure_tiny_adapter(seed)}" for name, seed in (("sql", 1), ("poems", 2))]
    with start_engine(tmp_path_factory.mktemp("hits"), "--dp-size", str(DP), "--num-kv-blocks",
                      "1024", "--lora-modules", *adapters) as engine:  # fmt: skip
        yield engine


@pytest.fixture
def fleet(engine, tmp_path):
    """A fresh router per workload (each workload is its own experiment; the engine is shared and
    every workload uses prefixes it has never seen)."""
    port = free_port()
    cmd = router_command(engine.url, port=port, policy="cache_aware")
    with start(
        cmd,
        f"http://127.0.0.1:{port}",
        tmp_path / "router.log",
        env={"DATABASE_URL": f"sqlite:///{tmp_path}/router.sqlite3"},
    ) as router:
        yield engine, router


def tokenizer():
    from apps.routing.decision.request_shape import load_tokenizer
    from engine.tiny import ensure_tiny_model

    return load_tokenizer(str(ensure_tiny_model()))


def engine_prompt_tokens(engine_url: str, before: dict) -> list[float]:
    after = metrics(engine_url)
    return [after[("prompt_tokens", r)] - before.get(("prompt_tokens", r), 0) for r in range(DP)]


def test_prefix_repetition_gets_the_oracle(fleet):
    engine, router = fleet
    samples = datasets.prefix_repetition(
        num_prompts=100,
        prefix_len=512,
        suffix_len=128,
        num_prefixes=5,
        output_len=4,
        seed=7,
        allowed=datasets.allowed_token_ids(4096),
    )
    before = metrics(engine.url)
    run = asyncio.run(
        send_samples(
            RunOptions(base_url=router.url, model="tiny", max_concurrency=1, progress=False),
            samples,
        )
    )
    assert all(r.ok for r in run.results), [r.error for r in run.results if not r.ok][:3]
    cached = sum(r.cached_tokens for r in run.results)
    oracle = sum(oracle_cached([s.prompt for s in samples]))
    assert oracle == 95 * 512
    assert cached >= 0.99 * oracle, f"cache_aware cached {cached} of the oracle's {oracle}"
    after = metrics(engine.url)
    engine_cached = sum(
        after[("cached_tokens", r)] - before.get(("cached_tokens", r), 0) for r in range(DP)
    )
    assert engine_cached == cached  # the client's usage and the engine's own counters agree
    # one request at a time the fleet is idle at each: the 5 prefixes stay on the rank used last
    # (they fit its cache), as do their repeats (policies.CacheAware, shape.warm)
    assert len({r.rank for r in run.results}) == 1


def test_multi_turn_chat_gets_the_oracle_and_stays_balanced(fleet):
    engine, router = fleet
    tok = tokenizer()
    conversations = datasets.multi_turn(
        num_conversations=16,
        num_turns=5,
        system_len=400,
        user_len=60,
        output_len=16,
        seed=3,
        tokenizer=tok,
    )
    before = metrics(engine.url)
    run = asyncio.run(
        send_conversations(
            RunOptions(base_url=router.url, model="tiny", max_concurrency=8, progress=False),
            conversations,
        )
    )
    assert all(r.ok for r in run.results), [r.error for r in run.results if not r.ok][:3]
    cached = sum(r.cached_tokens for r in run.results)
    oracle = sum(oracle_cached(chat_prompts(run.results, conversations, tok)))
    assert cached >= 0.95 * oracle, f"cache_aware cached {cached} of the oracle's {oracle}"
    load = engine_prompt_tokens(engine.url, before)
    # 16 conversations on 4 ranks: nearly every run gives 1.00-1.01 (4 each). A new conversation
    # goes where sessions plus requests in flight are fewest, so now and then one lands on a rank
    # whose conversations were still running while another's had ended: 5/4/4/3, max/mean 1.25
    # give or take the conversations' sizes (a fresh-clone CI of 2026-12-04: 1.2508). Issue 4's
    # 1.25 sits on that step; this allows one conversation more than even on a rank, not two
    # (6/4/3/3: 1.5) and nothing like SGLang's 4.0 on 4 ranks. The balance itself is measured by
    # bench.runs.routers_under_skew (multi-turn: 1.00).
    assert balance(dict(enumerate(load))) <= 1.3, f"per-rank prompt tokens {load}"
    print(
        f"multi-turn: cached {cached} / oracle {oracle} = {cached / oracle:.3f}; "
        f"per-rank prompt tokens {load}"
    )


def test_tenants_with_their_own_cache_salt_share_no_blocks(fleet):
    """The same prompt under two ``cache_salt``s (vLLM's field; our engine keys blocks on it):
    the router predicts no hit across tenants and the engine serves none; within a tenant both
    agree. Each request's predicted and reported cached tokens come from the router's counters."""
    import httpx

    from tests.support.router_checks import counter

    engine, router = fleet
    prompt = " ".join(f"tenant{i % 7} word{i}" for i in range(120))

    def send(salt: str | None) -> tuple[float, float, int]:
        before = [
            counter(router.url, f"dpmesh_router_{n}_total")
            for n in ("predicted_cached_tokens", "reported_cached_tokens")
        ]
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}
        if salt is not None:
            body["cache_salt"] = salt
        r = httpx.post(router.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        after = [
            counter(router.url, f"dpmesh_router_{n}_total")
            for n in ("predicted_cached_tokens", "reported_cached_tokens")
        ]
        cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        return after[0] - before[0], after[1] - before[1], cached

    first = send("tenant-a")
    assert first[0] == 0 and first[2] == 0
    again = send("tenant-a")
    assert again[2] > 0 and again[0] == again[2] == again[1]  # predicted = served
    for other in ("tenant-b", None):  # another tenant, and no salt at all: nothing shared
        predicted, reported, cached = send(other)
        assert (predicted, reported, cached) == (0, 0, 0), other
    bad = httpx.post(router.url + "/v1/completions", timeout=30,
                     json={"model": "tiny", "prompt": prompt, "cache_salt": ""})  # fmt: skip
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"


def test_lora_adapters_share_no_blocks_and_predicted_is_served(fleet):
    """The engine serves two LoRA adapters (``--lora-modules``); the router learns them from its
    /server_info and keys each adapter's blocks apart: the same prompt under each adapter, the
    base model, and an adapter with a salt predicts no hit on the others' blocks and the engine
    serves none; within each, predicted = served."""
    import httpx

    from tests.support.router_checks import counter

    engine, router = fleet
    (worker,) = httpx.get(router.url + "/workers", timeout=10).json()["workers"]
    assert {m["name"] for m in worker["server_info"]["lora_modules"]} == {"sql", "poems"}
    prompt = " ".join(f"adapter{i % 5} text{i}" for i in range(120))

    def send(model: str, salt: str | None = None) -> tuple[float, int]:
        name = "dpmesh_router_predicted_cached_tokens_total"
        before = counter(router.url, name)
        body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
        if salt:
            body["cache_salt"] = salt
        r = httpx.post(router.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["model"] == model, r.text
        cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        return counter(router.url, name) - before, cached

    assert send("sql") == (0, 0)
    predicted, cached = send("sql")
    assert cached > 0 and predicted == cached
    for other in (("poems",), ("tiny",), ("sql", "tenant-a")):
        assert send(*other) == (0, 0), other
    assert send("poems") == (cached, cached)
