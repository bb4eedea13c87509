"""What a request looks like to a worker's prefix cache: the chained block digests of the token
ids the engine will see (engine.digests), from the worker's own tokenizer and chat template.

A chat request is templated exactly as the engine templates it; matching raw message text
against a cache of templated tokens is how other routers end up with zero overlap. A worker
whose tokenizer we cannot load gets digests of 64-character chunks of the routing text instead.

Tokenizers are engine.tokenizer's lean ones (tokenizers + jinja2, rendering as transformers does):
importing transformers would import torch and cost the router hundreds of MB.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os

import xxhash

from apps.routing.decision.index import core_module
from engine import digests as engine_digests
from engine.digests import namespace
from engine.tokenize_cache import TooManyTokens, encode_text
from serving.openai_fields import OFF_LOOP_CHARS, prompt_text_chars

logger = logging.getLogger(__name__)

CHUNK_CHARS = 64
# tokenizing for routing stops here when no worker's max_model_len says where (past it a request
# is routed on the digests of its text's first 4 x this many characters)
ROUTING_TOKEN_CAP = 2**20


@functools.lru_cache(maxsize=16)
def load_tokenizer(path: str):
    """The tokenizer of the model directory ``path``, loaded once. A directory without
    ``tokenizer.json`` (SentencePiece only) still loads, through transformers (and torch)."""
    from engine.tokenizer import load_tokenizer as load_lean

    logger.info("loading tokenizer from %s", path)
    try:
        return load_lean(path)
    except ValueError:
        if not os.path.isdir(path) or os.path.isfile(os.path.join(path, "tokenizer.json")):
            raise
    logger.warning("%s has no tokenizer.json: loading it with transformers (imports torch)", path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


@functools.lru_cache(maxsize=16)
def tokenizer_or_none(path: str):
    """``load_tokenizer``, or None (said once per path) when it cannot be loaded: the worker's
    requests then get text digests instead of failing."""
    try:
        return load_tokenizer(path)
    except Exception:
        logger.warning(
            "cannot load the tokenizer at %s: routing on text digests", path, exc_info=True
        )
        return None


def _message_text(content) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def prompt_token_ids(
    body: dict, chat: bool, tokenizer, limit: int | None = None
) -> list[int] | None:
    """The token ids the engine will prefill, or None when the body is not one we understand
    (the engine will then reject it; routing does not need to). ``limit``: ``TooManyTokens`` as
    soon as the prompt is known to hold more tokens (engine.tokenize_cache.encode_text).

    A completion's text is encoded with the tokenizer's special tokens (a Llama's BOS) and a
    chat's templated text without (the template writes its own), unless the body's
    ``add_special_tokens`` says otherwise: what vLLM, SGLang and our engine prefill."""
    special = body.get("add_special_tokens")
    if not isinstance(special, bool):
        special = not chat
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
        return encode_text(tokenizer, text, limit, special)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, str):
        return encode_text(tokenizer, prompt, limit, special)
    if isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        if limit is not None and len(prompt) > limit:
            raise TooManyTokens(len(prompt), limit)
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


def tenant_namespace(body: dict, adapter: str | None = None) -> int | None:
    """The parent of the prompt's first block for the request's tenant (engine/digests.py
    ``namespace``): its ``cache_salt`` (vLLM's and our engine's key) and the LoRA adapter it runs
    with (its ``model``, where the worker serves an adapter of that name). A malformed salt routes
    as none: the engine answers it with a 400."""
    salt = body.get("cache_salt")
    return namespace(salt if isinstance(salt, str) and salt else None, adapter)


def text_digests(text: str, parent: int | None = None) -> list[int]:
    """The chained digests of ``text``'s whole 64-byte chunks (UTF-8): each chunk hashed with its
    parent's digest as the seed (``parent``: the first chunk's, a tenant's namespace; 0 without).
    In the native core where it built (one call, not a hash call a chunk)."""
    data = text.encode()
    if _CORE is not None:
        return _CORE.text_digests(data, parent or 0, CHUNK_CHARS)
    digests: list[int] = []
    seed = parent or 0
    digest, append = xxhash.xxh64_intdigest, digests.append
    for start in range(0, len(data) - CHUNK_CHARS + 1, CHUNK_CHARS):
        seed = digest(data[start : start + CHUNK_CHARS], seed)
        append(seed)
    return digests


def chain_digests(ids, block_size: int, parent: int | None = None) -> list[int]:
    """engine/digests.py ``chain_digests`` (the engine's own digests of token ids), in the
    native core where it built."""
    if _CORE is None or type(ids) is not list:
        return engine_digests.chain_digests(ids, block_size, parent)
    return _CORE.chain_digests(ids, block_size, parent)


_CORE = core_module()


class RequestShape:
    """A request as the router routes it: its digests, its prompt size in tokens (or an estimate),
    the unit one digest covers (``block_tokens``), and whether it is a chat turn (``chat``).
    ``prefix_share`` is the router's, set before a policy reads the shape: the fraction of recent
    requests that shared the prefix this one shares (apps/routing/decision/demand.py
    ``PrefixDemand``; None: not known, and a policy takes the prefix as hot), ``prefix_requests``
    how many requests that is (decayed alike: the prefix's traffic, what a copy of it would
    move). ``volume_excess`` is
    the router's too: each candidate's prompt tokens of the last minutes relative to the candidates'
    mean (``ServedVolume.excess``; None: not known, and a policy ignores it). ``warm`` is the
    router's too, on an idle fleet: the candidates that were their worker's rank used last and
    have room for the request in their cache (empty while anything is in flight), worked out when
    first read (``warm_of``: only a policy breaking a tie reads it). ``ids`` are the
    token ids the digests were made from (None: digests of text, no tokenizer) and ``namespace``
    the tenant key they chain on (``tenant_namespace``): what the miss reasons look at
    (apps/routing/decision/misses.py)."""

    __slots__ = ("digests", "prompt_tokens", "block_tokens", "chat", "prefix_share",
                 "prefix_requests", "volume_excess", "_warm", "warm_of", "hittable_blocks",
                 "ids", "namespace")  # fmt: skip

    def __init__(
        self,
        digests: list[int],
        prompt_tokens: int,
        block_tokens: int,
        chat: bool = False,
        ids=None,
        namespace: int | None = None,
    ):
        self.digests, self.prompt_tokens, self.block_tokens = digests, prompt_tokens, block_tokens
        self.ids, self.namespace = ids, namespace
        # blocks an engine can serve from cache: it always recomputes the last prompt token (read
        # several times per candidate by the policy: an attribute, not a property)
        self.hittable_blocks = max(0, (prompt_tokens - 1) // block_tokens)
        self.chat = chat
        self.prefix_share: float | None = None
        self.prefix_requests = 0.0
        self.volume_excess: dict[str, float] | None = None
        self._warm: frozenset[str] | None = None
        self.warm_of = None  # the router's: gives ``warm`` when it is first read

    @property
    def warm(self) -> frozenset[str]:
        if self._warm is None:
            self._warm = self.warm_of() if self.warm_of is not None else frozenset()
        return self._warm

    @warm.setter
    def warm(self, keys: frozenset[str]) -> None:
        self._warm = keys


def tokenizes_off_loop(body: dict, chat: bool) -> bool:
    """Whether ``tokenize_off_loop`` has anything to do for ``body`` (a prompt of token ids to
    bound, or long text): a short text prompt skips it, and the await it would cost."""
    if not chat and isinstance(body.get("prompt"), list):
        return True
    return prompt_text_chars(body, chat) >= OFF_LOOP_CHARS


async def tokenize_off_loop(
    body: dict, chat: bool, tokenizer_paths, limit=None
) -> dict[str, list[int] | None]:
    """The prompt's token ids for each of ``tokenizer_paths``, computed in worker threads when the
    prompt is long text (the tokenizer releases the GIL: the event loop keeps relaying streams
    meanwhile, and a router on several cores tokenizes on them), else {} (``shape_request``
    tokenizes inline). For ``shape_request``'s ``known_ids``. ``tokenizer_paths`` may be a
    function giving them: only a long prompt then pays for looking them up.

    ``limit``: the most tokens any worker could take (or a function giving it, called only for
    a token-id prompt or a long one); ``TooManyTokens`` as soon as the prompt is known to hold
    more. Without one, tokenizing stops at ``ROUTING_TOKEN_CAP`` all the same, and the path's ids
    are None (the request is routed on its text)."""
    prompt = body.get("prompt")
    if not chat and isinstance(prompt, list):
        if callable(limit):
            limit = limit()
        if limit is not None and len(prompt) > limit:
            prompt_token_ids(body, chat, None, limit)  # raises for a token-id prompt that long
    if prompt_text_chars(body, chat) < OFF_LOOP_CHARS:
        return {}
    if callable(limit):
        limit = limit()
    if callable(tokenizer_paths):
        tokenizer_paths = tokenizer_paths()
    out = {}
    for path in tokenizer_paths:
        tokenizer = tokenizer_or_none(path)
        if tokenizer is None:
            continue
        bound = limit or ROUTING_TOKEN_CAP
        try:
            out[path] = await asyncio.to_thread(prompt_token_ids, body, chat, tokenizer, bound)
        except TooManyTokens:
            if limit is not None:
                raise
            out[path] = None
    return out


def shape_request(
    body: dict,
    chat: bool,
    tokenizer_path: str | None,
    block_size: int | None,
    known_ids: dict[str, list[int] | None] | None = None,
    adapter: str | None = None,
) -> RequestShape:
    """``known_ids``: token ids already computed per tokenizer path (``tokenize_off_loop``);
    ``adapter``: the LoRA adapter the request runs with on these workers."""
    tokenizer = tokenizer_or_none(tokenizer_path) if tokenizer_path and block_size else None
    if tokenizer is not None:
        if known_ids and tokenizer_path in known_ids:
            ids = known_ids[tokenizer_path]
        else:
            ids = prompt_token_ids(body, chat, tokenizer)
        if ids is not None:
            tenant = tenant_namespace(body, adapter)
            digests = chain_digests(ids, block_size, tenant)
            return RequestShape(digests, len(ids), block_size, chat, ids, tenant)
    text = routing_text(body, chat)
    # ~4 characters a token: good enough to weigh the work of a foreign engine's request
    tenant = tenant_namespace(body, adapter)
    digests = text_digests(text[: 4 * ROUTING_TOKEN_CAP], tenant)
    return RequestShape(digests, max(1, len(text) // 4), CHUNK_CHARS // 4, chat, None, tenant)
