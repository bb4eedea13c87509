"""Discovery: what a worker is, from its own /server_info (SGLang's older /get_server_info as a
fallback; a plain OpenAI server that has neither is one target serving what /v1/models lists)."""

from __future__ import annotations

from controlplane import http


class DiscoveryError(Exception):
    pass


async def fetch_server_info(url: str, api_key: str = "", timeout_s: float = 10.0) -> dict:
    url = url.rstrip("/")
    try:
        for path in ("/server_info", "/get_server_info"):
            status, body, text = await http.get_json(
                url + path, api_key=api_key, timeout_s=timeout_s
            )
            if status == 200:
                if not isinstance(body, dict):
                    raise DiscoveryError(f"GET {url}{path} answered no JSON object: {text[:200]}")
                return body
            if status != 404:
                raise DiscoveryError(f"GET {url}{path} answered {status}: {text[:200]}")
        status, body, _ = await http.get_json(
            url + "/v1/models", api_key=api_key, timeout_s=timeout_s
        )
        models = body.get("data") if status == 200 and isinstance(body, dict) else None
        if models and isinstance(models, list) and isinstance(models[0], dict):
            return {"dp_size": 1, "model_id": models[0].get("id"), "foreign": True}
        raise DiscoveryError(f"{url} has no /server_info, /get_server_info or /v1/models")
    except http.ERRORS as exc:
        raise DiscoveryError(f"cannot reach {url}: {exc!r}") from exc


VOLATILE_KEYS = ("ranks",)  # live state in our engine's /server_info (pids, requests in flight)


def stable_info(info: dict) -> dict:
    """``info`` without its live state: what identifies the worker's configuration."""
    return {k: v for k, v in (info or {}).items() if k not in VOLATILE_KEYS}


def dp_size_of(info: dict) -> int:
    size = info.get("dp_size") or 1
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise DiscoveryError(f"server_info has an invalid dp_size {size!r}")
    return size
