"""What a request looks like to a worker's prefix cache: the chained block digests of the token
ids the engine will see (engine.digests), from the worker's own tokenizer and chat template.

A chat request is templated exactly as the engine templates it; matching raw message text
against a cache of templated tokens is how other routers end up with zero overlap. A worker
whose tokenizer we cannot load gets digests of 64-character chunks of the routing text instead.
"""

from __future__ import annotations

import functools
import logging

import xxhash

from engine.digests import chain_digests

logger = logging.getLogger(__name__)

CHUNK_CHARS = 64


@functools.lru_cache(maxsize=16)
def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    logger.info("loading tokenizer from %s", path)
    return AutoTokenizer.from_pretrained(path)


def _message_text(content) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def prompt_token_ids(body: dict, chat: bool, tokenizer) -> list[int] | None:
    """The token ids the engine will prefill, or None when the body is not one we understand
    (the engine will then reject it; routing does not need to)."""
    if chat:
        messages = body.get("messages")
        if (
            not isinstance(messages, list)
            or not messages
            or not all(isinstance(m, dict) for m in messages)
        ):
            return None
        clean = [
            {"role": m.get("role"), "content": _message_text(m.get("content"))} for m in messages
        ]
        try:
            text = tokenizer.apply_chat_template(clean, add_generation_prompt=True, tokenize=False)
        except Exception:  # a template that rejects these roles: let the engine say so
            return None
        return tokenizer.encode(text, add_special_tokens=False)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special_tokens=False)
    if isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        return prompt
    return None


def routing_text(body: dict, chat: bool) -> str:
    if chat:
        messages = body.get("messages") if isinstance(body.get("messages"), list) else []
        return "".join(
            f"{m.get('role')}:{_message_text(m.get('content'))}\n"
            for m in messages
            if isinstance(m, dict)
        )
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) else str(prompt)


def text_digests(text: str) -> list[int]:
    digests, parent = [], b""
    data = text.encode()
    for start in range(0, len(data) - CHUNK_CHARS + 1, CHUNK_CHARS):
        value = xxhash.xxh64_intdigest(parent + data[start : start + CHUNK_CHARS])
        digests.append(value)
        parent = value.to_bytes(8, "little")
    return digests


class RequestShape:
    """A request as the router routes it: its digests, its prompt size in tokens (or an estimate),
    and the unit one digest covers (``block_tokens``)."""

    __slots__ = ("digests", "prompt_tokens", "block_tokens")

    def __init__(self, digests: list[int], prompt_tokens: int, block_tokens: int):
        self.digests, self.prompt_tokens, self.block_tokens = digests, prompt_tokens, block_tokens

    @property
    def hittable_blocks(self) -> int:
        """Blocks an engine can serve from cache: it always recomputes the last prompt token."""
        return max(0, (self.prompt_tokens - 1) // self.block_tokens)


def shape_request(
    body: dict, chat: bool, tokenizer_path: str | None, block_size: int | None
) -> RequestShape:
    if tokenizer_path and block_size:
        ids = prompt_token_ids(body, chat, load_tokenizer(tokenizer_path))
        if ids is not None:
            return RequestShape(chain_digests(ids, block_size), len(ids), block_size)
    text = routing_text(body, chat)
    # ~4 characters a token: good enough to weigh the work of a foreign engine's request
    return RequestShape(text_digests(text), max(1, len(text) // 4), CHUNK_CHARS // 4)
