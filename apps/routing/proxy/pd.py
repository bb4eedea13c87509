"""One prefill/decode-disaggregated request (``runrouter --pd-disaggregation``): its prefill leg
on a prefill worker's rank, its decode leg on a decode worker's, and the handshake between them.

The two legs are routed like any request, each among the workers of its role
(``Router.route(role=...)``, ``--prefill-policy`` / ``--decode-policy``): cache-aware on the
prefill side puts the prompt where its prefix is computed already; on the decode side the same
cost counts the blocks the decode rank lacks, which it must pull, and its load. A client's
session keeps both legs where they were (one session entry per role). Then, by protocol
(``wire.pd_protocol``):

- vLLM's two steps (vLLM, ATOM, or a fleet whose workers are not all ours): the prefill leg
  with ``max_tokens: 1`` and ``kv_transfer_params.do_remote_decode``, not streamed; its answer's
  ``kv_transfer_params`` go with the decode leg (for ATOM with the prefill side's
  ``remote_dp_size``, ``remote_tp_size`` and ``remote_dp_rank``:
  wire.decode_kv_transfer_params), whose answer is the client's (relayed as any answer:
  upstream._attempt).
- SGLang's one step (SGLang, and ours when both roles are ours): both legs at once with
  ``bootstrap_host`` / ``bootstrap_port`` / ``bootstrap_room``, the room chosen so that ``room %
  dp_size`` is the chosen prefill rank (which the prefill leg also names as its rank),
  ``disagg_prefill_dp_rank`` telling the decode side.

Failure: with no decode worker the request is a 503 before any prefill holds KV. Nothing reaches
the client before the decode leg's first token, so either protocol retries a leg, up to
``--max-retries`` per role: a prefill leg whose worker could not be reached goes to another
prefill worker (in one step with a new room, and the decode leg again, on any decode worker);
a decode leg that failed before anything was relayed goes to another decode worker, which pulls
the same held KV (in one step once the prefill leg has answered, and only where the prefill
worker is ours, which holds a room's blocks until they are pulled or time out). Any other
failure of a prefill leg ends the request with its error, the decode leg cancelled or never
sent; a decode leg that cannot be retried cancels a prefill leg still running (its engine aborts
it, holding nothing). A client that leaves cancels both. Where a prefill worker of ours answered
and no decode leg will pull what it holds (the decode failed for good, or the client left), the
router tells its bootstrap listener to release it at once (``_release_later``), instead of
leaving it to the engine's ``--kv-transfer-timeout-secs``. Each leg's dispatch is ended exactly
once, by the code that sent it.
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
from engine import kv_transfer
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

    def flavours(self, role: str) -> set[str]:
        """The flavours of the workers that could take ``role``'s leg (empty: none could)."""
        fleet = self.router.fleet
        targets = fleet.candidates(self.model, role) or (
            fleet.candidates(None, role) if self.model else [])  # fmt: skip
        return {target.worker.flavour for target in targets}


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
    decoders = legs.flavours("decode")
    if not decoders:  # before any prefill holds KV for nobody
        await _error(send, 503, "no available decode worker")
        return
    try:
        prefill = legs.route("prefill")
    except NoTarget as exc:
        await _error(send, 503, str(exc))
        return
    protocol = wire.pd_protocol(router.config.pd_protocol, prefill[0].target.worker, decoders)
    if protocol == "sglang":
        await _one_step(router, legs, prefill, body, path, send, since)
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
    answered = False
    try:
        while True:
            try:
                decode, ids = legs.route("decode")
            except NoTarget as exc:
                await _error(send, 503, str(exc))
                return
            last = not legs.can_retry("decode")
            # ours reports the prefill side's cached tokens itself; vLLM's counts what it pulled
            fix = cached if decode.target.worker.flavour != "dpmesh" else None
            failed = await upstream._attempt(router, decode, decode_body, path, send,
                                             last_try=last, ids=ids, since=since, extra=extra,
                                             cached_tokens=fix)  # fmt: skip
            if failed is None:
                answered = True
                return
            if last:
                await send_body(send, failed.status, failed.body())
                return
            logger.warning("decode leg: %s; another decode worker", failed.message)
    finally:
        if not answered:  # no decode leg will pull what the prefill holds
            _release_later(dispatch.target, request_id=params.get("remote_request_id"),
                           rank=params.get("remote_dp_rank", dispatch.target.rank))  # fmt: skip


async def _one_step(router, legs: Legs, prefill, body, path, send, since):
    """SGLang's protocol: both legs at once, joined by a bootstrap room. A prefill worker that
    could not be reached: both legs again, on another prefill worker and a new room (the decode
    worker of the failed room may take the new one: it did nothing wrong)."""
    while True:
        tried_decode = set(legs.tried["decode"])
        try:
            decode = legs.route("decode")
        except NoTarget as exc:
            prefill[0].finish(ok=False)
            await _error(send, 503, str(exc))
            return
        failed = await _one_room(router, legs, prefill, decode, body, path, send, since)
        if failed is None:
            return
        if not (isinstance(failed, Unreachable) and legs.can_retry("prefill")):
            await send_body(send, failed.status, failed.body())
            return
        logger.warning("prefill leg: %s; both legs again on another prefill worker", failed.message)
        legs.tried["decode"] = tried_decode
        try:
            prefill = legs.route("prefill")
        except NoTarget:
            await send_body(send, failed.status, failed.body())
            return


