"""Tenants in the prefix cache: a request's ``cache_salt`` (vLLM's field) keys its blocks, so the
same prompt under another salt (or none) hits nothing of it; a salt and a LoRA adapter of the same
text never share a chain (engine/digests.py ``namespace``)."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.digests import chain_digests, namespace
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

PROMPT = list(range(100, 100 + 5 * 16 + 3))


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(model="tiny", simulate="cpu-tiny", simulate_speedup=1000.0))


def cached(engine, salt) -> int:
    rid = f"r{cached.count}"
    cached.count += 1
    engine.add_request(rid, PROMPT, SamplingParams(max_tokens=1, cache_salt=salt))
    while True:
        for out in engine.step():
            if out.finished and out.request_id == rid:
                return out.num_cached_tokens


cached.count = 0


def test_a_salt_keys_a_prompts_blocks(engine):
    assert cached(engine, "a") == 0
    assert cached(engine, "a") == 5 * 16
    assert cached(engine, "b") == 0
    assert cached(engine, None) == 0  # the plain chain is a tenant of its own
    assert cached(engine, None) == 5 * 16
    assert cached(engine, "b") == 5 * 16
    engine.block_manager.check_integrity()


def test_namespaces_are_typed_and_length_prefixed():
    assert namespace() is None and namespace("", None) is None
    assert namespace("x") != namespace(None, "x")  # a salt never collides with an adapter
    assert namespace("ab", "c") != namespace("a", "bc")
    assert namespace("x") == namespace("x")
    salted = chain_digests(PROMPT, 16, namespace("x"))
    plain = chain_digests(PROMPT, 16)
    assert len(salted) == len(plain) == 5 and not set(salted) & set(plain)


def test_an_empty_or_non_string_salt_is_refused():
    for bad in ("", 3, ["a"]):
        with pytest.raises(ValueError, match="cache_salt"):
            SamplingParams(cache_salt=bad)
