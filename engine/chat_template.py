"""Chat templates rendered the way transformers renders them, without transformers.

A sandboxed jinja2 environment (``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``) with
transformers' ``tojson`` filter and its globals (``raise_exception``, ``strftime_now``, a safe
``dict`` and ``namespace``), the ``{% generation %}`` tag, and the plain data a template is allowed
to see. ``engine.tokenizer`` renders through :func:`render_chat`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# str(x) of a `class C(str, Enum)` member is "C.X"; these give the plain value
_EXACT = {str: str.__str__, int: int.__int__, float: float.__float__}


class ChatTemplateError(jinja2.TemplateError, ValueError):
    """A chat template's ``raise_exception(...)``: a jinja ``TemplateError`` as in transformers,
    and a ``ValueError`` so callers that treat bad input as such catch it too."""


def render_chat(
    template: str,
    messages: list,
    *,
    tools: list[dict] | None = None,
    documents: list[dict] | None = None,
    add_generation_prompt: bool = False,
    variables: dict | None = None,
) -> str:
    """One conversation rendered by ``template``; ``variables`` are the special tokens and any
    extra template variables. Messages lose their None-valued keys (OpenAI clients send
    ``content: null``), as in transformers."""
    if tools is not None and not all(isinstance(t, dict) for t in tools):
        raise ValueError("tools must be JSON schemas (dicts); Python callables need transformers")
    if documents is not None and not all(isinstance(d, dict) for d in documents):
        raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
    chat = [_normalize_message(m) for m in messages]
    return compile_chat_template(template).render(
        messages=_alias_reasoning(_plain(chat)),
        tools=_plain(tools),
        documents=_plain(documents),
        add_generation_prompt=add_generation_prompt,
        **_plain(variables or {}),
    )


def _normalize_message(message) -> dict:
    if dataclasses.is_dataclass(message) and not isinstance(message, type):
        message = dataclasses.asdict(message)
    elif callable(getattr(message, "model_dump", None)):  # pydantic, e.g. the OpenAI SDK's
        message = message.model_dump()
    if not isinstance(message, Mapping):
        raise TypeError(f"Chat messages should be dicts, but got {message!r}.")
    return {key: value for key, value in message.items() if value is not None}


def _alias_reasoning(chat: list[dict]) -> list[dict]:
    """Templates read a message's reasoning as ``reasoning_content`` (gpt-oss: ``thinking``);
    clients send any of the names."""
    out = []
    for message in chat:
        given = [message[k] for k in _REASONING_FIELDS if message.get(k) is not None]
        reasoning = given[0] if given else None
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _plain(value: Any) -> Any:
    """Plain JSON-like data only: the sandbox does not know the methods of richer objects, so
    anything else becomes an inert ``"<TypeName>"`` placeholder (templates only test presence)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base in (str, int, float):  # subclasses (enums, ...) carry methods: strip them
        if isinstance(value, base):
            return _EXACT[base](value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
        return _plain(value.item())  # a numpy scalar: np.bool_(False) must stay falsy
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


@functools.lru_cache(maxsize=32)
def compile_chat_template(template: str) -> jinja2.Template:
    """The compiled template (compiled once per template text)."""
    return _environment().from_string(template)


@functools.cache
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    return env


def _raise_exception(message):
    raise ChatTemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja's own tojson escapes <, >, & for HTML and sorts keys; chat templates want plain JSON
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """``dict(...)`` and ``dict.fromkeys(...)`` for templates, without exposing the type."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """jinja's ``namespace()``, refusing underscore names (a path to CPython internals)."""

    def __init__(*args, **kwargs):  # jinja's signature trick: namespace(self=...) still works
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore attributes on a namespace ({name!r})"
            )


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers uses it to find assistant tokens
    for training masks; rendering is unchanged, so the body renders as is (in its own scope,
    like transformers' call block)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()
