"""Miss reasons (apps/routing/decision/misses.py) on a hand-built fleet: each reason from the
decision that causes it, and the reasons of a request always add up to its prompt tokens minus
the engine's cached ones."""

import random

import pytest

from apps.routing.decision.misses import REASONS
from apps.routing.decision.router import Router, RouterConfig
from engine.tiny import ensure_tiny_model
from tests.routing.helpers import worker_view

BLOCK = 16


@pytest.fixture(scope="module")
def tiny_path() -> str:
    return str(ensure_tiny_model())


def make_router(tiny_path, **view) -> Router:
    router = Router(RouterConfig(policy="cache_aware"), rng=random.Random(0))
    router.fleet.put(worker_view(1, dp_size=2, tokenizer_path=tiny_path, **view))
    router.sync_capacity()
    return router


def ids(seed: int, n: int = 100) -> list[int]:
    return [(seed * 7919 + 31 * i) % 4000 + 10 for i in range(n)]


def served(router, prompt, cached, *, rank=None, session=None, salt=None) -> dict:
    """Route a completion of token ids, end it with the engine reporting ``cached``; its
    reasons, checked to add up."""
    body = {"prompt": prompt}
    if salt:
        body["cache_salt"] = salt
    dispatch = router.route(body, False, "tiny", rank=rank, session=session)
    usage = {"prompt_tokens": len(prompt), "prompt_tokens_details": {"cached_tokens": cached}}
    reasons = dispatch.miss_reasons(usage)
    dispatch.finish(ok=True, usage=usage)
    assert set(reasons) <= set(REASONS)
    assert sum(reasons.values()) == len(prompt) - cached, reasons
    return reasons


def test_a_new_prompt_is_never_seen_and_its_last_tokens_are_the_tail(tiny_path):
    router = make_router(tiny_path)
    assert served(router, ids(1), 0) == {"never_seen": 96, "tail": 4}  # (100 - 1) // 16 blocks
    assert served(router, ids(1), 96) == {"tail": 4}  # all it could
    assert served(router, ids(1), 32) == {"mispredicted": 64, "tail": 4}
    key = next(iter(router.stats.targets))
    assert router.misses.tokens[(key, "mispredicted")] == 64
    assert router.misses.tokens[(key, "never_seen")] == 96
    assert router.misses.requests == 3


def test_what_another_rank_held_is_placed_elsewhere(tiny_path):
    router = make_router(tiny_path)
    served(router, ids(2, 40), 0, rank=1, session="s")  # the session lives on rank 1
    served(router, ids(3), 0, rank=0)  # the prefix lives on rank 0
    reasons = served(router, ids(3), 0, session="s")  # the session's home keeps it on rank 1
    assert reasons == {"placed_elsewhere": 96, "tail": 4}


def test_what_a_rank_the_client_pinned_away_from_held_is_placed_elsewhere(tiny_path):
    router = make_router(tiny_path)
    served(router, ids(12), 0, rank=0)
    assert served(router, ids(12), 0, rank=1) == {"placed_elsewhere": 96, "tail": 4}


def test_an_evicted_prefix_is_evicted(tiny_path):
    router = make_router(tiny_path, capacity_blocks=20)
    served(router, ids(4), 0, rank=0)
    for seed in range(10, 14):  # 24 more blocks through rank 0's 20
        served(router, ids(seed), 0, rank=0)
    reasons = served(router, ids(4), 0, rank=0)
    assert reasons == {"evicted": 96, "tail": 4}


def test_a_salted_prompt_cached_without_its_salt_is_another_tenant_key(tiny_path):
    router = make_router(tiny_path)
    served(router, ids(5), 0, rank=0)
    assert served(router, ids(5), 0, rank=0, salt="acme") == {"tenant_key": 96, "tail": 4}
    assert served(router, ids(5), 96, rank=0, salt="acme") == {"tail": 4}


def test_a_turn_that_rewrites_the_last_one_diverges_at_its_first_changed_token(tiny_path):
    router = make_router(tiny_path)
    first = ids(6)
    served(router, first, 0, rank=0, session="chat")
    second = first[:50] + ids(7, 70)  # the first 50 tokens kept, then other text
    reasons = served(router, second, 48, rank=0, session="chat")
    # the engine had 3 blocks (48 tokens); the last turn's blocks 3..5 were cached and are lost
    # to the change at token 50; what follows them in the new turn was never anywhere
    assert reasons == {"diverged": 48, "never_seen": 16, "tail": 8}
    (record,) = router.misses.divergences
    assert (record["session"], record["token"], record["tokens"]) == ("chat", 50, 48)
    assert record["previous"]["before"] == record["current"]["before"]
    assert record["previous"]["from"] != record["current"]["from"]
    assert router.misses.worst_sessions() == [("chat", 48)]


def test_a_turn_that_continues_the_last_one_does_not_diverge(tiny_path):
    router = make_router(tiny_path)
    first = ids(8)
    served(router, first, 0, rank=0, session="c")
    reasons = served(router, first + ids(9, 40), 96, rank=0, session="c")
    assert reasons == {"never_seen": 32, "tail": 12}
    assert not router.misses.divergences


def test_where_the_pin_is_dropped_the_router_placed_nothing(tiny_path):
    router = make_router(tiny_path, pin_check={"/v1/completions": False})
    served(router, ids(10), 0)
    assert served(router, ids(10), 32) == {"pin_not_honoured": 64, "tail": 4}


def test_text_digests_say_no_tokenizer(tiny_path):
    router = make_router(tiny_path, block_size=None)  # no block size: digests of text
    prompt = "word " * 200
    dispatch = router.route({"prompt": prompt}, False, "tiny")
    usage = {"prompt_tokens": 201, "prompt_tokens_details": {"cached_tokens": 0}}
    reasons = dispatch.miss_reasons(usage)
    dispatch.finish(ok=True, usage=usage)
    assert set(reasons) == {"no_tokenizer", "tail"} and sum(reasons.values()) == 201


def test_without_the_engines_cached_tokens_the_reasons_are_the_expected_ones(tiny_path):
    router = make_router(tiny_path)
    served(router, ids(11), 0, rank=0)
    dispatch = router.route({"prompt": ids(11)}, False, "tiny", rank=0)
    assert dispatch.miss_reasons(None) == {"tail": 4}  # as if the engine had what was predicted
    dispatch.finish(ok=True, usage={"prompt_tokens": 100})  # no cached tokens: not counted
    assert router.misses.requests == 1


def test_a_passthrough_path_has_no_reasons(tiny_path):
    router = make_router(tiny_path)
    dispatch = router.route({"input": "x"}, False, "tiny", path="/v1/embeddings")
    assert dispatch.miss_reasons(None) is None
    dispatch.finish(ok=True, usage={"prompt_tokens_details": {"cached_tokens": 0}})
    assert router.misses.requests == 0
