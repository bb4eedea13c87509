"""LoRA adapters on a real ``manage.py runengine --lora-modules`` (tiny model, dp_size 2), as vLLM
serves them: a request picks an adapter by its ``model``; /v1/models lists each adapter with its
``parent``; /server_info names them for routers; every rank serves each; an adapter's prefix
blocks are its own; a bad adapter fails the start with a message naming it."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
import torch
from transformers import AutoTokenizer

from engine.tiny import ensure_tiny_model
from engine.tiny_lora import ensure_tiny_adapter
from harness.procs import start_engine
from tests.engine.lora_reference import Reference, write_adapter

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
PROMPT = [(i * 37) % 3900 + 50 for i in range(2 * 16 + 5)]  # two full blocks, token ids


@pytest.fixture(scope="module")
def adapters() -> dict[str, str]:
    return {"one": str(ensure_tiny_adapter(1)), "two": str(ensure_tiny_adapter(2))}


@pytest.fixture(scope="module")
def engine(tmp_path_factory, adapters):
    two = json.dumps({"name": "two", "path": adapters["two"], "base_model_name": "tiny"})
    with start_engine(
        tmp_path_factory.mktemp("lora-engine"),
        "--dp-size", "2", "--num-kv-blocks", "128", "--max-model-len", "512",
        "--lora-modules", f"one={adapters['one']}", two,
    ) as server:  # fmt: skip
        yield server


@pytest.fixture(scope="module")
def expected(adapters):
    """The text greedy decoding of the merged model gives for ``PROMPT``, by model name."""
    reference = Reference({None: None, **adapters})
    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model())
    ids = {name: reference(name, PROMPT, MAX_TOKENS) for name in (None, "one", "two")}
    assert ids[None] != ids["one"] != ids["two"]  # the adapters change the output
    return {
        name or "tiny": tokenizer.decode(i, skip_special_tokens=True) for name, i in ids.items()
    }


def complete(url: str, model: str, rank: int, prompt=PROMPT, **extra) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "data_parallel_rank": rank, **extra}  # fmt: skip
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def test_models_and_server_info_list_the_adapters(engine, adapters):
    cards = httpx.get(engine.url + "/v1/models").json()["data"]
    assert [c["id"] for c in cards] == ["tiny", "one", "two"]  # the base model's card first
    for card in cards[1:]:
        assert card["object"] == "model" and card["parent"] == "tiny"
        assert card["root"] == adapters[card["id"]]
    assert cards[0]["parent"] is None
    info = httpx.get(engine.url + "/server_info").json()
    assert [(m["name"], m["path"]) for m in info["lora_modules"]] == list(adapters.items())
    assert info["max_lora_rank"] == 16


@pytest.mark.parametrize("rank", [0, 1])
def test_every_rank_serves_each_adapter_as_the_merged_model(engine, expected, rank):
    for model in ("tiny", "one", "two"):
        r = complete(engine.url, model, rank)
        assert r.status_code == 200, r.text
        assert r.headers["x-data-parallel-rank"] == str(rank)
        answer = r.json()
        assert answer["model"] == model  # the adapter's name is echoed
        assert answer["choices"][0]["text"] == expected[model]


def test_an_adapters_prefix_blocks_are_its_own_on_the_server(engine):
    prompt = [p + 1 for p in PROMPT]  # no other test's blocks
    usage = lambda model: complete(engine.url, model, 1, prompt).json()["usage"]  # noqa: E731
    assert usage("one")["prompt_tokens_details"]["cached_tokens"] == 0
    assert usage("one")["prompt_tokens_details"]["cached_tokens"] == 2 * 16
    assert usage("two")["prompt_tokens_details"]["cached_tokens"] == 0
    assert usage("tiny")["prompt_tokens_details"]["cached_tokens"] == 0


@pytest.mark.parametrize("stream", [False, True])
def test_chat_and_completions_with_an_adapter_through_the_openai_client(engine, stream):
    client = openai.OpenAI(base_url=engine.url + "/v1", api_key="unused")
    messages = [{"role": "user", "content": "which adapter answers?"}]
    args = {"max_tokens": 5, "temperature": 0, "stream": stream}
    if stream:
        args["stream_options"] = {"include_usage": True}
    texts = {}
    for model in ("one", "tiny"):
        chat = client.chat.completions.create(model=model, messages=messages, **args)
        comp = client.completions.create(model=model, prompt="which adapter answers?", **args)
        if stream:
            chunks, comp_chunks = list(chat), list(comp)
            assert {c.model for c in chunks + comp_chunks} == {model}
            assert chunks[-1].usage.completion_tokens == 5
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            assert chat.model == comp.model == model and chat.usage.completion_tokens == 5
            text = chat.choices[0].message.content
        texts[model] = text
    assert texts["one"] != texts["tiny"]


def test_responses_with_an_adapter(engine):
    client = openai.OpenAI(base_url=engine.url + "/v1", api_key="unused")
    answers = {
        model: client.responses.create(
            model=model, input="name three colours", max_output_tokens=6, temperature=0
        )
        for model in ("two", "tiny")
    }
    assert answers["two"].model == "two" and answers["two"].status == "completed"
    assert answers["two"].output_text != answers["tiny"].output_text


def test_unknown_models_are_404_and_adapters_are_400_on_embeddings(engine):
    for path, body in (
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
        ("/v1/responses", {"input": "x"}),
        ("/v1/embeddings", {"input": "x"}),
    ):
        r = httpx.post(engine.url + path, json={**body, "model": "three"}, timeout=30)
        assert r.status_code == 404 and r.json()["error"]["param"] == "model", (path, r.text)
    r = httpx.post(engine.url + "/v1/embeddings", json={"input": "x", "model": "one"}, timeout=30)
    assert r.status_code == 400 and "LoRA" in r.json()["error"]["message"]
    r = httpx.post(engine.url + "/v1/embeddings", json={"input": "x", "model": "tiny"}, timeout=30)
    assert r.status_code == 200


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--lora-modules", "bad=/nonexistent/adapter"], "has no adapter_config.json"),
        (["--max-lora-rank", "4"], "LoRA rank 8 is greater than max_lora_rank 4"),
    ],
)
def test_a_bad_adapter_fails_the_start_with_a_clear_message(tmp_path, adapters, flags, message):
    args = ["--lora-modules", f"one={adapters['one']}", "--num-kv-blocks", "16"]
    with pytest.raises(RuntimeError, match=message):
        start_engine(tmp_path, *args, *flags, timeout=120).stop()


def test_an_adapter_for_another_model_fails_the_start_in_the_rank(tmp_path):
    """The front checks the config; the rank checks the weights against the model it loaded, and
    its failure ends the start at once (not after --startup-timeout)."""
    wide = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    path = write_adapter(tmp_path / "wide", {wide.format("A"): torch.zeros(2, 512),
                                             wide.format("B"): torch.zeros(256, 2)})  # fmt: skip
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"lora_A is \[2, 512\]; the model and the adapter"):
        start_engine(tmp_path, "--lora-modules", f"wide={path}", "--num-kv-blocks", "16").stop()
    assert time.monotonic() - started < 90
