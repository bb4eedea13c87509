"""What each engine flavour wants on the wire, and what comes back, in one place.

- The rank: in the JSON body (``data_parallel_rank``: ours and ATOM's; SGLang's
  ``routed_dp_rank`` from 0.5.9, its old name before: ``WorkerView.rank_fields``) and in the
  ``X-data-parallel-rank`` header (the only place vLLM reads it), sent to every flavour.
- The prompt's token ids beside its text (``PRETOKENIZED``), to our own engine only and only
  when made with the engine's own tokenizer: the engine then skips its encoding.
- Streams always ask the engine for usage (``stream_options.include_usage``): the router needs
  each request's cached tokens; the usage-only event is dropped for a client that did not ask.
- The answer names the target (``X-Routed-Target``) and the rank that served it, and says what
  the router's own work took (``X-Dpmesh-Overhead-Duration-Ms``).
"""

from __future__ import annotations

import json

import msgspec

from apps.routing.decision.dispatch import Dispatch
from apps.routing.decision.router import Router
from controlplane import http, http1
from serving import tracing
from serving.openai_fields import PRETOKENIZED


def ids_for(
    router: Router, target, ids_by_path: dict, body: dict | None = None, shape=None
) -> list[int] | None:
    """A completion's text prompt as the token ids the router made of it to route it, so the
    engine need not tokenize it again: to a worker whose ``WorkerView.prompt_ids`` says it takes
    them (apps/routing/feeds/prompt_ids.py: our own engine, beside the text, which it still
    checks, serving/openai_fields.py ``PRETOKENIZED``; a vLLM whose ``/tokenize`` agreed with the
    router's encoding, in place of the text), and only ids made with the engine's own tokenizer
    files (not a ``--tokenizer-path`` of the router's). ``ids_by_path``: a long prompt's ids,
    tokenized off the loop; ``shape``: the request's shape for ``target``, whose ids the router
    made inline; without ``body`` (a prefill/decode leg) only the former. Not where the prompt
    comes back (``echo``, ``prompt_logprobs``: vLLM would rebuild it from the ids).

    Not for chat (the caller's rule): there the router renders the chat template itself
    (engine.chat_template), held to transformers' rendering by tests for the templates we know,
    but a user's template could render differently, and then the engine would compute another
    prompt than its own."""
    worker = target.worker
    own = worker.own_tokenizer_path
    if not worker.prompt_ids or not own or router.tokenizer_path_of(target) != own:
        return None  # the router's --tokenizer-path made them, or the worker takes text
    ids = ids_by_path.get(own) if ids_by_path else None
    if body is None:
        return ids
    if body.get("echo") or body.get("prompt_logprobs"):
        return None
    prompt = body.get("prompt")
    if not (isinstance(prompt, str) or (isinstance(prompt, list) and len(prompt) == 1
                                        and isinstance(prompt[0], str))):  # fmt: skip
        return None
    if ids is None and shape is not None:
        ids = shape.ids
    return ids


