"""OpenAI request parsing and response shapes for /v1/completions and /v1/chat/completions.

Parsing is strict: every value is type-checked before anything is queued, and a bad one is an
``APIError`` carrying the HTTP status and the OpenAI error body.
"""

from __future__ import annotations

import base64
import struct
import time
from dataclasses import dataclass

from engine.sampling_params import SamplingParams
from engine.server.served_models import ServedModels
from engine.tokenize_cache import TooManyTokens, encode_text
from serving.openai_fields import PRETOKENIZED, APIError, is_int, rank_hint, too_long_message

CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}


@dataclass
class ParsedRequest:
    chat: bool
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    model: str
    rank_hint: int | None
    pretokenized: bool = False  # the prompt's ids came with it (PRETOKENIZED): not encoded here
    predicted: int | None = None  # the prompt tokens a router predicted cached (PREDICTED_HEADER)


# a router's prediction of the prompt tokens this engine has cached for a request (ours sends it:
# apps/routing/proxy/wire.py): counted against what the rank had, on /metrics and in the log
PREDICTED_HEADER = "x-dpmesh-predicted-cached-tokens"


def predicted_of(headers: dict[str, str]) -> int | None:
    """The router's prediction, or None (absent or not a small non-negative integer)."""
    value = headers.get(PREDICTED_HEADER)
    if value is None or not value.isdigit() or len(value) > 9:
        return None
    return int(value)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _opt(body: dict, key: str, check, what: str, default=None):
    value = body.get(key)
    if value is None:
        return default
    if not check(value):
        raise APIError(400, f"'{key}' must be {what}, got {value!r}", param=key)
    return value


def add_special_tokens(body: dict, default: bool) -> bool:
    """vLLM's ``add_special_tokens``: whether a text prompt is encoded with the tokenizer's
    special tokens (true by default for a completion or an embedding's input, false for a chat,
    whose template writes its own)."""
    return _opt(body, "add_special_tokens", lambda v: isinstance(v, bool), "a boolean", default)


