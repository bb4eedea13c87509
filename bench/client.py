"""One streamed OpenAI request, timed: TTFT, inter-token gaps, end-to-end latency, usage, rank."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx

RANK_HEADER = "x-data-parallel-rank"


@dataclass
class RequestResult:
    """What one request measured. Times are seconds; ``start`` is on the run's perf_counter
    clock."""

    ok: bool = False
    start: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between content chunks after the first
    latency: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int | None = None  # None: the server reported no prompt_tokens_details
    usage_reported: bool = False
    rank: int | None = None  # from the X-Data-Parallel-Rank response header
    status: int | None = None
    retry_after: str | None = None  # the Retry-After header of a refused (non-200) response
    done: bool = False  # the stream ended with ``data: [DONE]``
    error: str = ""
    text: str = ""
    meta: dict = field(default_factory=dict)  # dataset bookkeeping (group, conversation, turn)


def completion_body(model: str, prompt, max_tokens: int, options: dict) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, **_common(options)}


def chat_body(model: str, messages: list[dict], max_tokens: int, options: dict) -> dict:
    return {"model": model, "messages": messages, "max_tokens": max_tokens, **_common(options)}


def _common(options: dict) -> dict:
    """Greedy, streamed, with usage; ``ignore_eos`` keeps output lengths exact where it is
    accepted."""
    body = {"temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if options.get("ignore_eos", True):
        body["ignore_eos"] = True
    return {**body, **options.get("extra_body", {})}


async def send(
    client: httpx.AsyncClient, path: str, body: dict, prompt_len: int = 0
) -> RequestResult:
    """POST ``body`` to ``path`` with streaming and measure it. Never raises for a failed request:
    the error lands in the result (a benchmark counts failures, it does not stop at the first)."""
    result = RequestResult(start=time.perf_counter(), prompt_tokens=prompt_len)
    chunks = _Chunks(result)
    try:
        async with client.stream("POST", path, json=body) as response:
            result.status = response.status_code
            result.rank = _rank(response.headers.get(RANK_HEADER))
            if response.status_code != 200:
                result.retry_after = response.headers.get("retry-after")
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {text[:300]}"
                return _finish(result)
            over = False
            async for line in response.aiter_lines():
                if over:
                    continue  # after [DONE], read to the stream's end: as OpenAI's SDK does, so
                    # the connection goes back to the pool instead of being closed unread
                if not chunks.feed(line):
                    if not result.done:
                        break  # an error event
                    over = True
    except (httpx.HTTPError, OSError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return _finish(result)
    result.ok = not result.error and chunks.seen_content_or_usage
    if not result.ok and not result.error:
        result.error = "the stream ended without any output"
    if not result.usage_reported:
        result.output_tokens = chunks.content_chunks  # best guess when the server sends no usage
    return _finish(result)


def _finish(result: RequestResult) -> RequestResult:
    result.latency = time.perf_counter() - result.start
    return result


def _rank(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


class _Chunks:
    """Feeds SSE lines into a result: timing per content chunk, usage from the usage chunk."""

    def __init__(self, result: RequestResult):
        self.result = result
        self.last: float | None = None
        self.content_chunks = 0
        self.seen_content_or_usage = False
        self.parts: list[str] = []

    def feed(self, line: str) -> bool:
        """Take one line; False once the stream is over ([DONE] or an error event)."""
        if not line.startswith("data:"):
            return True  # blank separators, comments, event names
        data = line[5:].strip()
        if data == "[DONE]":
            self.result.done = True
            self.result.text = "".join(self.parts)
            return False
        try:
            payload = json.loads(data)
        except ValueError:
            self.result.error = f"unparseable SSE data: {data[:200]}"
            return False
        if not isinstance(payload, dict) or payload.get("error"):
            self.result.error = f"error event: {json.dumps(payload)[:300]}"
            return False
        self._content(payload.get("choices") or [])
        self._usage(payload.get("usage"))
        self.result.text = "".join(self.parts)
        return True

    def _content(self, choices: list) -> None:
        if not choices:
            return
        choice = choices[0]
        text = (
            choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
        )
        if not text:
            return  # role-only or finish-only chunks carry no token
        now = time.perf_counter()
        if self.last is None:
            self.result.ttft = now - self.result.start
        else:
            self.result.itl.append(now - self.last)
        self.last = now
        self.content_chunks += 1
        self.seen_content_or_usage = True
        self.parts.append(text)

    def _usage(self, usage) -> None:
        if not isinstance(usage, dict):
            return
        self.seen_content_or_usage = True
        self.result.usage_reported = True
        self.result.prompt_tokens = usage.get("prompt_tokens") or self.result.prompt_tokens
        self.result.output_tokens = usage.get("completion_tokens") or 0
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and details.get("cached_tokens") is not None:
            self.result.cached_tokens = details["cached_tokens"]
