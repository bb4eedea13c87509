"""Graceful drain of the engine process (serving/drain.py): at SIGTERM its /health says
``draining`` (503) and new requests get a 503 OpenAI error while the stream in flight runs to its
end; then the process exits 0. The simulated engine (its step time slowed down so a stream lasts
seconds) serves it: the drain is the front's, the same code with a model."""

from __future__ import annotations

import signal
import time

import httpx
import pytest

from harness.procs import start_engine, wait_for
from tests.routing.test_drain import DIRTY, Stream

pytestmark = pytest.mark.slow


def test_sigterm_drains_the_engine_streams_finish_new_requests_get_503(tmp_path):
    engine = start_engine(tmp_path, "--simulate", "h100-llama3.1-8b", "--simulate-speedup",
                          "0.1", "--drain-timeout-secs", "20")  # fmt: skip
    try:
        stream = Stream(engine.url, model="tiny", max_tokens=40)  # 40 x ~65 ms
        assert stream.first.wait(20) and stream.error is None
        engine.proc.send_signal(signal.SIGTERM)  # the front only: its ranks stop after it
        assert wait_for(lambda: _draining(engine.url), timeout=5)
        late = {"model": "tiny", "prompt": "late", "max_tokens": 2}
        r = httpx.post(engine.url + "/v1/completions", json=late, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error", r.text
        stream.join(20)
        assert stream.error is None and stream.status == 200
        assert stream.text.rstrip().endswith("data: [DONE]"), stream.text[-300:]
        started = time.monotonic()
        assert engine.proc.wait(15) == 0, engine.log()[-3000:]
        assert time.monotonic() - started < 15
        assert not [d for d in DIRTY if d in engine.log()], engine.log()[-3000:]
    finally:
        engine.stop()


def _draining(url: str) -> bool:
    r = httpx.get(url + "/health", timeout=5)
    return r.status_code == 503 and r.json()["status"] == "draining"
