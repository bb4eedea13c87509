"""One prefill/decode-disaggregated request (``runrouter --pd-disaggregation``): its prefill leg
on a prefill worker's rank, its decode leg on a decode worker's, and the handshake between them.

The two legs are routed like any request, each among the workers of its role
(``Router.route(role=...)``, ``--prefill-policy`` / ``--decode-policy``): cache-aware on the
prefill side puts the prompt where its prefix is computed already; on the decode side the same
cost counts the blocks the decode rank lacks, which it must pull, and its load. A client's
session keeps both legs where they were (one session entry per role). Then, by protocol
(``wire.pd_protocol``):

- vLLM's two steps (vLLM, ATOM, ours): the prefill leg with ``max_tokens: 1`` and
  ``kv_transfer_params.do_remote_decode``, not streamed; its answer's ``kv_transfer_params``
  go with the decode leg (for ATOM with the prefill side's ``remote_dp_size``, ``remote_tp_size``
  and ``remote_dp_rank``: wire.decode_kv_transfer_params), whose answer is the client's (relayed
  as any answer: upstream._attempt).
- SGLang's one step: both legs at once with ``bootstrap_host`` / ``bootstrap_port`` /
  ``bootstrap_room``, the room chosen so that ``room % dp_size`` is the chosen prefill rank (which
  the prefill leg also names as its rank), ``disagg_prefill_dp_rank`` telling the decode side.

Failure: with no decode worker the request is a 503 before any prefill holds KV. In two steps
a leg whose worker could not be reached goes to another worker of its role (the prefill's KV
waits for whichever decode worker pulls it), up to ``--max-retries``; any other failure of a
prefill leg ends the request with its error, the decode leg never sent. In one step no leg is
retried: a failed prefill leg cancels the decode leg, which closes its connection, so its engine
aborts it. A client that leaves cancels both. Each leg's dispatch is ended exactly once, by the
code that sent it.
"""

from __future__ import annotations

import asyncio
import logging
import random
from urllib.parse import urlsplit

from apps.routing.decision.router import NoTarget, Router
from apps.routing.feeds import health
from apps.routing.proxy import upstream, wire
from controlplane import http1
from serving.asgi import send_body

logger = logging.getLogger(__name__)

PREFILL_HEADER = b"x-prefill-target"


class Legs:
    """Routes a request's legs: each among the workers of its role, the client's session kept
    per role, a worker that failed a leg not tried again for it."""

    def __init__(self, router: Router, body: dict, chat: bool, model, ids_by_path, rank, session):
        self.router, self.body, self.chat, self.model = router, body, chat, model
        self.ids_by_path, self.rank, self.session = ids_by_path, rank, session
        self.tried: dict[str, set[str]] = {"prefill": set(), "decode": set()}

    def route(self, role: str):
        """A dispatch for ``role``'s leg (raises NoTarget) and the prompt ids to send with it."""
        dispatch = self.router.route(
            self.body, self.chat, self.model, exclude=self.tried[role],
            rank=self.rank if role == "decode" else None,
            session=None if self.session is None else f"{self.session}\x00{role}",
            ids_by_path=self.ids_by_path, role=role,
        )  # fmt: skip
        self.tried[role].add(dispatch.target.key)
        ids = None if self.chat else wire.ids_for(self.router, dispatch.target, self.ids_by_path)
        return dispatch, ids

    def can_retry(self, role: str) -> bool:
        return len(self.tried[role]) <= self.router.config.max_retries

    def available(self, role: str) -> bool:
        return bool(self.router.fleet.candidates(self.model, role) or (
            self.model and self.router.fleet.candidates(None, role)))  # fmt: skip


async def serve(
    router: Router,
    body: dict,
    *,
    chat: bool,
    path: str,
    send,
    model: str | None,
    ids_by_path,
    rank: int | None,
    session: str | None,
    since: float,
) -> None:
    """Route both legs and run the handshake; the client gets the decode leg's answer, or the
    first error."""
    legs = Legs(router, body, chat, model, ids_by_path, rank, session)
    if not legs.available("decode"):  # before any prefill holds KV for nobody
        await _error(send, 503, "no available decode worker")
        return
    try:
        prefill = legs.route("prefill")
    except NoTarget as exc:
        await _error(send, 503, str(exc))
        return
    protocol = wire.pd_protocol(router.config.pd_protocol, prefill[0].target.worker.flavour)
    if protocol == "sglang":
        try:
            decode = legs.route("decode")
        except NoTarget as exc:
            prefill[0].finish(ok=False)
            await _error(send, 503, str(exc))
            return
        await _one_step(router, prefill, decode, body, path, send, since)
    else:
        await _two_step(router, legs, prefill, body, path, send, since)


