"""The replicas' record of a worker (a ``Worker`` row: its discovery answer, overrides and state)
read into the decision's ``WorkerView``: which tokenizer and block size digest its prompts, its KV
capacity, and where its KV events are published (ours: ``/kv_events``; vLLM: ZMQ sockets)."""

from __future__ import annotations

import os
import re
from urllib.parse import urlsplit

from apps.replicas.discovery import effective_info, rank_fields, role_of
from apps.routing.decision.fleet import WorkerView
from apps.routing.feeds import prompt_ids
from engine.digests import SCHEME


def view_of(worker, tokenizer_path: str | None = None) -> WorkerView:
    """A routing view of a ``Worker`` row. Token digests need the engine's block size and a
    tokenizer this host can load: the worker's own model path, or ``tokenizer_path``."""
    info = effective_info(worker.server_info, worker.overrides)
    own = info.get("tokenizer_path") or info.get("model_path")
    path = tokenizer_path or own
    if path and not os.path.isdir(path):
        path = None
    own = own if own and os.path.isdir(own) else None
    block = info.get("block_size") or info.get("page_size")
    ours = path and block and info.get("prefix_digest") == SCHEME
    adapters = lora_adapters(info)
    flavour = info.get("flavour") or "dpmesh"
    aliases = {a for a in (worker.served_model_name, worker.model_id, info.get("model_path")) if a}
    return WorkerView(
        worker_id=worker.id,
        url=worker.url.rstrip("/"),
        api_key=worker.api_key,
        model=worker.model_name,
        model_aliases=aliases | adapters,
        adapters=adapters,
        dp_size=worker.dp_size,
        dp_aware=worker.dp_aware,
        block_size=block if path else None,
        tokenizer_path=path,
        own_tokenizer_path=own,
        capacity_blocks=info.get("num_kv_blocks_per_rank"),
        max_num_seqs=_positive_int(info.get("max_num_seqs")),
        max_model_len=_positive_int(info.get("max_model_len")),
        max_body_bytes=_positive_int(info.get("max_request_body_bytes")),
        draining=worker.draining,
        instance_id=info.get("instance_id"),
        kv_events=info.get("kv_events") if ours else None,
        flavour=flavour,
        zmq_kv_events=zmq_endpoints(worker.url, info) if path and block else (),
        zmq_replay=zmq_replay_endpoints(worker.url, info, worker.dp_size) if path and block else (),
        healthy=worker.health != worker.Health.UNHEALTHY,
        role=role_of(info),
        bootstrap_port=_positive_int(
            info.get("bootstrap_port") or info.get("disaggregation_bootstrap_port")
        ),
        rank_fields=rank_fields(flavour, info.get("version")),
        # our own engine takes the ids beside the text, from its own tokenizer files (no probe:
        # the same files, the same encode_text); a vLLM's is set by its /tokenize check
        # (apps/routing/live.py, apps/routing/feeds/prompt_ids.py)
        prompt_ids=bool(own and flavour == "dpmesh" and prompt_ids.enabled()),
        pin_check={
            path: result["honoured"]
            for path, result in (info.get("pin_check") or {}).items()
            if isinstance(result, dict) and isinstance(result.get("honoured"), bool)
        },
        tp_size=_positive_int(
            info.get("tp_size") or (info.get("kv_transfer_info") or {}).get("tp_size")
        ),
    )


def lora_adapters(info: dict) -> frozenset[str]:
    """The LoRA adapters a worker serves (``lora_modules``: ours in /server_info, vLLM's from
    /v1/models), by the names a request's ``model`` selects them with."""
    names = set()
    for module in info.get("lora_modules") or ():
        name = module.get("name") if isinstance(module, dict) else module
        if isinstance(name, str) and name:
            names.add(name)
    return frozenset(names)


def _positive_int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def zmq_endpoints(url: str, info: dict) -> tuple[str, ...]:
    """A vLLM worker's KV-event publishers, one per rank: the registration's ``kv_events`` (one
    endpoint per rank, or the first rank's, the others on the next ports, as vLLM binds them),
    else what its ``/kv_event_sources`` says. Wildcard hosts are the worker's own host."""
    if info.get("flavour") != "vllm":
        return ()
    given = info.get("kv_events")
    dp_size = info.get("dp_size") or 1
    if isinstance(given, list):
        endpoints = list(given)
    elif isinstance(given, str) and given.startswith("tcp://"):
        endpoints = [given]
    else:
        endpoints = _from_sources(info.get("kv_event_sources"))
    if len(endpoints) == 1 and dp_size > 1:  # base port + rank
        host, _, port = endpoints[0].rpartition(":")
        if port.isdigit():
            endpoints = [f"{host}:{int(port) + r}" for r in range(dp_size)]
    return tuple(_own_host(url, e) for e in endpoints)


def zmq_replay_endpoints(url: str, info: dict, dp_size: int) -> tuple[str | None, ...]:
    """A vLLM worker's replay sockets (its ``replay_endpoint``, one per rank), when it has them:
    what ``/kv_event_sources`` says, ranks without one as None."""
    if info.get("flavour") != "vllm":
        return ()
    sources = info.get("kv_event_sources")
    by_rank = sources if isinstance(sources, dict) else {}
    found = []
    for rank in range(dp_size):
        config = by_rank.get(str(rank), by_rank.get(rank))
        replay = config.get("replay_endpoint") if isinstance(config, dict) else None
        found.append(_own_host(url, replay) if isinstance(replay, str) else None)
    return tuple(found) if any(found) else ()


def _own_host(url: str, endpoint: str) -> str:
    worker_host = urlsplit(url).hostname or "127.0.0.1"
    return re.sub(r"tcp://(\*|0\.0\.0\.0)", f"tcp://{worker_host}", endpoint)


def _from_sources(sources) -> list[str]:
    """Publisher endpoints out of vLLM's ``/kv_event_sources`` answer (per rank, its
    KVEventsConfig: the ``endpoint`` field, not the ``replay_endpoint``), whatever its nesting."""
    found: list[str] = []

    def walk(value):
        if isinstance(value, str) and value.startswith("tcp://"):
            found.append(value)
        elif isinstance(value, dict) and "endpoint" in value:
            walk(value["endpoint"])
        elif isinstance(value, dict):  # by rank: "0", "1", ... "10"
            for key in sorted(
                value,
                key=lambda k: (not str(k).isdigit(), int(k) if str(k).isdigit() else 0, str(k)),
            ):
                walk(value[key])
        elif isinstance(value, list):
            for item in value:
                walk(item)

    walk(sources)
    return list(dict.fromkeys(found))
