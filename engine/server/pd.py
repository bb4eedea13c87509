"""The HTTP side of prefill/decode disaggregation: vLLM's and SGLang's protocols.

vLLM's two steps (``kv_transfer_params``; vllm-router's ``--vllm-pd-disaggregation``):

1. The prefill leg: a request with ``kv_transfer_params: {"do_remote_decode": true, ...}`` (a
   router sends it with ``max_tokens: 1``) to a ``--disaggregation-mode prefill`` engine runs as
   usual on the rank it names or the engine picks, and its prompt's full blocks stay held there.
   The answer carries ``kv_transfer_params`` for the decode leg: ``do_remote_prefill``,
   ``remote_engine_id``, ``remote_block_ids``, ``remote_host``, ``remote_port`` (that rank's KV
   listener), ``remote_request_id``, as vLLM's NixlConnector names them, plus the prefill DP rank
   (``remote_dp_rank``, as ATOM) and what the prefill rank had cached
   (``remote_num_cached_tokens``, ours).
2. The decode leg: the same request with those parameters to a ``--disaggregation-mode decode``
   engine pulls the blocks it lacks from that listener (engine/kv_transfer.py) and generates.

SGLang's one step (``bootstrap_host``, ``bootstrap_port``, ``bootstrap_room``; sglang-router's
``--pd-disaggregation``): the same request goes to both workers at once. The prefill worker
runs it on rank ``routed_dp_rank`` / ``data_parallel_rank`` if given, else ``bootstrap_room %
dp_size`` (SGLang's ``follow_bootstrap_room``), prefill only (one token), and holds its blocks
under the room. The decode worker asks the prefill worker's bootstrap listener
(``--disaggregation-bootstrap-port``, ``BootstrapServer``) which rank that is
(``disagg_prefill_dp_rank`` if given, else the same rule) and where its KV listener is, then
pulls, waiting for the prefill to end (at most ``--kv-transfer-timeout-secs``, 60 s at most).

Either way the decode's usage reports the prefill side's cached tokens, not the whole prompt as
pulled blocks would otherwise count. Parameters of neither protocol are ignored, as vLLM ignores
them without a connector; a leg sent to an engine of the other role, or malformed parameters,
is a 400; a prefill worker that cannot be reached is a 502.
"""

from __future__ import annotations

import asyncio
import logging
import socket

from engine import kv_transfer
from engine.server.ipc import PullKV
from serving.openai_fields import APIError, is_int

logger = logging.getLogger(__name__)

PARAM = "kv_transfer_params"
BOOTSTRAP_TIMEOUT_S = 5.0
DECODE_WAIT_S = 60.0  # the longest a decode leg waits for its prefill (SGLang's protocol)


def transfer_fields(body: dict, mode: str | None, rid: str) -> dict:
    """``EngineClient.generate``'s transfer keywords for vLLM's ``kv_transfer_params`` (``{}``:
    none). ``rid``: the request's own id, the key its blocks are held under."""
    params = body.get(PARAM)
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise APIError(400, f"'{PARAM}' must be an object", param=PARAM)
    if params.get("do_remote_decode") is True:
        if mode != "prefill":
            raise APIError(400, _wrong_role("do_remote_decode", "prefill", mode), param=PARAM)
        return {"hold_key": rid}
    if params.get("do_remote_prefill") is True:
        if mode != "decode":
            raise APIError(400, _wrong_role("do_remote_prefill", "decode", mode), param=PARAM)
        return _decode_fields(params)
    return {}


def bootstrap_room(body: dict) -> int | None:
    """SGLang's room of a request (None: not an SGLang prefill/decode request)."""
    room = body.get("bootstrap_room")
    if room is None:
        return None
    if not is_int(room) or room < 0:
        raise APIError(400, "'bootstrap_room' must be an integer >= 0", param="bootstrap_room")
    return room


def room_key(room: int) -> str:
    return f"room-{room}"


def sglang_prefill_rank(body: dict, room: int, hint: int | None, dp_size: int) -> int:
    """The prefill rank of an SGLang prefill leg: the one named, else the room's."""
    return hint if hint is not None else room % dp_size


async def sglang_decode_fields(body: dict, room: int, wait_s: float) -> dict:
    """Where the decode leg of ``room`` pulls from: asked of the prefill worker's bootstrap
    listener (``BootstrapServer``)."""
    host, port = body.get("bootstrap_host"), body.get("bootstrap_port")
    rank = body.get("disagg_prefill_dp_rank")
    if not isinstance(host, str) or not host or not is_int(port) or not 0 < port < 65536:
        raise APIError(
            400, "a decode leg needs 'bootstrap_host' and 'bootstrap_port'", param="bootstrap_host"
        )
    if rank is not None and (not is_int(rank) or rank < 0):
        raise APIError(400, "'disagg_prefill_dp_rank' must be an integer >= 0")
    try:
        ask = {"op": "where", "room": room, "rank": rank}
        answer = await kv_transfer.ask(host, port, ask, BOOTSTRAP_TIMEOUT_S)
    except (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError) as exc:
        raise APIError(
            502, f"the prefill worker's bootstrap listener {host}:{port} did not answer: {exc!r}"
        ) from exc
    if not answer.get("ok"):
        raise APIError(502, f"the prefill worker's bootstrap listener: {answer.get('error')}")
    pull = PullKV(answer["host"], answer["port"], room_key(room), None, wait_s)
    return {"pull": pull, "cached_tokens": None}


