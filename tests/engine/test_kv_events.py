"""GET /kv_events: each rank's prefix cache as it changes. A reader gets a snapshot per rank, then
stored/removed digests in order; the digests are the chained block digests of the prompt (what a
router computes), evictions are reported, and a new reader's snapshot equals what an old reader
built from the events. A rank that dies reports its cache gone."""

import json
import os
import signal
import threading

import httpx
import pytest

from engine.digests import chain_digests
from harness.procs import metrics, start_engine, wait_for

pytestmark = pytest.mark.slow

BLOCK = 16


class Reader:
    """Reads /kv_events in a thread and keeps each rank's cached digests as the events say."""

    def __init__(self, url: str):
        self.messages: list[dict] = []
        self.cached: dict[int, set[int]] = {}
        self.stored: dict[int, list[int]] = {}
        self.removed: dict[int, list[int]] = {}
        self._response = None
        self._thread = threading.Thread(target=self._run, args=(url,), daemon=True)
        self._thread.start()

    def _run(self, url: str) -> None:
        try:
            with httpx.stream("GET", url + "/kv_events", timeout=None) as r:
                self._response = r
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self._apply(json.loads(line[len("data: ") :]))
        except httpx.HTTPError:
            pass

    def _apply(self, message: dict) -> None:
        self.messages.append(message)
        rank = message.get("rank")
        if "snapshot" in message:
            self.cached[rank] = set(message["snapshot"])
        for kind, digests in message.get("events", ()):
            if kind == "stored":
                self.cached[rank].update(digests)
                self.stored.setdefault(rank, []).extend(digests)
            else:
                self.cached[rank].difference_update(digests)
                self.removed.setdefault(rank, []).extend(digests)

    def close(self) -> None:
        if self._response is not None:
            self._response.close()


def complete(url: str, prompt: list[int], rank: int) -> dict:
    r = httpx.post(
        url + "/v1/completions",
        timeout=60,
        json={"prompt": prompt, "max_tokens": 1, "temperature": 0, "data_parallel_rank": rank},
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_kv_events_follow_the_prefix_cache(tmp_path):
    with start_engine(
        tmp_path, "--dp-size", "2", "--num-kv-blocks", "32", "--block-size", str(BLOCK)
    ) as engine:
        assert httpx.get(engine.url + "/server_info").json()["kv_events"] == "/kv_events"
        first = Reader(engine.url)
        try:
            assert wait_for(lambda: len(first.messages) >= 2, timeout=10)
            assert first.messages[:2] == [{"rank": 0, "snapshot": []}, {"rank": 1, "snapshot": []}]

            prompt = [7] * 8 + list(range(100, 192))  # 100 tokens: 6 full blocks
            complete(engine.url, prompt, rank=1)
            expected = chain_digests(prompt, BLOCK)[:6]
            assert wait_for(lambda: first.stored.get(1) == expected, timeout=10), first.stored
            assert first.stored.get(0) is None  # the other rank cached nothing

            # three other 200-token prompts need 39 blocks of rank 1's 32: the first prompt's go
            for i in range(3):
                complete(engine.url, [i + 1] * 200, rank=1)
            assert wait_for(lambda: set(expected) <= set(first.removed.get(1, ())), timeout=10), (
                first.removed
            )
            assert not first.cached[1] & set(expected)
            again = complete(
                engine.url, prompt, rank=1
            )  # the engine agrees: nothing of it is cached
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

            second = Reader(engine.url)  # a late reader starts from where the events have led
            try:
                assert wait_for(lambda: len(second.messages) >= 2, timeout=10)
                assert wait_for(lambda: second.cached == first.cached, timeout=10)
                assert set(expected) <= second.cached[1]  # the repeated prompt is back
                m = metrics(engine.url)
                assert (
                    len(second.cached[1]) == m[("kv_blocks_cached", 1)] + m[("kv_blocks_used", 1)]
                )
            finally:
                second.close()

            pid = httpx.get(engine.url + "/server_info").json()["ranks"][1]["pid"]
            os.kill(pid, signal.SIGKILL)
            assert wait_for(lambda: first.cached[1] == set(), timeout=15)  # its cache died with it
        finally:
            first.close()