def _unsupported(body: dict) -> None:
    if body.get("n") not in (None, 1):
        raise APIError(400, "only n=1 is supported", param="n")
    if body.get("best_of") not in (None, 1):
        raise APIError(400, "only best_of=1 is supported", param="best_of")
    if body.get("logprobs") not in (None, False, 0) or body.get("top_logprobs") not in (None, 0):
        raise APIError(400, "logprobs are not supported by this engine", param="logprobs")
    if body.get("echo") not in (None, False):
        raise APIError(400, "echo is not supported by this engine", param="echo")
    for key in ("presence_penalty", "frequency_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            raise APIError(400, f"{key} is not supported by this engine", param=key)


def sampling_params(
    body: dict, default_max_tokens: int, lora_name: str | None = None
) -> SamplingParams:
    _unsupported(body)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (not is_int(max_tokens) or max_tokens <= 0):
        raise APIError(
            400, f"'max_tokens' must be a positive integer, got {max_tokens!r}", param="max_tokens"
        )
    stop = body.get("stop")
    if stop is not None and not (
        isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
    ):
        raise APIError(400, "'stop' must be a string or a list of strings", param="stop")
    return SamplingParams(
        max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
        temperature=_opt(
            body, "temperature", lambda v: _is_number(v) and v >= 0, "a number >= 0", 1.0
        ),
        top_p=_opt(
            body, "top_p", lambda v: _is_number(v) and 0 < v <= 1, "a number in (0, 1]", 1.0
        ),
        top_k=_opt(body, "top_k", lambda v: is_int(v) and v >= -1, "an integer >= -1", 0),
        seed=_opt(body, "seed", is_int, "an integer"),
        stop=[stop] if isinstance(stop, str) else list(stop or []),
        stop_token_ids=_opt(
            body,
            "stop_token_ids",
            lambda v: isinstance(v, list) and all(map(is_int, v)),
            "a list of integers",
            [],
        ),
        ignore_eos=_opt(body, "ignore_eos", lambda v: isinstance(v, bool), "a boolean", False),
        cache_salt=_opt(
            body, "cache_salt", lambda v: isinstance(v, str) and v != "", "a non-empty string"
        ),
        lora_name=lora_name,
    )


def completion_prompt(
    body: dict, tokenizer, vocab_size: int, given: list[int] | None = None, limit: int | None = None
) -> list[int]:
    """``given``: the text prompt's token ids, already computed (``PRETOKENIZED``); ``limit``:
    encoding stops, ``TooManyTokens``, once the prompt is known to be longer. A text is encoded
    with the tokenizer's special tokens (a Llama's BOS) unless ``add_special_tokens`` is false,
    as vLLM does."""
    special = add_special_tokens(body, True)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return given if given is not None else encode_text(tokenizer, prompt, limit, special)
    if isinstance(prompt, list) and prompt and all(map(is_int, prompt)):
        if not all(0 <= t < vocab_size for t in prompt):
            raise APIError(400, f"prompt token ids must be in [0, {vocab_size})", param="prompt")
        return prompt
    if (
        isinstance(prompt, list)
        and len(prompt) > 1
        and all(isinstance(p, (str, list)) for p in prompt)
    ):
        raise APIError(
            400, "batched prompts are not supported: send one prompt per request", param="prompt"
        )
    raise APIError(
        400, "'prompt' must be a non-empty string or a non-empty list of token ids", param="prompt"
    )


def pretokenized(body: dict, vocab_size: int) -> list[int] | None:
    ids = body.get(PRETOKENIZED)
    if ids is None:
        return None
    if not (isinstance(ids, list) and ids and all(map(is_int, ids))) or not all(
        0 <= t < vocab_size for t in ids
    ):
        raise APIError(
            400,
            f"'{PRETOKENIZED}' must be a non-empty list of token ids in [0, {vocab_size})",
            param=PRETOKENIZED,
        )
    return ids


def _message_text(msg: dict, i: int) -> str:
    content = msg.get("content")
    if content is None and msg.get("role") == "assistant":
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise APIError(
        400, f"messages[{i}].content must be a string or a list of text parts", param="messages"
    )


def chat_prompt(
    body: dict, tokenizer, given: list[int] | None = None, limit: int | None = None
) -> list[int]:
    """Token ids of the chat exactly as the model sees it: its chat template with the
    generation prompt, then encoded without extra special tokens (the template writes them;
    ``add_special_tokens: true`` adds the tokenizer's too, as vLLM does). The router digests the
    same (and sends them: ``given``, which replaces the encoding once the messages are
    checked)."""
    special = add_special_tokens(body, False)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list", param="messages")
    clean = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or msg.get("role") not in CHAT_ROLES:
            raise APIError(
                400,
                f"messages[{i}] must be an object with a role in {sorted(CHAT_ROLES)}",
                param="messages",
            )
        clean.append({"role": msg["role"], "content": _message_text(msg, i)})
    if given is not None:
        return given
    text = tokenizer.apply_chat_template(clean, add_generation_prompt=True, tokenize=False)
    return encode_text(tokenizer, text, limit, special)


def parse(
    body,
    headers: dict[str, str],
    *,
    chat: bool,
    tokenizer,
    models: ServedModels,
    dp_size: int,
    max_model_len: int,
    vocab_size: int,
) -> ParsedRequest:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    model = body.get("model")
    lora_name = models.adapter(model)  # 404 for a model this engine does not serve
    hint = rank_hint(body, headers, dp_size)
    stream = _opt(body, "stream", lambda v: isinstance(v, bool), "a boolean", False)
    options = _opt(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
    if options and not stream:
        raise APIError(
            400, "'stream_options' is only allowed when 'stream' is true", param="stream_options"
        )
    given = pretokenized(body, vocab_size)
    try:
        if chat:
            ids = chat_prompt(body, tokenizer, given, limit=max_model_len)
        else:
            ids = completion_prompt(body, tokenizer, vocab_size, given, limit=max_model_len)
    except TooManyTokens as exc:
        raise APIError(
            400,
            too_long_message(max_model_len, exc.at_least, exact=False),
            param="messages" if chat else "prompt",
        ) from exc
    room = max_model_len - len(ids)
    if room <= 0:
        raise APIError(
            400, too_long_message(max_model_len, len(ids)), param="messages" if chat else "prompt"
        )
    try:
        params = sampling_params(body, room if chat else min(16, room), lora_name)
    except ValueError as exc:
        raise APIError(400, str(exc)) from exc
    if len(ids) + params.max_tokens > max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{len(ids)} tokens and max_tokens is {params.max_tokens}",
            param="max_tokens",
        )
    return ParsedRequest(
        chat,
        ids,
        params,
        stream,
        bool(options.get("include_usage")),
        model or "",
        hint,
        pretokenized=given is not None and ids is given,
        predicted=predicted_of(headers),
    )


# ----- responses ------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def response(
    req: ParsedRequest, rid: str, model: str, text: str, finish: str | None, use: dict
) -> dict:
    if req.chat:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish,
        }
        return {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [choice],
            "usage": use,
        }
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": use,
    }


