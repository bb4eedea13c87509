"""Discovery: what a worker is, asked of the worker itself, by engine flavour
(../shared/DESIGN.md "Engines behind the router"):

- ``dpmesh`` (ours) and ``atom``: ``GET /server_info`` (``dp_size``, ...); ours also names its
  block size, KV capacity, model path, digest scheme and KV-event stream;
- ``sglang``: ``GET /get_server_info`` (its older name) when ``/server_info`` is 404;
- ``vllm``: neither exists. Its DP size is the number of ``engine="N"`` labels on its
  ``/metrics`` (``vllm:*`` families), its block size and KV capacity are the labels of
  ``vllm:cache_config_info``, its model path is ``/v1/models``' ``root``, its KV-event endpoints
  are ``/kv_event_sources``;
- ``openai``: any other OpenAI server: one target serving what ``/v1/models`` lists.

The answer is one dict, the worker's ``server_info``: the engine's own fields, plus ``flavour``
and ``sources`` (each fact -> the endpoint it came from), so operators can see why the router
treats a worker as it does. A registration may override what discovery found (``overrides``:
``dp_size``, ``block_size``, ``tokenizer_path``, ``kv_events``); ``effective_info`` merges them.
"""

from __future__ import annotations

import re

from controlplane import http


class DiscoveryError(Exception):
    pass


OVERRIDABLE = ("dp_size", "block_size", "tokenizer_path", "kv_events", "role", "bootstrap_port")
ROLES = ("prefill", "decode")  # prefill/decode disaggregation (apps/routing/proxy/pd.py)


def role_of(info: dict) -> str | None:
    """A worker's prefill/decode role: its registration's ``role``, else what its /server_info
    says (``disaggregation_mode``: ours and SGLang's); None: it serves both in one."""
    role = info.get("role") or info.get("disaggregation_mode")
    return role if role in ROLES else None


async def fetch_server_info(url: str, api_key: str = "", timeout_s: float = 10.0) -> dict:
    url = url.rstrip("/")
    try:
        for path, flavour in (("/server_info", None), ("/get_server_info", "sglang")):
            status, body, text = await http.get_json(
                url + path, api_key=api_key, timeout_s=timeout_s
            )
            if status == 200:
                if not isinstance(body, dict):
                    raise DiscoveryError(f"GET {url}{path} answered no JSON object: {text[:200]}")
                info = _described(body, flavour or _server_info_flavour(body), path)
                if info["flavour"] == "atom":
                    await _add_kv_transfer_info(url, info, api_key, timeout_s)
                return info
            if status != 404:
                raise DiscoveryError(f"GET {url}{path} answered {status}: {text[:200]}")
        status, body, _ = await http.get_json(
            url + "/v1/models", api_key=api_key, timeout_s=timeout_s
        )
        models = body.get("data") if status == 200 and isinstance(body, dict) else None
        if not (models and isinstance(models, list) and isinstance(models[0], dict)):
            raise DiscoveryError(f"{url} has no /server_info, /get_server_info or /v1/models")
        status, metrics = await http.get_text(
            url + "/metrics", api_key=api_key, timeout_s=timeout_s
        )
        if status == 200 and "vllm:" in metrics:
            sources = await _kv_event_sources(url, api_key, timeout_s)
            return vllm_info(models, metrics, sources)
        return {
            "dp_size": 1,
            "model_id": models[0].get("id"),
            "flavour": "openai",
            "sources": {"dp_size": "default (no /server_info)", "model_id": "/v1/models"},
        }
    except http.ERRORS as exc:
        raise DiscoveryError(f"cannot reach {url}: {exc!r}") from exc


def _server_info_flavour(info: dict) -> str:
    # ours names its digest scheme and instance; ATOM's answer is the four fields of its PR #1501
    return "dpmesh" if "prefix_digest" in info or "instance_id" in info else "atom"


def _described(info: dict, flavour: str, path: str) -> dict:
    facts = [
        k for k in ("dp_size", "block_size", "num_kv_blocks_per_rank", "model_path") if k in info
    ]
    return {**info, "flavour": flavour, "sources": dict.fromkeys(facts, path)}


async def _add_kv_transfer_info(url: str, info: dict, api_key: str, timeout_s: float) -> None:
    """ATOM's PD worker says its parallel layout on ``/kv_transfer_info`` (its ``tp_size`` and
    ``dp_size`` go with each decode leg: proxy/wire.py ``decode_kv_transfer_params``); an ATOM
    server without PD has none, and that is no error."""
    status, body, _ = await http.get_json(
        url + "/kv_transfer_info", api_key=api_key, timeout_s=timeout_s
    )
    if status == 200 and isinstance(body, dict):
        info["kv_transfer_info"] = body
        info["sources"]["kv_transfer_info"] = "/kv_transfer_info"


# SGLang renamed its rank field to ``routed_dp_rank`` in sglang#19268 (merged 2026-02-24, first
# in 0.5.9), keeping ``data_parallel_rank`` as a deprecated alias that warns on every request
ROUTED_DP_RANK_SINCE = (0, 5, 9)


def rank_fields(flavour: str, version) -> tuple[str, ...]:
    """The body fields a worker reads the chosen DP rank from: SGLang's new name for releases
    that read it, its old one for older releases, both when its version is unknown (an older
    SGLang ignores the field it does not know; a newer one reads both as the same rank); ours,
    ATOM's and vLLM's (which reads only the header, sent to every flavour) the old name."""
    if flavour != "sglang":
        return ("data_parallel_rank",)
    release = _release(version)
    if release is None:
        return ("routed_dp_rank", "data_parallel_rank")
    return ("routed_dp_rank",) if release >= ROUTED_DP_RANK_SINCE else ("data_parallel_rank",)


