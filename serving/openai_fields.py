"""What an OpenAI server of this project reads from a request before it knows anything of a model,
shared by the engine's front (engine/server/openai_api.py) and the router's proxy
(apps/routing/proxy): the OpenAI error, strict JSON, the DP rank a client asks for, the router's
pre-tokenized prompt field and how much text a request asks to tokenize. Neither side owns it, so
neither imports the other for it."""

from __future__ import annotations

import json
import re

import msgspec

_HEADER_INT = re.compile(r"^-?\d+$")


class APIError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, type: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.status,
            }
        }


def too_long_message(max_model_len: int, at_least: int, exact: bool = True) -> str:
    """The engine's words for a prompt over ``max_model_len`` (the router says the same)."""
    return (
        f"This model's maximum context length is {max_model_len} tokens; the prompt has "
        f"{'' if exact else 'at least '}{at_least} tokens"
    )


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def rank_hint(body: dict, headers: dict[str, str], dp_size: int) -> int | None:
    """The requested DP rank from ``routed_dp_rank`` (SGLang's name since sglang#19268),
    ``data_parallel_rank`` / ``data-parallel-rank`` (body) or ``X-data-parallel-rank`` (header);
    None when absent. Anything but an in-range integer is a 400."""
    for key in ("routed_dp_rank", "data_parallel_rank", "data-parallel-rank"):
        if body.get(key) is not None:
            return _check_rank(body[key], key, dp_size)
    header = headers.get("x-data-parallel-rank")
    if header is not None and header.strip() != "":
        value = header.strip()
        return _check_rank(
            int(value) if _HEADER_INT.match(value) else value, "X-data-parallel-rank", dp_size
        )
    return None


def _check_rank(value, param: str, dp_size: int) -> int:
    if not is_int(value) or not 0 <= value < dp_size:
        raise APIError(
            400,
            f"Invalid data_parallel_rank={value!r}: it must be an integer in [0, {dp_size - 1}] "
            f"(dp_size={dp_size})",
            param=param,
        )
    return value


def strict_json(raw: bytes | str):
    """``json.loads`` without the NaN / Infinity / -Infinity that Python's json accepts and JSON
    does not: a body that carries one is a 400 (it would also come out of a re-encoding as null,
    msgspec's choice, not as what the client sent). msgspec parses first (7x faster on a request
    body); what it refuses (those constants, a lone surrogate, a byte-order mark, UTF-16, a number
    past a float's range) goes to json, so what is accepted and what it parses to are json's."""
    try:
        return msgspec.json.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return json.loads(raw, parse_constant=_not_json)


def _not_json(constant: str):
    raise ValueError(f"{constant} is not a JSON value")


# The router's token ids for the prompt (apps/routing/proxy/upstream.py): a router that digested a
# text prompt with this engine's own tokenizer sends them beside the text, so the prompt is
# tokenized once per request, not twice. The text is still validated as if it were tokenized (the
# same 400s for the same bodies); the ids replace only its encoding. Not an OpenAI field: a client
# that sends it itself gets what it would get sending the ids as the prompt.
PRETOKENIZED = "dpmesh_prompt_token_ids"


# A request whose prompt text is this long is parsed (tokenized) in a worker thread, off the event
# loop: the tokenizer releases the GIL for it (engine/tokenizer.py), and shorter ones cost less
# than the thread hop. The router uses the same bound for its own tokenizing.
OFF_LOOP_CHARS = 4096


def prompt_text_chars(body, chat: bool) -> int:
    """How many characters of text a request asks to tokenize (0: token ids, given beside the
    text too, or not a body we understand; ``parse`` says what is wrong with it)."""
    if not isinstance(body, dict) or isinstance(body.get(PRETOKENIZED), list):
        return 0
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return 0
        total = 0
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str):
                total += len(content)
            elif isinstance(content, list):
                total += sum(
                    len(p["text"])
                    for p in content
                    if isinstance(p, dict) and isinstance(p.get("text"), str)
                )
        return total
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    return len(prompt) if isinstance(prompt, str) else 0
