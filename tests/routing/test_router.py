"""Router.route / finish on a hand-filled fleet: commit (load + index), prediction, stats,
availability (health, draining, circuit), exclusion, models, and switching policies."""

import random

import pytest

from apps.routing.decision.policies import CacheAware, RoundRobin
from apps.routing.decision.request_shape import load_tokenizer
from apps.routing.decision.router import NoTarget, Router, RouterConfig
from engine.digests import chain_digests
from engine.server.openai_api import chat_prompt
from engine.tiny import ensure_tiny_model
from tests.routing.helpers import worker_view

CHAT = {
    "messages": [
        {"role": "system", "content": "You answer questions about the Python language."},
        {"role": "user", "content": "What does the yield statement do inside a function body?"},
    ]
}


@pytest.fixture(scope="module")
def tiny_path() -> str:
    return str(ensure_tiny_model())


@pytest.fixture(scope="module")
def chat_tokens(tiny_path) -> int:
    return len(chat_prompt(CHAT, load_tokenizer(tiny_path)))


def make_router(tiny_path, policy="cache_aware", workers=((1, "tiny", 2),)) -> Router:
    router = Router(RouterConfig(policy=policy), rng=random.Random(0))
    for worker_id, model, dp in workers:
        router.fleet.put(worker_view(worker_id, model=model, dp_size=dp, tokenizer_path=tiny_path))
    router.sync_capacity()
    return router


def test_route_commits_load_and_index_and_the_repeat_is_predicted(tiny_path, chat_tokens):
    assert chat_tokens == 43  # 2 full blocks of 16; the fixture text is part of the numbers below
    router = make_router(tiny_path, workers=((1, "tiny", 1),))
    first = router.route(CHAT, True, "tiny")
    key = first.target.key
    assert key == "http://w1@0" and first.predicted_tokens == 0
    assert (first.shape.prompt_tokens, len(first.shape.digests)) == (43, 2)
    load = first.target.load
    assert (load.requests, load.prompt_tokens, load.pending_prefill_tokens) == (1, 43, 43)
    assert router.index.match(first.shape.digests) == {key: 2}
    first.first_token()
    assert load.pending_prefill_tokens == 0
    first.finish(
        ok=True, usage={"prompt_tokens": 43, "prompt_tokens_details": {"cached_tokens": 0}}
    )
    assert load.idle

    second = router.route(CHAT, True, "tiny")
    assert second.target is first.target
    assert second.predicted_tokens == 32  # (43 - 1) // 16 = 2 blocks
    assert (load.requests, load.pending_prefill_tokens) == (1, 11)
    second.finish(ok=True, usage={"prompt_tokens_details": {"cached_tokens": 32}})
    stats = router.stats.targets[key].as_dict()
    assert stats == {
        "requests": 2,
        "prompt_tokens": 86,
        "predicted_tokens": 32,
        "completed": 2,
        "errors": 0,
        "aborted": 0,
        "reported": 2,
        "cached_tokens": 32,
    }
    assert load.idle


def test_a_dispatch_settled_later_commits_its_choice_now_and_the_rest_at_settle(tiny_path):
    """The proxy's way (``settle_later``): the choice at once, the load, index, stats and miss
    plan when the request is written upstream (``settle``), or at its end if it never is; what
    reads the load settles first."""
    router = make_router(tiny_path, workers=((1, "tiny", 1),))
    sent = router.route(CHAT, True, "tiny", settle_later=True)
    key = sent.target.key
    assert sent.target.load.requests == 0 and sent.explains and sent.plan is None
    assert router.index.match(sent.shape.digests) == {} and key not in router.stats.targets
    sent.settle()
    assert sent.target.load.requests == 1 and sent.ticket is not None
    assert router.index.match(sent.shape.digests) == {key: 2} and sent.plan is not None
    assert router.stats.targets[key].requests == 1
    sent.settle()  # once only
    assert router.stats.targets[key].requests == 1
    sent.finish(ok=True)

    never = router.route({"prompt": "another prompt of its own " * 8}, False, "tiny",
                         settle_later=True)  # fmt: skip
    never.unreachable()  # refused before anything was written: its end settles it
    assert router.index.match(never.shape.digests) == {key: len(never.shape.digests)}
    assert never.target.load.idle and router.stats.targets[key].requests == 2
    assert never.target.load.dispatched == 2  # begun at its settle, then ended

    read = router.route({"prompt": "a third prompt " * 8}, False, "tiny", settle_later=True)
    assert read.prefill_tokens > 0 and read.target.load.requests == 1  # read: settled
    read.first_token()
    read.finish(ok=True)
    assert read.target.load.idle


