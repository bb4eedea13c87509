"""Discovery: what a worker is, from its own /server_info (SGLang's older /get_server_info as a
fallback; a plain OpenAI server that has neither is one target serving what /v1/models lists)."""

from __future__ import annotations

import os

import httpx

from apps.replicas.fleet import WorkerView
from engine.digests import SCHEME


class DiscoveryError(Exception):
    pass


def auth_headers(api_key: str) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def fetch_server_info(client: httpx.AsyncClient, url: str, api_key: str = "") -> dict:
    url = url.rstrip("/")
    headers = auth_headers(api_key)
    try:
        for path in ("/server_info", "/get_server_info"):
            r = await client.get(url + path, headers=headers, timeout=10)
            if r.status_code == 200:
                return r.json()
            if r.status_code != 404:
                raise DiscoveryError(f"GET {url}{path} answered {r.status_code}: {r.text[:200]}")
        r = await client.get(url + "/v1/models", headers=headers, timeout=10)
        if r.status_code == 200 and r.json().get("data"):
            return {"dp_size": 1, "model_id": r.json()["data"][0]["id"], "foreign": True}
        raise DiscoveryError(f"{url} has no /server_info, /get_server_info or /v1/models")
    except (httpx.HTTPError, ValueError) as exc:
        raise DiscoveryError(f"cannot reach {url}: {exc}") from exc


VOLATILE_KEYS = ("ranks",)  # live state in our engine's /server_info (pids, requests in flight)


def stable_info(info: dict) -> dict:
    """``info`` without its live state: what identifies the worker's configuration."""
    return {k: v for k, v in (info or {}).items() if k not in VOLATILE_KEYS}


def dp_size_of(info: dict) -> int:
    size = info.get("dp_size") or 1
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise DiscoveryError(f"server_info has an invalid dp_size {size!r}")
    return size


def view_of(worker, tokenizer_path: str | None = None) -> WorkerView:
    """A routing view of a ``Worker`` row. Token digests need the engine's block size and a
    tokenizer this host can load: the worker's own model path, or ``tokenizer_path``."""
    info = worker.server_info or {}
    path = tokenizer_path or info.get("model_path") or info.get("tokenizer_path")
    if path and not os.path.isdir(path):
        path = None
    block = info.get("block_size") or info.get("page_size")
    model = worker.model_name
    aliases = {a for a in (worker.served_model_name, worker.model_id, info.get("model_path")) if a}
    return WorkerView(
        worker_id=worker.id,
        url=worker.url.rstrip("/"),
        api_key=worker.api_key,
        model=model,
        model_aliases=aliases,
        dp_size=worker.dp_size,
        dp_aware=worker.dp_aware,
        block_size=block if path else None,
        tokenizer_path=path,
        capacity_blocks=info.get("num_kv_blocks_per_rank"),
        draining=worker.draining,
        instance_id=info.get("instance_id"),
        kv_events=info.get("kv_events")
        if path and block and info.get("prefix_digest") == SCHEME
        else None,
        healthy=worker.health != worker.Health.UNHEALTHY,
    )
