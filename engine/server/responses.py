"""OpenAI's Responses API (``POST /v1/responses``) on the chat path: text in, text out.

A request is turned into a chat request (``chat_body``): ``instructions`` as the system message,
the conversation of ``previous_response_id`` (kept by ``ResponseStore``), then ``input`` (a
string, or a list of message items whose content is a string or ``input_text`` /
``output_text`` parts); ``max_output_tokens`` is the chat's ``max_tokens``. It is then parsed,
sampled and scheduled as any chat request (the rank pin included), and its answer is written in
the Responses shapes: a ``response`` object with one assistant ``message`` of ``output_text``, or,
streamed, ``response.created``, ``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta`` ..., then the ``done`` events and ``response.completed``.

The store keeps each stored response's whole conversation (``store`` true, the default) so a
continuation can name it, like vLLM's in-memory store: per engine (any rank may continue it; the
rank that served it holds its prefix in cache, which is why a router sends the continuation there),
bounded (the oldest forgotten first), lost on restart. Tools, reasoning items, files and images
are refused with a 400 naming the field.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict

from serving.openai_fields import APIError

STORE_SIZE = 10_000  # conversations kept for previous_response_id
_TEXT_PARTS = ("input_text", "output_text", "text")


def _content_text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") in _TEXT_PARTS and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise APIError(400, f"{where} must be a string or a list of text parts", param="input")


def input_messages(raw) -> list[dict]:
    """``input`` as chat messages."""
    if isinstance(raw, str) and raw:
        return [{"role": "user", "content": raw}]
    if not (isinstance(raw, list) and raw):
        raise APIError(400, "'input' must be a non-empty string or list of items", param="input")
    out = []
    for i, item in enumerate(raw):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind != "message" or item.get("role") not in (
            "user",
            "assistant",
            "system",
            "developer",
        ):
            raise APIError(
                400,
                f"input[{i}] must be a message with a role user, assistant, system or developer "
                "(tools, reasoning and files are not supported by this engine)",
                param="input",
            )
        text = _content_text(item.get("content"), f"input[{i}].content")
        out.append({"role": item["role"], "content": text})
    return out


class ResponseStore:
    """Stored conversations by response id, the oldest forgotten first."""

    def __init__(self, size: int = STORE_SIZE):
        self.size = size
        self.items: OrderedDict[str, list[dict]] = OrderedDict()

    def get(self, response_id: str) -> list[dict]:
        messages = self.items.get(response_id)
        if messages is None:
            raise APIError(
                404,
                f"Previous response with id '{response_id}' not found.",
                param="previous_response_id",
            )
        return messages

    def put(self, response_id: str, messages: list[dict]) -> None:
        self.items[response_id] = messages
        while len(self.items) > self.size:
            self.items.popitem(last=False)


def chat_body(body: dict, store: ResponseStore) -> tuple[dict, list[dict]]:
    """(the chat request to run, the conversation so far) for a Responses request."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    for field in ("tools", "reasoning", "text", "tool_choice"):
        value = body.get(field)
        if value not in (None, [], {}, "auto", "none") and not (
            field == "text" and value == {"format": {"type": "text"}}
        ):
            raise APIError(400, f"'{field}' is not supported by this engine", param=field)
    messages = []
    previous = body.get("previous_response_id")
    if previous is not None:
        if not isinstance(previous, str):
            raise APIError(400, "'previous_response_id' must be a string",
                           param="previous_response_id")  # fmt: skip
        messages += store.get(previous)
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise APIError(400, "'instructions' must be a string", param="instructions")
        # instructions are this request's own: a continuation does not inherit the last ones
        messages = [m for m in messages if m["role"] != "system"]
        messages.insert(0, {"role": "system", "content": instructions})
    messages += input_messages(body.get("input"))
    chat = {"messages": messages, "stream": body.get("stream", False)}
    for ours, theirs in (("max_tokens", "max_output_tokens"), ("temperature", "temperature"),
                         ("top_p", "top_p"), ("model", "model"), ("seed", "seed"),
                         ("cache_salt", "cache_salt")):  # fmt: skip
        if body.get(theirs) is not None:
            chat[ours] = body[theirs]
    for key in ("data_parallel_rank", "routed_dp_rank", "data-parallel-rank"):
        if key in body:
            chat[key] = body[key]
    return chat, messages


def new_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def response_object(rid: str, model: str, body: dict, status: str, text: str | None,
                    usage: dict | None, created: int) -> dict:  # fmt: skip
    """The ``response`` object: ``text`` None while it is in progress (no output yet)."""
    output = []
    if text is not None:
        output.append(message_item(rid, text, "completed"))
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "model": model,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "previous_response_id": body.get("previous_response_id"),
        "temperature": body.get("temperature", 1.0),
        "top_p": body.get("top_p", 1.0),
        "store": body.get("store", True),
        "parallel_tool_calls": False,
        "tool_choice": "none",
        "tools": [],
        "text": {"format": {"type": "text"}},
        "output": output,
        "usage": usage,
        "error": None,
        "incomplete_details": None,
        "metadata": body.get("metadata") or {},
    }


def message_item(rid: str, text: str, status: str) -> dict:
    return {
        "type": "message",
        "id": "msg_" + rid.removeprefix("resp_"),
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + output_tokens,
    }


class EventWriter:
    """The streamed events of one response, numbered in order."""

    def __init__(self, rid: str, model: str, body: dict):
        self.rid, self.model, self.body = rid, model, body
        self.created = int(time.time())
        self.seq = 0
        self.item_id = "msg_" + rid.removeprefix("resp_")

    def event(self, kind: str, **fields) -> tuple[str, dict]:
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return kind, payload

    def part_event(self, kind: str, **fields) -> tuple[str, dict]:
        """An event about the one text part of the one output message."""
        return self.event(kind, item_id=self.item_id, output_index=0, content_index=0, **fields)

    def opening(self) -> list[tuple[str, dict]]:
        started = response_object(self.rid, self.model, self.body, "in_progress", None, None,
                                  self.created)  # fmt: skip
        item = {**message_item(self.rid, "", "in_progress"), "content": []}
        part = {"type": "output_text", "text": "", "annotations": []}
        return [
            self.event("response.created", response=started),
            self.event("response.in_progress", response=started),
            self.event("response.output_item.added", output_index=0, item=item),
            self.part_event("response.content_part.added", part=part),
        ]

    def delta(self, text: str) -> tuple[str, dict]:
        return self.part_event("response.output_text.delta", delta=text)

    def closing(self, text: str, use: dict) -> list[tuple[str, dict]]:
        part = {"type": "output_text", "text": text, "annotations": []}
        done = response_object(self.rid, self.model, self.body, "completed", text, use,
                               self.created)  # fmt: skip
        item = message_item(self.rid, text, "completed")
        return [
            self.part_event("response.output_text.done", text=text),
            self.part_event("response.content_part.done", part=part),
            self.event("response.output_item.done", output_index=0, item=item),
            self.event("response.completed", response=done),
        ]
