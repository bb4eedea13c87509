"""Whether a worker honours the DP rank the router pins, path by path.

An engine may read the pin on one path and drop it on another, and a dropped pin still answers
200: the engine balances the request itself, the router believes it placed the prefix, and every
"hit" it predicts there is a miss (SGLang 0.5.19 ignores it on ``/v1/responses``: sglang#38729;
the most reported DP complaint: sglang#9571, ATOM#1501). So discovery asks: for each path the
router serves and each rank, one request of one token pinned to that rank, in the fields the
worker's flavour reads (``discovery.rank_fields`` and the header), and which rank served it. Each
rank is pinned twice in a row (0, 0, 1, 1, ...): an engine that ignores the pin and balances by
itself (round robin, least loaded, at random) does not serve that sequence by chance, as it may
serve 0, 1, ... one request each. The rank that served is read from:

- the answer's ``X-Data-Parallel-Rank`` header (ours and ATOM's say which rank served);
- else the rank whose request counter on ``/metrics`` moved (``vllm:request_success`` per
  ``engine``, ours per ``rank``), the probes sent one at a time;
- else unknown (an engine that says neither: nothing is concluded).

The result is the worker's ``server_info["pin_check"]``: per path ``honoured`` (true, false, or
null when unknown) and ``served`` (the rank that answered each pin, in the order sent). A path found
false is routed without believing the placement (``Router.route``: no predicted hits, nothing
inserted into the index for it), counted on ``/metrics`` (``dpmesh_router_pin_honoured``) and
logged; ``GET /workers`` shows it. The probes are 1-token prompts (no full block: nothing enters
any cache) with ``max_tokens: 1``; ``CONTROL_PLANE_PIN_CHECK=false`` turns the check off. A
prefill or decode worker is not probed: a plain request to one may wait for a bootstrap or a
transfer that never comes (SGLang's); its legs carry their ranks in the handshake.
"""

from __future__ import annotations

import asyncio
import logging
import time

from prometheus_client.parser import text_string_to_metric_families

from apps.replicas.discovery import rank_fields, wanted_lines
from controlplane import http

logger = logging.getLogger(__name__)

PATHS = ("/v1/completions", "/v1/chat/completions")
PROBE_HEADER = "x-dpmesh-pin-check"
COUNTERS = ("dpmesh_engine_requests", "vllm:request_success")
SETTLE_S = 2.0  # how long a rank's counter may take to show a finished request (ours: 0.25 s)


def _probe(path: str, model: str | None) -> dict:
    body: dict = {"max_tokens": 1, "temperature": 0}
    if model:
        body["model"] = model
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "pin"}]
    else:
        body["prompt"] = "pin"
    return body


async def _counts(url: str, api_key: str, timeout_s: float) -> dict[int, float] | None:
    """Requests finished per rank, from the engine's /metrics (None: it says none per rank)."""
    try:
        status, text = await http.get_text(url + "/metrics", api_key=api_key, timeout_s=timeout_s)
    except http.ERRORS:
        return None
    if status != 200:
        return None
    out: dict[int, float] = {}
    for family in text_string_to_metric_families(wanted_lines(text, COUNTERS)):
        for sample in family.samples:
            name = sample.name.removesuffix("_total")
            label = sample.labels.get("rank", sample.labels.get("engine"))
            if name in COUNTERS and label is not None and label.isdigit():
                out[int(label)] = out.get(int(label), 0.0) + sample.value
    return out or None


async def _served(url: str, api_key: str, path: str, body: dict, headers: dict, timeout_s: float):
    """The rank that served one pinned probe, or None when the engine does not say."""
    before = await _counts(url, api_key, timeout_s)
    session = http.client.get()
    async with session.post(
        url + path, json=body, headers=headers, timeout=http.timeout(timeout_s)
    ) as response:
        await response.read()
        if response.status != 200:
            return None
        said = response.headers.get("x-data-parallel-rank", "").strip()
    if said.isdigit():
        return int(said)
    if before is None:
        return None
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline:
        after = await _counts(url, api_key, timeout_s) or {}
        moved = [r for r, v in after.items() if v > before.get(r, 0.0)]
        if len(moved) == 1:
            return moved[0]
        await asyncio.sleep(0.1)
    return None


async def check_pins(url: str, info: dict, api_key: str = "", timeout_s: float = 10.0) -> dict:
    """``{path: {"honoured": bool | None, "served": [rank or None per pinned rank]}}`` for a
    worker of more than one rank; {} for one rank or an engine that takes no pin."""
    dp_size = info.get("dp_size") or 1
    flavour = info.get("flavour") or "dpmesh"
    if dp_size < 2 or flavour == "openai":
        return {}
    fields = rank_fields(flavour, info.get("version"))
    model = info.get("served_model_name") or info.get("model_id")
    out = {}
    for path in PATHS:
        pins = [rank for rank in range(dp_size) for _ in range(2)]
        served = []
        for rank in pins:
            body = {**_probe(path, model), **dict.fromkeys(fields, rank)}
            headers = {
                **http.auth_headers(api_key),
                "x-data-parallel-rank": str(rank),
                PROBE_HEADER: "1",  # says what it is, in the engine's access log too
            }
            try:
                served.append(await _served(url, api_key, path, body, headers, timeout_s))
            except http.ERRORS:
                served.append(None)
        honoured = None if None in served else served == pins
        out[path] = {"honoured": honoured, "served": served}
        if honoured is False:
            logger.warning(
                "worker %s drops the DP rank pin on %s (pinned %s, served by %s): its "
                "requests there are routed without predicted hits",
                url, path, pins, served,
            )  # fmt: skip
    return out