def _decode_fields(params: dict) -> dict:
    host, port = params.get("remote_host"), params.get("remote_port")
    request_id, blocks = params.get("remote_request_id"), params.get("remote_block_ids")
    cached = params.get("remote_num_cached_tokens")
    problems = []
    if not isinstance(host, str) or not host:
        problems.append("'remote_host' must be a host name or address")
    if not is_int(port) or not 0 < port < 65536:
        problems.append("'remote_port' must be a port number")
    if not isinstance(request_id, str) or not request_id:
        problems.append("'remote_request_id' must be the prefill's request id")
    if not isinstance(blocks, list) or not all(map(is_int, blocks)):
        problems.append("'remote_block_ids' must be a list of block ids")
    if cached is not None and (not is_int(cached) or cached < 0):
        problems.append("'remote_num_cached_tokens' must be an integer >= 0")
    if problems:
        raise APIError(400, f"bad {PARAM} for a decode: " + "; ".join(problems), param=PARAM)
    return {"pull": PullKV(host, port, request_id, len(blocks)), "cached_tokens": cached}


def _wrong_role(flag: str, wanted: str, mode: str | None) -> str:
    return (
        f"{PARAM}.{flag} asks for a {wanted} worker; this engine runs "
        f"--disaggregation-mode {mode or 'null'}"
    )


def prefill_answer(client, info: dict, rank: int, rid: str, last) -> dict | None:
    """The ``kv_transfer_params`` a prefill's answer carries (None: nothing was held)."""
    if last is None or last.held_block_ids is None:
        return None
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": info["instance_id"],
        "remote_block_ids": last.held_block_ids,
        "remote_host": client.config.kv_transfer_host,
        "remote_port": client.ranks[rank].info.kv_port,
        "remote_request_id": rid,
        "remote_dp_rank": rank,
        "tp_size": 1,
        "remote_num_cached_tokens": last.num_cached_tokens,
    }


class BootstrapServer:
    """A prefill worker's bootstrap listener (SGLang's ``--disaggregation-bootstrap-port``). In
    one frame each (engine/kv_transfer.py's framing):

    - a decode worker asks ``{"op": "where", "room", "rank"}``: where that room's prefill rank
      takes pulls, ``{"ok", "host", "port", "rank", "dp_size"}``;
    - a router says ``{"op": "release", "room"}`` or ``{"op": "release", "request_id", "rank"}``
      (vLLM's protocol): a prefill whose decode leg will not come (its decode worker failed and
      no other took it, or its client left) gives its held blocks back now, instead of at
      ``--kv-transfer-timeout-secs``; ``{"ok"}`` (also when nothing was held)."""

    def __init__(self, host: str, port: int, client):
        self.client = client
        self.sock = socket.create_server((host, port))
        self.port = self.sock.getsockname()[1]
        kv_transfer.serve_connections(self.sock, self._serve, "pd-bootstrap")

    def close(self) -> None:
        self.sock.close()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(kv_transfer.CONNECT_TIMEOUT_S)
            try:
                ask = kv_transfer.recv_frame(conn)
                answer = self.release(ask) if ask.get("op") == "release" else self.where(ask)
                kv_transfer.send_frame(conn, answer)
            except (OSError, ValueError) as exc:
                logger.warning("bootstrap query failed: %r", exc)

    def where(self, ask: dict) -> dict:
        room, rank = ask.get("room"), ask.get("rank")
        dp_size = self.client.dp_size
        if not is_int(room) or room < 0 or (rank is not None and not is_int(rank)):
            return {"ok": False, "error": "'room' must be an integer >= 0, 'rank' one or null"}
        rank = room % dp_size if rank is None else rank
        if not 0 <= rank < dp_size:
            return {"ok": False, "error": f"this prefill worker has DP ranks 0-{dp_size - 1}"}
        state = self.client.ranks[rank]
        if not state.alive or state.info is None or state.info.kv_port is None:
            return {"ok": False, "error": f"prefill DP rank {rank} is not serving"}
        host = self.client.config.kv_transfer_host
        return {"ok": True, "host": host, "port": state.info.kv_port, "rank": rank,
                "dp_size": dp_size}  # fmt: skip

    def release(self, ask: dict) -> dict:
        room, rid, rank = ask.get("room"), ask.get("request_id"), ask.get("rank")
        dp_size = self.client.dp_size
        if rank is not None and not (is_int(rank) and 0 <= rank < dp_size):
            return {"ok": False, "error": f"this prefill worker has DP ranks 0-{dp_size - 1}"}
        if is_int(room) and room >= 0:
            key, rank = room_key(room), room % dp_size if rank is None else rank
        elif isinstance(rid, str) and rid and rank is not None:
            key = rid
        else:
            error = "a release names a 'room', or a 'request_id' and its 'rank'"
            return {"ok": False, "error": error}
        self.client.release_held(rank, key)
        return {"ok": True}