async def _two_step(router, legs: Legs, prefill, body, path, send, since):
    """vLLM's protocol: the prefill leg first, its ``kv_transfer_params`` to the decode leg. A
    leg whose worker could not be reached goes to another worker of its role (the held KV waits
    for whichever decode worker pulls it)."""
    while True:
        dispatch, ids = prefill
        answer = await _prefill_leg(router, dispatch, wire.vllm_prefill_body(body), path, ids)
        if not (isinstance(answer, Unreachable) and legs.can_retry("prefill")):
            break
        logger.warning("prefill leg: %s; another prefill worker", answer.message)
        try:
            prefill = legs.route("prefill")
        except NoTarget:
            break
    if isinstance(answer, upstream.ProxyError):
        await send_body(send, answer.status, answer.body())
        return
    params = wire.kv_transfer_params_of(answer)
    if params is None:
        message = f"prefill worker {dispatch.target.key} answered no kv_transfer_params"
        await _error(send, 502, message)
        return
    extra = [(PREFILL_HEADER, dispatch.target.key.encode())]
    decode_body = {
        **body,
        wire.KV_TRANSFER_PARAMS: wire.decode_kv_transfer_params(params, dispatch.target),
    }
    cached = wire.cached_tokens_of(answer)
    while True:
        try:
            decode, ids = legs.route("decode")
        except NoTarget as exc:
            await _error(send, 503, str(exc))
            return
        last = not legs.can_retry("decode")
        # ours reports the prefill side's cached tokens itself; vLLM's counts what it pulled
        fix = cached if decode.target.worker.flavour != "dpmesh" else None
        failed = await upstream._attempt(router, decode, decode_body, path, send, last_try=last,
                                         ids=ids, since=since, extra=extra,
                                         cached_tokens=fix)  # fmt: skip
        if failed is None:
            return
        if last:
            await send_body(send, failed.status, failed.body())
            return
        logger.warning("decode leg: %s; another decode worker", failed.message)


async def _one_step(router, prefill, decode, body, path, send, since):
    """SGLang's protocol: both legs at once, joined by the bootstrap room (no leg is retried: the
    other has gone with the same room)."""
    (prefill, prefill_ids), (decode, decode_ids) = prefill, decode
    extra = [(PREFILL_HEADER, prefill.target.key.encode())]
    worker = prefill.target.worker
    fields = wire.sglang_bootstrap(
        urlsplit(worker.url).hostname,
        worker.bootstrap_port,
        _room(prefill.target.rank, worker.dp_size if prefill.target.rank is not None else 1),
    )
    prefill_body = wire.sglang_prefill_body(body, fields)
    decode_body = wire.sglang_decode_body(body, fields, prefill.target.rank)
    prefill_leg = asyncio.ensure_future(
        _prefill_leg(router, prefill, prefill_body, path, prefill_ids)
    )
    decode_leg = asyncio.ensure_future(
        _decode_leg(router, decode, decode_body, path, send, extra, decode_ids, since)
    )
    try:
        done, _ = await asyncio.wait({prefill_leg, decode_leg}, return_when=asyncio.FIRST_COMPLETED)
        if prefill_leg in done and isinstance(prefill_leg.result(), upstream.ProxyError):
            failed = prefill_leg.result()
            if not decode_leg.done():
                decode_leg.cancel()  # its engine waits for KV that will not come: end it now
                await asyncio.gather(decode_leg, return_exceptions=True)
                await send_body(send, failed.status, failed.body())
                return
        await decode_leg
        await prefill_leg
    finally:
        for leg in (prefill_leg, decode_leg):
            leg.cancel()
        await asyncio.gather(prefill_leg, decode_leg, return_exceptions=True)


class Unreachable(upstream.ProxyError):
    """A leg's worker could not be reached: nothing was sent, another worker may take it."""


def _room(rank: int | None, dp_size: int) -> int:
    """A random room whose remainder by ``dp_size`` is ``rank`` (SGLang's rule for which prefill
    rank serves a room)."""
    room = random.getrandbits(62)
    return room - room % dp_size + (rank or 0)


async def _prefill_leg(router, dispatch, body, path, ids) -> dict | upstream.ProxyError:
    """Send a prefill leg, not streamed; its answer (JSON), or the error to give the client. Its
    dispatch ends here, however the leg ends."""
    target, config = dispatch.target, router.config
    ok, usage, response = False, None, None
    try:
        payload = wire.upstream_payload(body, dispatch, False, ids)
        try:
            response = await http1.pool().post(
                target.worker.url + path,
                payload,
                wire.upstream_headers(dispatch),
                connect_timeout_s=config.connect_timeout_s,
                read_timeout_s=config.request_timeout_s,
            )
            content = await response.read()
        except (http1.ConnectError, http1.ConnectTimeout) as exc:  # nothing reached it
            if isinstance(exc, http1.ConnectError):  # refused: the whole worker is gone
                health.mark_unreachable(router, target.worker, f"unreachable: {exc}")
            dispatch.unreachable()
            return Unreachable(
                502, f"prefill worker {target.key} unreachable: {exc}", "server_error"
            )
        except http1.UpstreamError as exc:
            return upstream.ProxyError(
                502, f"prefill worker {target.key} failed: {exc}", "server_error"
            )
        dispatch.first_token()
        if response.status != 200:
            message = f"prefill worker {target.key} answered {response.status}"
            return upstream.ProxyError(response.status, message, "server_error", raw=content)
        answer = wire.json_object(content)
        if answer is None:
            return upstream.ProxyError(
                502, f"prefill worker {target.key} answered no JSON object", "server_error"
            )
        ok, usage = True, answer.get("usage")
        return answer
    finally:
        if response is not None:
            response.release()
        dispatch.finish(ok=ok, usage=usage if isinstance(usage, dict) else None)


async def _decode_leg(router, dispatch, body, path, send, extra, ids, since) -> None:
    """Send the decode leg and relay its answer to the client (upstream._attempt: its dispatch
    ends there); a failure before anything was relayed is the client's error."""
    failed = await upstream._attempt(
        router, dispatch, body, path, send, last_try=True, ids=ids, since=since, extra=extra
    )
    if failed is not None:
        await send_body(send, failed.status, failed.body())


async def _error(send, status: int, message: str) -> None:
    error = upstream.ProxyError(status, message, "server_error")
    await send_body(send, error.status, error.body())