def test_a_long_cached_prompt_returns_home(tiny_path):
    router = make_router(tiny_path)
    body = {"prompt": [(11 * i) % 4000 for i in range(600)]}  # 37 full blocks
    homes = set()
    for turn in range(4):
        routed = router.route(body, False, None)
        assert routed.predicted_tokens == (0 if turn == 0 else 592)  # (600 - 1) // 16 = 37 blocks
        homes.add(routed.target.key)
        routed.finish(ok=True)
    assert len(homes) == 1
    other = next(t for t in router.fleet.all_targets() if t.key not in homes)
    assert other.load.dispatched == 0 and router.index.size(other.key) == 0


def test_finish_is_idempotent_and_records_errors(tiny_path):
    router = make_router(tiny_path)
    routed = router.route({"prompt": "hello there"}, False, None)
    routed.finish(ok=False)
    routed.finish(ok=False)
    routed.finish(ok=True, usage={"prompt_tokens_details": {"cached_tokens": 5}})
    stats = router.stats.targets[routed.target.key]
    assert (stats.requests, stats.completed, stats.errors, stats.reported, stats.cached_tokens) == (
        1,
        0,
        1,
        0,
        0,
    )
    assert routed.finished and routed.target.load.idle


def test_latency_and_first_token_are_observed_once_per_request(tiny_path):
    router = make_router(tiny_path)
    routed = router.route({"prompt": "hello there", "stream": True}, False, None)
    routed.first_token()
    routed.first_token()
    routed.finish(ok=True)
    routed.finish(ok=True)
    assert (router.stats.ttft.count, router.stats.latency.count) == (1, 1)
    assert 0 <= router.stats.ttft.sum <= router.stats.latency.sum
    assert router.stats.latency.cumulative()[-1] == ("+Inf", 1)
    other = router.route({"prompt": "no stream"}, False, None)
    other.finish(ok=False)  # failed requests are timed too, and never had a first token
    assert (router.stats.ttft.count, router.stats.latency.count) == (1, 2)


def test_finish_without_usage_counts_completion_only(tiny_path):
    router = make_router(tiny_path)
    routed = router.route({"prompt": "hello there"}, False, None)
    routed.finish(ok=True)
    stats = router.stats.targets[routed.target.key]
    assert (stats.completed, stats.reported, stats.errors) == (1, 0, 0)


def test_a_successful_finish_closes_a_half_open_circuit(tiny_path):
    router = make_router(tiny_path, workers=((1, "tiny", 1),))
    target = router.fleet.all_targets()[0]
    target.breaker.failure_threshold, target.breaker.open_s, target.breaker.success_threshold = (
        1,
        0.0,
        1,
    )
    target.breaker.record_failure()
    assert target.breaker.state == "half_open"
    router.route({"prompt": "x"}, False, None).finish(ok=True)
    assert target.breaker.state == "closed"


def test_a_half_open_target_takes_one_trial_request_at_a_time(tiny_path):
    router = make_router(tiny_path, workers=((1, "tiny", 2),))
    sick, healthy = router.fleet.all_targets()
    sick.breaker.failure_threshold, sick.breaker.open_s, sick.breaker.success_threshold = 1, 0.0, 2
    sick.breaker.record_failure()
    routed = router.route({"prompt": "x"}, False, None, exclude={healthy.key})
    assert routed.target is sick and routed.trial
    others = [router.route({"prompt": "x"}, False, None) for _ in range(3)]
    # no second trial while one runs
    assert all(r.target is healthy and not r.trial for r in others)
    routed.finish(ok=False)  # ended without success (the proxy records upstream failures itself)
    again = router.route({"prompt": "x"}, False, None, exclude={healthy.key})
    assert again.target is sick and again.trial  # the slot is free again
    again.finish(ok=True)
    for r in others:
        r.finish(ok=True)
    assert sick.breaker.state == "half_open" and sick.breaker.allows()


def test_empty_prompt_is_not_predicted_negative(tiny_path):
    """The engine answers 400 to an empty prompt, but the router routes (and counts) it first."""
    router = make_router(tiny_path)
    routed = router.route({"prompt": ""}, False, None)
    assert routed.shape.prompt_tokens == 0
    assert routed.predicted_tokens == 0
    assert routed.prefill_tokens == 0
    assert router.stats.targets[routed.target.key].predicted_tokens == 0