def upstream_payload(
    body: dict, dispatch: Dispatch, stream: bool, ids: list[int] | None = None
) -> bytes:
    """``ids`` (``ids_for``): beside the text to our engine, in its place to another."""
    payload = dict(body)
    payload.pop(PRETOKENIZED, None)  # the router's to give, not the client's to pass through
    if ids is not None:
        if dispatch.target.worker.flavour == "dpmesh":
            payload[PRETOKENIZED] = ids
        else:
            payload["prompt"] = ids
    if dispatch.target.rank is not None:
        for field in ("data-parallel-rank", "data_parallel_rank", "routed_dp_rank"):
            payload.pop(field, None)  # the router's choice is the one the engine reads
        for (
            field
        ) in dispatch.target.worker.rank_fields:  # by flavour and version (discovery.rank_fields)
            payload[field] = dispatch.target.rank
    if stream:
        payload["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    try:  # msgspec: 0.3 ms for a 100 k-character prompt and its ids, where json takes 8
        return msgspec.json.encode(payload)
    except (TypeError, ValueError, OverflowError):  # what json still takes: lone surrogates, ...
        return json.dumps(payload).encode()


def _target_headers(api_key: str, rank: int | None) -> dict:
    """What every request to one target carries: JSON, the engine's key, and the rank in a header
    too: vLLM reads it only from there, ours, ATOM and SGLang from the body (both are sent to
    every flavour)."""
    headers = {"content-type": "application/json", **http.auth_headers(api_key)}
    if rank is not None:
        headers["x-data-parallel-rank"] = str(rank)
    return headers


def upstream_headers(dispatch: Dispatch) -> dict:
    """The target's headers (``_target_headers``), the prediction's, the trace's."""
    headers = _target_headers(dispatch.target.worker.api_key, dispatch.target.rank)
    if dispatch.explains:  # the engine counts what it had against it (issue 27)
        headers[PREDICTED_HEADER] = str(dispatch.predicted_tokens)
    if tracing.TRACER is not None:  # the attempt's span is the engine's request's parent
        tracing.inject(headers)
    return headers


# (api key, rank) -> ``_target_headers`` as they go on the wire: made once per target
_HEADS: dict[tuple[str, int | None], bytes] = {}


def upstream_head(dispatch: Dispatch) -> bytes:
    """``upstream_headers`` as the lines on the wire (``http1.Pool.post`` takes either): the
    target's part encoded once, not each request's dict encoded header by header."""
    if tracing.TRACER is not None:  # a traceparent of its own: encoded as it is
        return http1.encode_headers(upstream_headers(dispatch))
    target = dispatch.target
    key = (target.worker.api_key, target.rank)
    head = _HEADS.get(key)
    if head is None:
        if len(_HEADS) >= 4096:  # keys rotated many times over: start again
            _HEADS.clear()
        head = _HEADS[key] = http1.encode_headers(_target_headers(*key))
    if dispatch.explains:
        head += _PREDICTED_LINE % dispatch.predicted_tokens
    return head


OVERHEAD_HEADER = b"x-dpmesh-overhead-duration-ms"  # as LiteLLM's x-litellm-overhead-duration-ms
# the prompt tokens the router predicted cached on the engine it sent a request to
PREDICTED_HEADER = "x-dpmesh-predicted-cached-tokens"
_PREDICTED_LINE = PREDICTED_HEADER.encode() + b": %d\r\n"
# the request's miss reasons (apps/routing/decision/misses.py): ``basis=engine`` with the engine's
# cached tokens (an answer read whole), ``basis=predicted`` as the router expects them (a stream,
# whose usage comes after its headers), then ``reason=tokens`` for each reason with some
MISSES_HEADER = b"x-dpmesh-cache-misses"


def misses_header(dispatch: Dispatch, usage: dict | None) -> list:
    """The request's miss reasons as a header (none where the router predicts nothing)."""
    reasons = dispatch.miss_reasons(usage)
    if reasons is None:
        return []
    basis = "predicted" if dispatch.cached_tokens(usage) is None else "engine"
    parts = [f"basis={basis}"] + [f"{r}={n}" for r, n in reasons.items()]
    return [(MISSES_HEADER, "; ".join(parts).encode())]


def route_headers(dispatch: Dispatch, overhead_s: float) -> list:
    """The target, the rank the router placed it on (where the engine chose, ``served_rank``
    reads it from the answer), and the router's own time for this request in ms
    (``overhead_s``): all known once the request is written."""
    headers = [(b"x-routed-target", dispatch.target.key.encode()),
               (OVERHEAD_HEADER, b"%.3f" % (overhead_s * 1000))]  # fmt: skip
    rank = dispatch.target.rank
    if rank is not None:
        headers.append((b"x-data-parallel-rank", b"%d" % rank))
    return headers


def served_rank(dispatch: Dispatch, response) -> list:
    """The rank the engine says served the request, where the router placed none (a worker
    routed as a whole): its answer's own ``x-data-parallel-rank``, passed on."""
    if dispatch.target.rank is not None:
        return []
    rank = response.header(b"x-data-parallel-rank")
    return [(b"x-data-parallel-rank", rank.encode())] if rank is not None else []


# ----- prefill/decode disaggregation (apps/routing/proxy/pd.py) -------------------------------
KV_TRANSFER_PARAMS = "kv_transfer_params"
# what vllm-router (and vLLM's own example proxy) send a prefill worker
VLLM_PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
SGLANG_DEFAULT_BOOTSTRAP_PORT = 8998


def pd_protocol(configured: str, prefill_worker, decode_flavours: set[str]) -> str:
    """The handshake between a request's legs: the configured one, else by the workers' flavours:
    SGLang's bootstrap for an SGLang prefill worker, and for ours when it has a bootstrap
    listener and every decode worker is ours too (both legs at once: the decode leg's bootstrap
    and connection overlap the prefill instead of following its answer); vLLM's
    kv_transfer_params for the rest (vLLM, ATOM, a mixed fleet)."""
    if configured in ("vllm", "sglang"):
        return configured
    if prefill_worker.flavour == "sglang":
        return "sglang"
    ours = prefill_worker.flavour == "dpmesh" and decode_flavours == {"dpmesh"}
    if ours and prefill_worker.bootstrap_port:
        return "sglang"
    return "vllm"


def vllm_prefill_body(body: dict) -> dict:
    """The prefill leg of vLLM's protocol: one token, not streamed, asking to hold the KV."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "max_completion_tokens")}
    out.update(max_tokens=1, stream=False, **{KV_TRANSFER_PARAMS: dict(VLLM_PREFILL_PARAMS)})
    return out


def decode_kv_transfer_params(params: dict, prefill_target) -> dict:
    """The ``kv_transfer_params`` the decode leg carries: the prefill leg's answer, and for ATOM
    the prefill side's layout its decode worker needs to find the KV (``remote_dp_size``,
    ``remote_tp_size`` from the prefill worker's /kv_transfer_info, ``remote_dp_rank`` the rank
    chosen), where the answer does not say them itself."""
    worker = prefill_target.worker
    if worker.flavour != "atom":
        return params
    out = dict(params)
    if prefill_target.rank is not None:
        out.setdefault("remote_dp_rank", prefill_target.rank)
    out.setdefault("remote_dp_size", worker.dp_size)
    if worker.tp_size:
        out.setdefault("remote_tp_size", worker.tp_size)
    return out


def cached_tokens_of(answer: dict) -> int | None:
    usage = answer.get("usage")
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if isinstance(cached, int) and not isinstance(cached, bool) else None


def kv_transfer_params_of(answer: dict) -> dict | None:
    params = answer.get(KV_TRANSFER_PARAMS)
    return params if isinstance(params, dict) else None


def sglang_bootstrap(host: str, port: int | None, room: int) -> dict:
    return {
        "bootstrap_host": host,
        "bootstrap_port": port or SGLANG_DEFAULT_BOOTSTRAP_PORT,
        "bootstrap_room": room,
    }


def sglang_prefill_body(body: dict, bootstrap: dict) -> dict:
    """The prefill leg of SGLang's protocol: the request with the bootstrap fields, not streamed
    (its answer only tells whether the prefill went well)."""
    out = {k: v for k, v in body.items() if k != "stream_options"}
    out.update(stream=False, **bootstrap)
    return out


def sglang_decode_body(body: dict, bootstrap: dict, prefill_rank: int | None) -> dict:
    out = {**body, **bootstrap}
    if prefill_rank is not None:
        out["disagg_prefill_dp_rank"] = prefill_rank
    return out


def with_cached_tokens(content: bytes, cached: int) -> bytes:
    """An answer (a JSON body, or one SSE ``data:`` event) whose usage says ``cached`` prompt
    tokens were cached: a decode worker that counts the KV it pulled as cached (vLLM's) reports
    the whole prompt; the client is owed the prefill side's count. Unchanged if it has no usage."""
    event = content.startswith(b"data: ")
    data = json_object(content[6:] if event else content)
    usage = data.get("usage") if data else None
    if not isinstance(usage, dict):
        return content
    details = usage.get("prompt_tokens_details")
    usage["prompt_tokens_details"] = {**(details if isinstance(details, dict) else {}),
                                      "cached_tokens": cached}  # fmt: skip
    encoded = msgspec.json.encode(data)
    return b"data: " + encoded if event else encoded


def json_object(content: bytes) -> dict | None:
    try:
        value = msgspec.json.decode(content)
    except msgspec.DecodeError:
        return None
    return value if isinstance(value, dict) else None


def wants_usage(body: dict) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


class _Usage(msgspec.Struct):
    """An OpenAI answer, as far as the router reads it: msgspec skips the other fields without
    building them (a 2,000-token answer with logprobs: 44 us, against 143 us decoding it all)."""

    usage: dict | None = None


_USAGE = msgspec.json.Decoder(_Usage)


def usage_from_body(content: bytes) -> dict | None:
    """The ``usage`` object of an answer read whole (None: none, or not a JSON object)."""
    try:
        return _USAGE.decode(content).usage
    except msgspec.DecodeError:  # not JSON, not an object, a usage that is not an object
        return None


def usage_of(event: bytes) -> dict | None:
    """The usage object of an SSE event, if it carries one (cheap checks before parsing: with
    ``include_usage`` every chunk of an OpenAI stream has ``"usage": null``, and a quote inside a
    text is escaped, so ``"usage"`` is the key)."""
    at = event.find(b'"usage"')
    if at < 0 or event[at + 7 : at + 16].lstrip(b": ").startswith(b"null"):
        return None
    try:
        data = json.loads(event[event.index(b"{") :])
    except ValueError:
        return None
    return data.get("usage") if isinstance(data, dict) else None


def is_usage_only(event: bytes) -> bool:
    try:
        data = json.loads(event[event.index(b"{") :])
    except ValueError:
        return False
    return isinstance(data, dict) and data.get("usage") is not None and not data.get("choices")


# ----- the Responses API (``/v1/responses``) ---------------------------------------------------
RESPONSES_PATH = "/v1/responses"
RESPONSE_SESSION = "resp:"  # a stored response's entry in the router's session table


def responses_routing_body(body: dict) -> dict:
    """What the router routes a Responses request on: its instructions and input as chat
    messages, rendered as the engine renders them (engine/server/responses.py). The earlier turns
    of a continuation are in the engine's store, not here: the session table decides where it
    goes (``RESPONSE_SESSION``)."""
    messages = []
    if isinstance(body.get("instructions"), str):
        messages.append({"role": "system", "content": body["instructions"]})
    raw = body.get("input")
    if isinstance(raw, str):
        messages.append({"role": "user", "content": raw})
    elif isinstance(raw, list):
        for item in raw:
            if not isinstance(item, dict) or not isinstance(item.get("role"), str):
                continue
            content = item.get("content")
            if isinstance(content, list):
                content = "".join(
                    p.get("text", "") for p in content if isinstance(p, dict)
                    and isinstance(p.get("text"), str)
                )  # fmt: skip
            if isinstance(content, str):
                messages.append({"role": item["role"], "content": content})
    out = {"messages": messages or [{"role": "user", "content": ""}]}
    if isinstance(body.get("model"), str):
        out["model"] = body["model"]
    return out


def response_id_of(data: bytes) -> str | None:
    """A Responses answer's id: of a JSON body, or of a stream's first event
    (``response.created``)."""
    start = data.find(b"data: ")
    obj = json_object(data[start + 6 :] if start >= 0 else data)
    if obj is None:
        return None
    if isinstance(obj.get("response"), dict):
        obj = obj["response"]
    rid = obj.get("id")
    return rid if isinstance(rid, str) and rid.startswith("resp") else None
