"""Sends a workload: arrivals (all at once, Poisson, or a trace's own times scaled by
``speedup``), a concurrency cap, a progress bar.

``--max-concurrency`` caps requests in flight. For multi-turn chat the arrivals are conversation
starts; each conversation then sends its turns one after another, every turn taking a slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import sys
import time
from dataclasses import dataclass, field

import httpx
from tqdm import tqdm

from bench.client import RequestResult, chat_body, completion_body, send
from bench.datasets import Conversation, SampleRequest
from bench.trace import send_offsets

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


@dataclass
class RunOptions:
    """How to send: target, model name, pacing and the per-request body options."""

    base_url: str
    model: str
    max_concurrency: int | None = None
    request_rate: float = float("inf")
    seed: int = 0
    ignore_eos: bool = True
    extra_body: dict = field(default_factory=dict)
    timeout_s: float = 600.0
    progress: bool = True
    transport: httpx.AsyncBaseTransport | None = None  # tests pass an httpx.MockTransport
    api_key: str | None = None  # sent as Authorization: Bearer (servers started with API keys)
    speedup: float | None = None  # samples with timestamp_ms: sent at timestamp / speedup

    @property
    def body_options(self) -> dict:
        return {"ignore_eos": self.ignore_eos, "extra_body": self.extra_body}


@dataclass
class RunResult:
    results: list[RequestResult]
    duration_s: float


async def send_samples(opts: RunOptions, samples: list[SampleRequest]) -> RunResult:
    """Send independent completion requests; returns when all are done."""
    return await _run(opts, len(samples), lambda ctx: _samples(ctx, samples))


async def send_conversations(opts: RunOptions, conversations: list[Conversation]) -> RunResult:
    """Send multi-turn chats; returns when every conversation has finished or failed."""
    total = sum(len(c.user_turns) for c in conversations)
    return await _run(opts, total, lambda ctx: _conversations(ctx, conversations))


@dataclass
class _Context:
    opts: RunOptions
    client: httpx.AsyncClient
    slots: contextlib.AbstractAsyncContextManager
    bar: tqdm
    rng: random.Random
    results: list[RequestResult] = field(default_factory=list)

    async def send(self, path: str, body: dict, prompt_len: int, meta: dict) -> RequestResult:
        async with self.slots:
            result = await send(self.client, path, body, prompt_len)
        result.meta = meta
        self.results.append(result)
        self.bar.update(1)
        return result


async def _run(opts: RunOptions, total: int, workload) -> RunResult:
    limit = opts.max_concurrency or total or 1
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    timeout = httpx.Timeout(opts.timeout_s, connect=30.0)
    slots = (
        asyncio.Semaphore(opts.max_concurrency)
        if opts.max_concurrency
        else contextlib.nullcontext()
    )
    bar = tqdm(total=total, file=sys.stderr, disable=not opts.progress, desc="requests", unit="req")
    headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else None
    async with httpx.AsyncClient(
        base_url=opts.base_url.rstrip("/"),
        timeout=timeout,
        limits=limits,
        transport=opts.transport,
        headers=headers,
    ) as client:
        ctx = _Context(opts, client, slots, bar, random.Random(opts.seed))
        started = time.perf_counter()
        await workload(ctx)
        duration = time.perf_counter() - started
    bar.close()
    return RunResult(sorted(ctx.results, key=lambda r: r.start), duration)


async def _arrivals(ctx: _Context, n: int):
    """Yield 0..n-1, spaced by exponential gaps (a Poisson process) unless the rate is infinite."""
    rate = ctx.opts.request_rate
    for i in range(n):
        if i and rate != float("inf"):
            await asyncio.sleep(ctx.rng.expovariate(rate))
        yield i


async def _on_schedule(offsets: list[float]):
    """Yield 0..n-1, each at its offset (seconds) after the first call: an open loop."""
    started = time.perf_counter()
    for i, offset in enumerate(offsets):
        wait = started + offset - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        yield i


async def _samples(ctx: _Context, samples: list[SampleRequest]) -> None:
    tasks = []
    if ctx.opts.speedup:
        stamps = [s.timestamp_ms for s in samples]
        if None in stamps:
            raise ValueError("speedup replays trace timestamps; these samples have none")
        arrivals = _on_schedule(send_offsets(stamps, ctx.opts.speedup))
    else:
        arrivals = _arrivals(ctx, len(samples))
    async for i in arrivals:
        s = samples[i]
        prompt = s.prompt.tolist() if hasattr(s.prompt, "tolist") else s.prompt  # numpy: JSON
        body = completion_body(ctx.opts.model, prompt, s.output_len, ctx.opts.body_options)
        tasks.append(
            asyncio.create_task(
                ctx.send(COMPLETIONS, body, s.prompt_len, {"index": i, "group": s.group})
            )
        )
    await asyncio.gather(*tasks)


async def _conversations(ctx: _Context, conversations: list[Conversation]) -> None:
    tasks = []
    async for i in _arrivals(ctx, len(conversations)):
        tasks.append(asyncio.create_task(_converse(ctx, conversations[i])))
    await asyncio.gather(*tasks)


async def _converse(ctx: _Context, conv: Conversation) -> None:
    """Turn k+1 goes out only after turn k returned, carrying the assistant's actual reply."""
    messages = [{"role": "system", "content": conv.system}]
    for turn, user in enumerate(conv.user_turns):
        messages.append({"role": "user", "content": user})
        body = chat_body(ctx.opts.model, list(messages), conv.output_len, ctx.opts.body_options)
        result = await ctx.send(CHAT, body, 0, {"conversation": conv.conv_id, "turn": turn})
        if not result.ok:
            _skip_rest(ctx, conv, turn + 1)
            return
        messages.append({"role": "assistant", "content": result.text})


def _skip_rest(ctx: _Context, conv: Conversation, first: int) -> None:
    """A failed turn ends its conversation: later turns would need its reply. Count them as
    failed."""
    for turn in range(first, len(conv.user_turns)):
        ctx.results.append(
            RequestResult(
                start=time.perf_counter(),
                error="skipped: an earlier turn failed",
                meta={"conversation": conv.conv_id, "turn": turn},
            )
        )
        ctx.bar.update(1)