def unavailable(router, how: str) -> None:
    for view in router.fleet.workers.values():
        if how == "unhealthy":
            view.healthy = False
        elif how == "draining":
            view.draining = True
    if how == "circuit":
        for target in router.fleet.all_targets():
            for _ in range(target.breaker.failure_threshold):
                target.breaker.record_failure()
            assert target.breaker.state == "open"


@pytest.mark.parametrize("how", ["unhealthy", "draining", "circuit"])
def test_no_target_when_every_target_is_unavailable(tiny_path, how):
    router = make_router(tiny_path)
    unavailable(router, how)
    with pytest.raises(NoTarget, match="no available worker serves model 'tiny'"):
        router.route(CHAT, True, "tiny")
    with pytest.raises(NoTarget, match="no available worker"):
        router.route(CHAT, True, None)
    assert all(t.load.idle and t.load.dispatched == 0 for t in router.fleet.all_targets())
    assert router.index.ranks == {}


def test_one_open_circuit_sends_everything_to_the_other_rank(tiny_path):
    router = make_router(tiny_path)
    bad, good = router.fleet.all_targets()
    for _ in range(bad.breaker.failure_threshold):
        bad.breaker.record_failure()
    for i in range(6):
        routed = router.route({"prompt": f"request {i}"}, False, None)
        assert routed.target is good
        routed.finish(ok=True)


def test_exclude_skips_targets(tiny_path):
    router = make_router(tiny_path)
    t0, t1 = router.fleet.all_targets()
    first = router.route(CHAT, True, None)
    first.finish(ok=True)
    home = first.target
    other = t1 if home is t0 else t0
    # the retry goes elsewhere, cache or not
    retry = router.route(CHAT, True, None, exclude={home.key})
    assert retry.target is other and retry.predicted_tokens == 0
    with pytest.raises(NoTarget):
        router.route(CHAT, True, None, exclude={t0.key, t1.key})


def test_model_filtering(tiny_path):
    router = make_router(tiny_path, workers=((1, "alpha", 2), (2, "beta", 1)))
    for _ in range(5):
        routed = router.route({"prompt": "some text"}, False, "beta")
        assert routed.target.key == "http://w2@0"
        routed.finish(ok=True)
    keys = set()
    for _ in range(6):
        routed = router.route({"prompt": "other text"}, False, "alpha")
        keys.add(routed.target.key)
        routed.finish(ok=True)
    assert keys <= {"http://w1@0", "http://w1@1"} and keys
    with pytest.raises(NoTarget, match="'gamma'"):
        router.route({"prompt": "x"}, False, "gamma")
    assert router.fleet.models() == ["alpha", "beta"]


def test_an_unknown_model_name_is_served_when_only_one_model_is(tiny_path):
    router = make_router(tiny_path)
    routed = router.route({"prompt": "x"}, False, "gpt-4o")
    assert routed.target.worker.model == "tiny"


def test_a_lora_adapter_goes_to_its_workers_and_keys_its_own_blocks(tiny_path):
    """A request naming a LoRA adapter as its ``model`` goes only to workers that serve it, and
    its blocks are the adapter's (engine/digests.py ``namespace``): the same prompt under the base
    model or another adapter predicts no hit on them, the same adapter again does."""
    from engine.digests import namespace

    router = Router(RouterConfig(policy="cache_aware"), rng=random.Random(0))
    for worker_id, adapters in ((1, frozenset({"sql", "poems"})), (2, frozenset())):
        view = worker_view(worker_id, dp_size=1, tokenizer_path=tiny_path, adapters=adapters)
        view.model_aliases |= adapters
        router.fleet.put(view)
    router.sync_capacity()
    prompt = {"prompt": " ".join(f"word{i}" for i in range(80))}
    ids = load_tokenizer(tiny_path).encode(prompt["prompt"])

    def send(model):
        routed = router.route(prompt, False, model)
        routed.finish(ok=True)
        return routed

    sql = send("sql")
    assert sql.target.key == "http://w1@0" and sql.predicted_tokens == 0
    assert sql.shape.digests == chain_digests(ids, 16, namespace(None, "sql"))
    assert send("sql").predicted_tokens > 0  # the adapter's own blocks
    for other in ("poems", "tiny"):  # another adapter, the base model: nothing shared
        routed = router.route(prompt, False, other)
        routed.finish(ok=True)
        assert routed.predicted_tokens == 0, other
    salted = router.route({**prompt, "cache_salt": "t1"}, False, "sql")
    assert salted.shape.digests[0] == chain_digests(ids, 16, namespace("t1", "sql"))[0]
    assert salted.predicted_tokens == 0


