"""The oracle hit count of a run: what one engine with an unbounded prefix cache would have
served from cache, under the engine's own block rules.

Requests are taken in the order they were sent. Each one hits the leading full blocks it shares
with any earlier prompt (chained digests make "shares the first k blocks" a set lookup), at most
``(n - 1) // block_size`` blocks since the engine always recomputes the last prompt token. Only
prompts count, not generated tokens: an engine can beat this oracle slightly when a reply
re-tokenizes to the ids it was generated as, so ratios a little above 1 are possible.
"""

from __future__ import annotations

from engine.digests import chain_digests


def oracle_cached(prompts: list[list[int]], block_size: int = 16) -> list[int]:
    """Cached tokens per prompt, in order, for a single unbounded prefix cache."""
    seen: set[int] = set()
    out = []
    for ids in prompts:
        digests = chain_digests(ids, block_size)
        usable = (len(ids) - 1) // block_size
        hits = 0
        while hits < min(usable, len(digests)) and digests[hits] in seen:
            hits += 1
        out.append(hits * block_size)
        seen.update(digests)
    return out


def chat_prompts(results, conversations, tokenizer) -> list[list[int]]:
    """Token ids of every chat turn a multi-turn run sent, rebuilt from the conversations and the
    replies the server returned, templated as the engine templates them. ``results`` must be in
    send order and carry ``meta`` ``conversation`` / ``turn`` and the reply ``text``."""
    replies = {(r.meta["conversation"], r.meta["turn"]): r.text for r in results if r.ok}
    by_id = {c.conv_id: c for c in conversations}
    prompts = []
    for r in results:
        if not r.ok:
            continue
        conv, turn = by_id[r.meta["conversation"]], r.meta["turn"]
        messages = [{"role": "system", "content": conv.system}]
        for k in range(turn + 1):
            messages.append({"role": "user", "content": conv.user_turns[k]})
            if k < turn:
                messages.append({"role": "assistant", "content": replies[(conv.conv_id, k)]})
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts


def sample_oracle(results, samples, block_size: int = 16) -> dict | None:
    """The oracle beside a run of token-id samples: its cached tokens over the prompts of the
    requests that succeeded, in send order (``results`` sorted by start, ``meta["index"]`` into
    ``samples``), and the hit rate that makes. None for text prompts (their ids are the
    server's)."""
    sent = [samples[r.meta["index"]].prompt for r in results if r.ok and "index" in r.meta]
    if any(isinstance(p, str) for p in sent):
        return None
    cached = sum(oracle_cached(sent, block_size))
    prompt_tokens = sum(len(p) for p in sent)
    return {
        "block_size": block_size,
        "requests": len(sent),
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "hit_rate": cached / prompt_tokens if prompt_tokens else None,
    }


def floor_ttft(prompts: list[list[int]], cost, budget: int, block_size: int = 16) -> list[float]:
    """Each prompt's time to first token with nothing ahead of it and the oracle's cache, in
    order: its uncached tokens prefilled alone, in chunks of ``budget`` tokens (the engine's
    ``max_num_batched_tokens``), each chunk a step of the step-time model ``cost``
    (engine.sim.step_time.StepCost). On the simulated engine no router gets below it: a router's
    TTFT quantile can be judged against this one's."""
    from engine.sim.step_time import StepShape, chunk_pairs

    out = []
    for ids, cached in zip(prompts, oracle_cached(prompts, block_size), strict=True):
        seconds, start = 0.0, cached
        while start < len(ids):
            chunk = min(budget, len(ids) - start)
            seconds += cost.seconds(StepShape(chunk, 0, start + chunk, chunk_pairs(start, chunk)))
            start += chunk
        out.append(seconds)
    return out