def chunk(
    req: ParsedRequest,
    rid: str,
    model: str,
    created: int,
    text: str | None,
    finish: str | None,
    role: bool = False,
) -> dict:
    if req.chat:
        delta = (
            {"role": "assistant", "content": ""}
            if role
            else ({"content": text} if text is not None else {})
        )
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    out = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
    return out


def usage_chunk(req: ParsedRequest, rid: str, model: str, created: int, use: dict) -> dict:
    obj = "chat.completion.chunk" if req.chat else "text_completion"
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [],
        "usage": use,
    }


# ----- /v1/embeddings ----------------------------------------------------------------------------
def embedding_inputs(body: dict, tokenizer, vocab_size: int, max_model_len: int) -> list[list[int]]:
    """The token ids of each input of an embeddings request: OpenAI's ``input`` is a string, a
    list of strings, a list of token ids, or a list of such lists. Each must be non-empty and fit
    ``max_model_len``; anything else is a 400 naming ``input``."""
    raw = body.get("input")
    if isinstance(raw, str) or (isinstance(raw, list) and raw and all(map(is_int, raw))):
        raw = [raw]
    if not (isinstance(raw, list) and raw):
        raise APIError(
            400,
            "'input' must be a string, a list of strings, a list of token ids or a list of such",
            param="input",
        )
    special = add_special_tokens(body, True)
    out = []
    for item in raw:
        if isinstance(item, str) and item:
            try:
                ids = encode_text(tokenizer, item, max_model_len, special)
            except TooManyTokens as exc:
                raise APIError(
                    400, too_long_message(max_model_len, exc.at_least, exact=False), param="input"
                ) from exc
        elif isinstance(item, list) and item and all(map(is_int, item)):
            if not all(0 <= t < vocab_size for t in item):
                raise APIError(400, f"token ids must be in [0, {vocab_size})", param="input")
            ids = item
        else:
            raise APIError(400, "each input must be a non-empty string or token id list",
                           param="input")  # fmt: skip
        if len(ids) > max_model_len:
            raise APIError(400, too_long_message(max_model_len, len(ids)), param="input")
        out.append(ids)
    if body.get("dimensions") is not None:
        raise APIError(400, "'dimensions' is not supported by this model", param="dimensions")
    if body.get("encoding_format", "float") not in ("float", "base64"):
        raise APIError(400, "'encoding_format' must be 'float' or 'base64'",
                       param="encoding_format")  # fmt: skip
    return out


def embeddings_answer(vectors: list[list[float]], model: str, tokens: int, fmt: str) -> dict:
    """OpenAI's embeddings answer; ``base64``: each vector as little-endian float32 bytes."""
    data = []
    for index, vector in enumerate(vectors):
        value = (
            base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
            if fmt == "base64"
            else vector
        )
        data.append({"object": "embedding", "index": index, "embedding": value})
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return {"object": "list", "data": data, "model": model, "usage": usage}