async def _one_room(router, legs, prefill, decode, body, path, send, since):
    """One room's two legs. None: the client has its answer (or an error relayed from the decode
    worker); else the failure to answer or retry on, nothing sent."""
    (prefill, prefill_ids) = prefill
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
    decode_leg = asyncio.ensure_future(_decode_legs(
        router, legs, decode, decode_body, path, send, extra, since, prefill_leg,
        retry=worker.flavour == "dpmesh",
    ))  # fmt: skip
    answered = False
    try:
        done, _ = await asyncio.wait({prefill_leg, decode_leg}, return_when=asyncio.FIRST_COMPLETED)
        if prefill_leg in done and isinstance(prefill_leg.result(), upstream.ProxyError):
            if not decode_leg.done():  # its engine waits for KV that will not come: end it now
                decode_leg.cancel()
                await asyncio.gather(decode_leg, return_exceptions=True)
                return prefill_leg.result()
        relayed = await decode_leg
        if relayed is None:
            answered = True
            await prefill_leg
            return None
        if not prefill_leg.done():  # the decode side gave up: the prefill would hold for nobody
            prefill_leg.cancel()
            await asyncio.gather(prefill_leg, return_exceptions=True)
            return relayed
        answer = prefill_leg.result()
        return answer if isinstance(answer, upstream.ProxyError) else relayed
    finally:
        for leg in (prefill_leg, decode_leg):
            leg.cancel()
        await asyncio.gather(prefill_leg, decode_leg, return_exceptions=True)
        if not answered and _answered_well(prefill_leg):  # nobody will pull what it holds
            _release_later(prefill.target, room=fields["bootstrap_room"])


class Unreachable(upstream.ProxyError):
    """A leg's worker could not be reached: nothing was sent, another worker may take it."""


def _answered_well(leg: asyncio.Future) -> bool:
    """Whether a prefill leg's task ended with the worker's answer (not an error)."""
    if not leg.done() or leg.cancelled() or leg.exception() is not None:
        return False
    return isinstance(leg.result(), dict)


# background releases of held KV (kept here until done: the loop holds tasks weakly)
_RELEASES: set[asyncio.Task] = set()
RELEASE_TIMEOUT_S = 5.0


def _release_later(target, **ask) -> None:
    """Tell our prefill worker, in the background, to give back the KV it holds for a decode
    leg that will not come (engine/server/pd.py ``BootstrapServer.release``): ``room`` (SGLang's
    protocol) or ``request_id`` and ``rank`` (vLLM's). Not for other engines: theirs frees it at
    its own timeout."""
    worker = target.worker
    if worker.flavour != "dpmesh" or not worker.bootstrap_port:
        return
    task = asyncio.ensure_future(_release(worker, {"op": "release", **ask}))
    _RELEASES.add(task)
    task.add_done_callback(_RELEASES.discard)


async def _release(worker, ask: dict) -> None:
    host = urlsplit(worker.url).hostname
    try:
        answer = await kv_transfer.ask(host, worker.bootstrap_port, ask, RELEASE_TIMEOUT_S)
    except (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError) as exc:
        logger.warning("could not release KV held on %s (%r): %r", worker.url, ask, exc)
        return
    if not answer.get("ok"):
        logger.warning("%s did not release %r: %s", worker.url, ask, answer.get("error"))


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


async def _decode_legs(router, legs, decode, body, path, send, extra, since, prefill_leg, *,
                       retry: bool) -> upstream.ProxyError | None:  # fmt: skip
    """Send a room's decode leg and relay its answer to the client (upstream._attempt: each
    dispatch ends there). One that failed before anything was relayed goes, with ``retry``, to
    another decode worker once the prefill leg has answered well (the room's KV is held for
    whoever pulls it). None: the client has an answer; else the failure, nothing sent."""
    while True:
        dispatch, ids = decode
        failed = await upstream._attempt(
            router, dispatch, body, path, send, last_try=False, ids=ids, since=since, extra=extra
        )
        if failed is None or not (retry and legs.can_retry("decode")):
            return failed
        await asyncio.wait({prefill_leg})  # not cancelled with this leg
        if not _answered_well(prefill_leg):
            return failed  # the prefill's failure decides (another prefill worker, or its error)
        logger.warning("decode leg: %s; another decode worker, the same room", failed.message)
        try:
            decode = legs.route("decode")
        except NoTarget:
            return failed


async def _error(send, status: int, message: str) -> None:
    error = upstream.ProxyError(status, message, "server_error")
    await send_body(send, error.status, error.body())