def test_set_policy_switches_policy(tiny_path):
    router = make_router(tiny_path)
    assert isinstance(router.policy, CacheAware)
    router.set_policy("round_robin")
    assert isinstance(router.policy, RoundRobin) and router.config.policy == "round_robin"
    keys = []
    for _ in range(4):  # the same cached request alternates: round robin ignores the index
        routed = router.route(CHAT, True, None)
        keys.append(routed.target.key)
        routed.finish(ok=True)
    assert keys == ["http://w1@0", "http://w1@1", "http://w1@0", "http://w1@1"]
    with pytest.raises(ValueError):
        router.set_policy("nope")
    assert isinstance(router.policy, RoundRobin) and router.config.policy == "round_robin"
    router.set_policy("cache_aware")
    assert isinstance(router.policy, CacheAware)
    routed = router.route(CHAT, True, None)
    assert routed.predicted_tokens == 32  # the index kept learning under round robin


def test_sync_capacity_bounds_the_index(tiny_path):
    router = make_router(tiny_path, workers=((1, "tiny", 1),))
    router.fleet.workers[1].capacity_blocks = 1
    router.sync_capacity()
    routed = router.route(CHAT, True, None)
    assert router.index.size(routed.target.key) == 1


def test_foreign_worker_routes_on_text_digests(tiny_path):
    router = Router(RouterConfig(dp_aware=False), rng=random.Random(0))
    router.fleet.put(
        worker_view(1, dp_size=1, dp_aware=False, block_size=None, tokenizer_path=None)
    )
    text = "q" * 200
    first = router.route({"prompt": text}, False, None)
    assert first.target.key == "http://w1" and first.target.rank is None
    assert (len(first.shape.digests), first.shape.block_tokens, first.shape.prompt_tokens) == (
        3,
        16,
        50,
    )
    first.finish(ok=True)
    assert router.route({"prompt": text}, False, None).predicted_tokens == 48


def test_index_entries_are_in_each_targets_own_block_size(tiny_path):
    """Two workers serve the same model with different block sizes. Whatever target a request
    lands on, the digests recorded for it must be the ones its engine computes (its own block
    size), or its later hits are never found and its load is mis-predicted."""
    router = Router(RouterConfig(), rng=random.Random(0))
    router.fleet.put(worker_view(1, dp_size=1, block_size=16, tokenizer_path=tiny_path))
    router.fleet.put(worker_view(2, dp_size=1, block_size=4, tokenizer_path=tiny_path))
    ids = chat_prompt(CHAT, load_tokenizer(tiny_path))
    router.fleet.targets[1][0].load.begin(1000, 1000)  # busy: the request goes to worker 2
    routed = router.route(CHAT, True, None)
    assert routed.target.key == "http://w2@0"
    assert routed.shape.block_tokens == 4
    assert router.index.match(chain_digests(ids, 4), ["http://w2@0"]) == {
        "http://w2@0": len(ids) // 4
    }


def test_the_router_counts_each_shared_prefix_share_of_the_traffic(tiny_path):
    """Requests that branch off one 10-block prefix: from the second on, the router counts them
    against that prefix (its last block's digest) and hands the policy its share; a request with
    no shared prefix counts only in the total."""
    router = make_router(tiny_path)
    head = [(7 * i) % 4000 + 5 for i in range(160)]
    seen = []
    original = router.policy.choose

    def choose(targets, shape, matched, shared_blocks=0):
        seen.append(shape.prefix_share)
        return original(targets, shape, matched, shared_blocks)

    router.policy.choose = choose
    for n in range(4):
        body = {"prompt": head + [(13 * i + n) % 4000 + 5 for i in range(40 + n)]}
        router.route(body, False, None).finish(ok=True)
    assert seen[0] is None  # the first has nothing shared yet (one chain)
    assert seen[1:] == pytest.approx([1 / 2, 2 / 3, 3 / 4], rel=1e-3)
    prefix = chain_digests(head, 16)[-1]
    router.route({"prompt": list(range(3000, 3100))}, False, None).finish(ok=True)
    assert router.demand.share(prefix) == pytest.approx(3 / 5, rel=1e-3)
