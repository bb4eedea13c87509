"""Whether the router may send a vLLM worker a completion's prompt as token ids instead of text.

The router tokenizes every text prompt it routes to a worker whose tokenizer it can load (its
digests must be the engine's). vLLM then encodes the same text again, on its API server's one
core, before it schedules the request (docs/benchmarks.md, "Behind a real vLLM", has what that
costs). Sent the ids the router already has, vLLM skips that step. Dynamo's frontend and
SGLang's gRPC gateway do the same: the gateway tokenizes, the workers take ids.

Ids in place of text change what the engine computes if the two encodings differ (a
tokenizer_config option transformers applies and the lean tokenizer does not, a newer
tokenizers release): the ids must be the ones vLLM would compute. So before the first, the
router asks the worker's ``/tokenize`` for a few probes, which hold the pieces encodings trip
on (leading and repeated spaces, tabs and newlines, digits, accents, CJK, an emoji, a special
token written in the text), and compares them with its own encoding of each with the
tokenizer's special tokens, as vLLM encodes a completion. Only a worker whose every answer
agrees gets ids (``WorkerView.prompt_ids``); one that disagrees, or has no ``/tokenize``, or
does not answer, keeps getting text, and the router says so in its log. Only completions with
one text prompt and neither ``echo`` nor ``prompt_logprobs`` (those give the prompt's text or
tokens back, which vLLM would then rebuild from the ids); chat is never sent as ids (vLLM renders
its own chat template, and its chat endpoint takes no ids).
"""

from __future__ import annotations

import asyncio
import json
import logging

from django.conf import settings

from apps.routing.decision.request_shape import tokenizer_or_none
from controlplane import http
from engine.tokenize_cache import encode_text

logger = logging.getLogger(__name__)

PROBES = (
    "Hello world",
    "  The quick brown fox, née Smith, didn't jump over 12 lazy dogs at 3:45pm.\n\n\tIndented"
    "   text; 日本語のテキスト, émigré café, 🙂 x=1+2 [a] {b} (c) <|im_start|>user\nhi<|im_end|>",
    "def f(x):\n    return x ** 2  # squares\n\n\n",
)
TIMEOUT_S = 10.0


async def agrees(view) -> bool | None:
    """Whether ``view``'s ``/tokenize`` gives the router's ids for every probe (None: it could
    not be asked: no tokenizer here, no such endpoint, no answer)."""
    tokenizer = await asyncio.to_thread(tokenizer_or_none, view.own_tokenizer_path)
    if tokenizer is None:
        return None
    session = http.client.get()
    for probe in PROBES:
        body = {"prompt": probe, **({"model": view.model} if view.model else {})}
        try:
            async with session.post(
                view.url + "/tokenize",
                json=body,
                headers=http.auth_headers(view.api_key),
                timeout=http.timeout(TIMEOUT_S),
            ) as response:
                text = await response.text(errors="replace")
                status = response.status
        except http.ERRORS:
            return None
        if status != 200:
            return None
        try:
            tokens = json.loads(text).get("tokens")
        except (ValueError, AttributeError):
            return None
        if tokens != encode_text(tokenizer, probe, None, True):
            return False
    return True


async def check(view) -> None:
    """Set ``view.prompt_ids`` from ``agrees`` (the view is the router's installed one)."""
    verdict = await agrees(view)
    view.prompt_ids = verdict is True
    if verdict is False:
        logger.warning(
            "worker %s: its /tokenize differs from the router's tokenizer (%s): prompts go to "
            "it as text",
            view.url,
            view.own_tokenizer_path,
        )
    elif verdict is True:
        logger.info("worker %s: completions' text prompts go to it as token ids", view.url)
    else:
        logger.info(
            "worker %s: its /tokenize could not be asked (or its tokenizer loaded here): prompts "
            "go to it as text",
            view.url,
        )


def enabled() -> bool:
    """``CONTROL_PLANE_PROMPT_IDS``: prompts go to engines as ids at all (off: text only). A
    settings dict a test replaced whole may lack it: on, the default."""
    return settings.CONTROL_PLANE.get("PROMPT_IDS", True)


def wanted(view) -> bool:
    """Whether ``view`` is a worker to check: vLLM, serving requests whole (not a prefill or
    decode leg), with its own tokenizer files readable here."""
    return view.flavour == "vllm" and view.role is None and view.own_tokenizer_path is not None
