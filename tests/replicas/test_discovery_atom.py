"""ATOM's prefill/decode workers: discovery reads their ``/kv_transfer_info`` and the decode leg
carries the prefill side's layout (``remote_dp_size``, ``remote_tp_size``, ``remote_dp_rank``).
ATOM needs a GPU and does not run here: a small HTTP server answers its two endpoints as ATOM
documents them (its PR #1501 and its PD mode), the rest is the router's real code."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from apps.replicas.discovery import fetch_server_info
from apps.replicas.models import Worker
from apps.routing.decision.fleet import Target
from apps.routing.proxy import wire
from apps.routing.records import view_of
from controlplane import http

ANSWERS = {
    "/server_info": {"dp_size": 4, "model_id": "m", "max_model_len": 8192, "page_size": 16},
    "/kv_transfer_info": {"tp_size": 2, "dp_size": 4, "engine_id": "atom-p0", "role": "prefill"},
}


@pytest.fixture
def atom_url():
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            answer = ANSWERS.get(self.path)
            body = json.dumps(answer).encode() if answer else b"{}"
            self.send_response(200 if answer else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


async def test_an_atom_prefill_workers_layout_goes_with_each_decode_leg(atom_url):
    try:
        info = await fetch_server_info(atom_url)
    finally:
        await http.client.aclose()  # bound to this test's event loop
    assert info["flavour"] == "atom"
    assert info["kv_transfer_info"]["tp_size"] == 2
    assert info["sources"]["kv_transfer_info"] == "/kv_transfer_info"
    worker = Worker(id=1, url=atom_url, dp_size=4, model_id="m", server_info=info)
    view = view_of(worker)
    assert (view.flavour, view.tp_size) == ("atom", 2)
    answer = {"remote_engine_id": "atom-p0", "remote_block_ids": [1, 2], "remote_host": "h"}
    params = wire.decode_kv_transfer_params(answer, Target(view, 3))
    assert params == {**answer, "remote_dp_rank": 3, "remote_dp_size": 4, "remote_tp_size": 2}
    # what the prefill answer says itself wins; other flavours' answers go as they came
    said = wire.decode_kv_transfer_params({**answer, "remote_dp_rank": 1}, Target(view, 3))
    assert said["remote_dp_rank"] == 1
    view.flavour = "vllm"
    assert wire.decode_kv_transfer_params(answer, Target(view, 3)) == answer


async def test_an_atom_server_without_pd_is_discovered_as_before(atom_url, monkeypatch):
    monkeypatch.delitem(ANSWERS, "/kv_transfer_info")
    try:
        info = await fetch_server_info(atom_url)
    finally:
        await http.client.aclose()
    assert info["flavour"] == "atom" and "kv_transfer_info" not in info
