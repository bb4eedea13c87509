"""What one request may cost the router (apps/routing/proxy/limits.py, serving.asgi.read_body):
the body limit from what the fleet takes, the prompt limit from its contexts, the budget of large
bodies at once, and a body that is refused before it is read or cut off when it trickles. The
same limits end to end, in front of real engines: tests/routing/test_router_failures.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from apps.routing.decision.fleet import WorkerView
from apps.routing.proxy import limits
from serving.asgi import BodyTimeout, BodyTooLarge, read_body


def worker(max_model_len=None, max_body_bytes=None) -> WorkerView:
    return WorkerView(1, "http://w", "", "m", set(), 1, True, 16, None, None,
                      max_model_len=max_model_len, max_body_bytes=max_body_bytes)  # fmt: skip


def test_the_body_limit_is_what_the_most_generous_worker_takes():
    assert limits.body_limit([]) == limits.BODY_CAP_BYTES  # nobody yet: the cap
    assert limits.worker_body_limit(worker()) == limits.BODY_CAP_BYTES  # vLLM reports none
    ours = worker(max_model_len=32768, max_body_bytes=4 * 2**20)  # its context binds first
    assert limits.worker_body_limit(ours) == 32768 * 64 + 2**20
    small_body = worker(max_model_len=131072, max_body_bytes=2**20)
    assert limits.worker_body_limit(small_body) == 2**20
    big = worker(max_model_len=1_048_576)  # a 1 M-token model takes more than the cap
    assert limits.body_limit([ours, big]) == 1_048_576 * 64 + 2**20


def test_the_prompt_limit_is_the_longest_context_and_only_when_every_one_is_known():
    def targets(*lens):
        return [SimpleNamespace(worker=worker(max_model_len=n)) for n in lens]

    assert limits.prompt_limit(targets(4096, 32768)) == 32768
    assert limits.prompt_limit(targets(4096, None)) is None
    assert limits.prompt_limit([]) is None


def test_large_bodies_share_a_budget_and_small_ones_are_free():
    budget = limits.LargeBodies(budget=10 * 2**20, large=2**20)
    assert budget.take(None) == 0 and budget.take(1000) == 0
    held = [budget.take(4 * 2**20), budget.take(4 * 2**20)]
    with pytest.raises(OverflowError):
        budget.take(4 * 2**20)
    budget.give_back(held.pop())
    assert budget.take(4 * 2**20) == 4 * 2**20 and budget.held == 8 * 2**20


def receiver(messages, gap_s=0.0):
    queue = list(messages)

    async def receive():
        await asyncio.sleep(gap_s)
        return queue.pop(0) if queue else {"type": "http.disconnect"}

    return receive


async def test_a_declared_length_past_the_limit_is_refused_before_a_byte_is_read():
    scope = {"headers": [(b"content-length", b"5000")]}
    reads = []

    async def receive():
        reads.append(1)
        return {"type": "http.request", "body": b"x" * 5000}

    with pytest.raises(BodyTooLarge):
        await read_body(receive, 4096, scope)
    assert reads == []
    # undeclared (chunked): refused once it passes
    chunks = [{"type": "http.request", "body": b"x" * 3000, "more_body": True}] * 2
    with pytest.raises(BodyTooLarge):
        await read_body(receiver(chunks), 4096)


async def test_a_trickled_body_is_cut_off_at_the_deadline():
    trickle = [{"type": "http.request", "body": b"x", "more_body": True}] * 100
    with pytest.raises(BodyTimeout, match="did not arrive within 0.2 s"):
        await read_body(receiver(trickle, gap_s=0.05), 4096, timeout_s=0.2)
    whole = [{"type": "http.request", "body": b'{"a": 1}'}]
    assert await read_body(receiver(whole), 4096, {"headers": []}) == b'{"a": 1}'