def _release(version) -> tuple[int, ...] | None:
    """(0, 5, 9) from "0.5.9", "0.5.9.post1" or "v0.5.10rc0"; None when it says no numbers."""
    if not isinstance(version, str):
        return None
    numbers = []
    for part in version.lstrip("v").split(".")[:3]:
        digits = ""
        for ch in part:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        numbers.append(int(digits))
    return tuple(numbers) if numbers else None


# ----- vLLM: what its /metrics, /v1/models and /kv_event_sources say ------------------------------
_ENGINE_LABEL = re.compile(r'^vllm:[^{\s]*\{[^}]*\bengine="(\d+)"', re.M)
_CACHE_CONFIG = re.compile(r"^vllm:cache_config_info\{([^}]*)\}", re.M)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def vllm_info(models: list[dict], metrics: str, kv_event_sources: dict | None) -> dict:
    """The ``server_info`` of a vLLM server, from its ``/v1/models`` entries and its Prometheus
    text. The base model is the first entry without a ``parent``; the entries with one are its
    LoRA adapters (``--lora-modules``, or loaded at run time), as ``lora_modules``."""
    model = next((m for m in models if not m.get("parent")), models[0])
    engines = sorted({int(n) for n in _ENGINE_LABEL.findall(metrics)})
    dp_size = len(engines) or 1
    config = {}
    match = _CACHE_CONFIG.search(metrics)
    if match:
        config = dict(_LABEL.findall(match.group(1)))
    info = {
        "flavour": "vllm",
        "dp_size": dp_size,
        "model_id": model.get("id"),
        "served_model_name": model.get("id"),
        "model_path": model.get("root") or model.get("id"),
        "max_model_len": model.get("max_model_len"),
        "sources": {
            "dp_size": "/metrics engine labels",
            "model_path": "/v1/models root",
            "model_id": "/v1/models",
        },
    }
    if _int(config.get("block_size")):
        info["block_size"] = _int(config["block_size"])
        info["sources"]["block_size"] = "/metrics vllm:cache_config_info"
    blocks = _int(config.get("num_gpu_blocks_override")) or _int(config.get("num_gpu_blocks"))
    if blocks:
        info["num_kv_blocks_per_rank"] = blocks
        info["sources"]["num_kv_blocks_per_rank"] = "/metrics vllm:cache_config_info"
    if config.get("prefix_caching_hash_algo"):
        info["prefix_caching_hash_algo"] = config["prefix_caching_hash_algo"]
    if config.get("enable_prefix_caching"):
        info["enable_prefix_caching"] = config["enable_prefix_caching"] == "True"
    adapters = [
        {"name": m["id"], "path": m.get("root")}
        for m in models
        if m.get("parent") and isinstance(m.get("id"), str)
    ]
    if adapters:
        info["lora_modules"] = adapters
        info["sources"]["lora_modules"] = "/v1/models entries with a parent"
    if kv_event_sources:
        info["kv_event_sources"] = kv_event_sources
        info["sources"]["kv_event_sources"] = "/kv_event_sources"
    return info


async def _kv_event_sources(url: str, api_key: str, timeout_s: float) -> dict | None:
    try:
        status, body, _ = await http.get_json(
            url + "/kv_event_sources", api_key=api_key, timeout_s=timeout_s
        )
    except http.ERRORS:
        return None
    return body if status == 200 and isinstance(body, dict) and body else None


def wanted_lines(text: str, prefixes: tuple[str, ...]) -> str:
    """Only the sample lines of a Prometheus ``text`` whose metric name starts with one of
    ``prefixes``: what a parser need read (without their TYPE lines, a counter's samples keep
    their ``_total``). vLLM's /metrics is ~1,000 lines (83 kB at DP 2), mostly histograms;
    prometheus_client's parser takes ~20-25 ms of the caller's CPU, holding the GIL, for all of
    it on a 2-vCPU host."""
    return "\n".join(line for line in text.splitlines() if line.startswith(prefixes))


def _int(value) -> int | None:
    try:
        number = int(value)
    except (TypeError, ValueError):
        return None
    return number if number > 0 else None


# live state in our engine's /server_info (pids, requests in flight), and what discovery adds
# (``pin_check`` is the router's own probe, apps/replicas/pin_check.py: run again when the rest
# changed)
VOLATILE_KEYS = ("ranks", "flavour", "sources", "pin_check")


def stable_info(info: dict) -> dict:
    """``info`` without its live state and discovery's own notes: what identifies the worker's
    configuration (a refresh that finds the same saves nothing)."""
    return {k: v for k, v in (info or {}).items() if k not in VOLATILE_KEYS}


def effective_info(info: dict, overrides: dict | None) -> dict:
    """What the router serves by: the discovered ``info`` with the registration's overrides,
    each override's source named ``registration``."""
    if not overrides:
        return info or {}
    merged = {**(info or {}), **overrides}
    merged["sources"] = {
        **(info or {}).get("sources", {}),
        **dict.fromkeys(overrides, "registration"),
    }
    return merged


def dp_size_of(info: dict) -> int:
    size = info.get("dp_size") or 1
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise DiscoveryError(f"server_info has an invalid dp_size {size!r}")
    return size
