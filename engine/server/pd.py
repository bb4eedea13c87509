"""The HTTP side of prefill/decode disaggregation: vLLM's two-step ``kv_transfer_params``.

1. The prefill leg: a request with ``kv_transfer_params: {"do_remote_decode": true, ...}`` (a
   router sends it with ``max_tokens: 1``) to a ``--disaggregation-mode prefill`` engine runs as
   usual on the rank it names or the engine picks, and its prompt's full blocks stay held there.
   The answer carries ``kv_transfer_params`` for the decode leg: ``do_remote_prefill``,
   ``remote_engine_id``, ``remote_block_ids``, ``remote_host``, ``remote_port`` (that rank's KV
   listener), ``remote_request_id``, as vLLM's NixlConnector names them, plus the prefill DP rank
   (``remote_dp_rank``, as ATOM) and what the prefill rank had cached
   (``remote_num_cached_tokens``, ours).
2. The decode leg: the same request with those parameters to a ``--disaggregation-mode decode``
   engine pulls the blocks it lacks from that listener (engine/kv_transfer.py) and generates; its
   usage reports the prefill side's cached tokens, not the whole prompt as pulled blocks would
   otherwise count.

Parameters without either flag are ignored, as vLLM ignores them without a connector; a flag sent
to an engine of the other role, or malformed parameters, is a 400.
"""

from __future__ import annotations

from engine.server.ipc import PullKV
from serving.openai_fields import APIError, is_int

PARAM = "kv_transfer_params"


def transfer_fields(body: dict, mode: str | None) -> dict:
    """``EngineClient.generate``'s transfer keywords for a request body (``{}``: none)."""
    params = body.get(PARAM)
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise APIError(400, f"'{PARAM}' must be an object", param=PARAM)
    if params.get("do_remote_decode") is True:
        if mode != "prefill":
            raise APIError(400, _wrong_role("do_remote_decode", "prefill", mode), param=PARAM)
        return {"hold_kv": True}
    if params.get("do_remote_prefill") is True:
        if mode != "decode":
            raise APIError(400, _wrong_role("do_remote_prefill", "decode", mode), param=PARAM)
        return _decode_fields(params)
    return {}


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
