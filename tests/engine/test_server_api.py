"""A real ``manage.py runengine`` (tiny model, dp_size 2) over real HTTP: rank hints on every
path, bad input, aborted streams, the openai client."""

import json
import socket

import httpx
import openai
import pytest

from harness.procs import metrics, start_engine, wait_for

pytestmark = pytest.mark.slow

DP = 2
MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine")
    with start_engine(
        tmp,
        "--dp-size",
        str(DP),
        "--num-kv-blocks",
        "256",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-body-bytes",
        "65536",
    ) as server:
        yield server


def body_for(endpoint: str, stream: bool, **extra) -> dict:
    body = {"max_tokens": 4, "temperature": 0, "stream": stream, **extra}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": "which rank serves me?"}]
    else:
        body["prompt"] = "which rank serves me?"
    return body


def post(url: str, endpoint: str, body, headers=None, timeout=60) -> httpx.Response:
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    if isinstance(body, (dict, list)):
        return httpx.post(url + path, json=body, headers=headers, timeout=timeout)
    return httpx.post(url + path, content=body, headers=headers, timeout=timeout)


def sse_events(text: str) -> list:
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    return [json.loads(e[6:]) for e in events[:-1]]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("how", ["body", "body-hyphen", "body-routed", "header"])
def test_requested_rank_serves(engine, endpoint, stream, how):
    for rank in range(DP):
        before = metrics(engine.url)
        extra, headers = {}, {}
        if how == "body":
            extra["data_parallel_rank"] = rank
        elif how == "body-routed":  # SGLang's newer name
            extra["routed_dp_rank"] = rank
        elif how == "body-hyphen":
            extra["data-parallel-rank"] = rank
        else:
            headers["X-data-parallel-rank"] = str(rank)
        r = post(engine.url, endpoint, body_for(endpoint, stream, **extra), headers)
        assert r.status_code == 200, r.text
        assert r.headers["x-data-parallel-rank"] == str(rank)
        if stream:
            events = sse_events(r.text)
            assert events[-1]["choices"][0]["finish_reason"] == "length"
        else:
            assert r.json()["usage"]["completion_tokens"] == 4
        after = metrics(engine.url)
        assert after[("requests", rank)] == before[("requests", rank)] + 1
        assert after[("requests", 1 - rank)] == before[("requests", 1 - rank)]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("value", [-1, DP, 1.0, True, "1", [0]])
def test_invalid_rank_in_body_is_400(engine, endpoint, stream, value):
    r = post(engine.url, endpoint, body_for(endpoint, stream, data_parallel_rank=value))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == 400
    assert f"[0, {DP - 1}]" in error["message"]


@pytest.mark.parametrize("value", ["-1", str(DP), "1.5", "one", "0x1"])
def test_invalid_rank_in_header_is_400(engine, value):
    r = post(
        engine.url, "completions", body_for("completions", False), {"X-data-parallel-rank": value}
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "X-data-parallel-rank"


def test_unhinted_requests_spread_over_ranks(engine):
    ranks = [
        int(
            post(engine.url, "completions", body_for("completions", False)).headers[
                "x-data-parallel-rank"
            ]
        )
        for _ in range(6)
    ]
    assert set(ranks) == set(range(DP)), ranks


def test_server_info_and_models(engine):
    info = httpx.get(engine.url + "/server_info").json()
    for key in (
        "dp_size",
        "model_id",
        "served_model_name",
        "model_path",
        "tp_size",
        "block_size",
        "num_kv_blocks_per_rank",
        "max_model_len",
    ):
        assert key in info
    assert (
        info["dp_size"] == DP and info["block_size"] == 16 and info["num_kv_blocks_per_rank"] == 256
    )
    assert httpx.get(engine.url + "/get_server_info").json()["dp_size"] == DP
    assert httpx.get(engine.url + "/v1/models").json()["data"][0]["id"] == "tiny"
    assert httpx.get(engine.url + "/health").status_code == 200
    # one id per engine start, on both: routers compare it to notice a restart (empty caches)
    assert (
        len(info["instance_id"]) == 32
        and httpx.get(engine.url + "/health").json()["instance_id"] == info["instance_id"]
    )


BAD_INPUTS = [
    ("completions", b"{not json", 400),
    ("completions", b"[1, 2]", 400),
    ("completions", b'{"prompt": "hi", "temperature": NaN}', 400),
    ("completions", {"max_tokens": 4}, 400),
    ("completions", {"prompt": ""}, 400),
    ("completions", {"prompt": []}, 400),
    ("completions", {"prompt": 123}, 400),
    ("completions", {"prompt": [1, "two"]}, 400),
    ("completions", {"prompt": [1, 99999]}, 400),
    ("completions", {"prompt": ["a", "b"]}, 400),
    ("chat", {"messages": []}, 400),
    ("chat", {"messages": "hello"}, 400),
    ("chat", {"messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("chat", {"messages": [{"role": "user", "content": 5}]}, 400),
    ("completions", {"prompt": "x", "model": "no-such-model"}, 404),
    ("completions", {"prompt": "x", "max_tokens": 0}, 400),
    ("completions", {"prompt": "x", "max_tokens": -3}, 400),
    ("completions", {"prompt": "x", "max_tokens": "5"}, 400),
    ("completions", {"prompt": "x", "max_tokens": MAX_MODEL_LEN}, 400),
    ("completions", {"prompt": list(range(10, 10 + MAX_MODEL_LEN))}, 400),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "n": 2}, 400),
    ("completions", {"prompt": "x", "temperature": -0.5}, 400),
    ("completions", {"prompt": "x", "temperature": "hot"}, 400),
    ("completions", {"prompt": "x", "top_p": 0}, 400),
    ("completions", {"prompt": "x", "top_p": 1.5}, 400),
    ("completions", {"prompt": "x", "stream": "yes"}, 400),
    ("completions", {"prompt": "x", "stop": 7}, 400),
    ("completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400),
    ("completions", {"prompt": "x" * 70000}, 413),
    # long text (parsed in a worker thread, engine/server/app.py): over the context, or bad params
    ("completions", {"prompt": "the cat sat " * 500}, 400),
    ("chat", {"messages": [{"role": "user", "content": "the cat sat " * 500}]}, 400),
    ("completions", {"prompt": "the cat sat " * 400, "temperature": "hot"}, 400),
    # a router's token ids beside the text (serving.openai_fields.PRETOKENIZED): checked, and the
    # text still is
    ("completions", {"prompt": "x", "dpmesh_prompt_token_ids": "12 13"}, 400),
    ("completions", {"prompt": "x", "dpmesh_prompt_token_ids": []}, 400),
    ("completions", {"prompt": "x", "dpmesh_prompt_token_ids": [12, 99999]}, 400),
    ("completions", {"prompt": "x", "dpmesh_prompt_token_ids": [12, True]}, 400),
    ("completions", {"prompt": 123, "dpmesh_prompt_token_ids": [12, 13]}, 400),
    ("completions", {"prompt": "x", "dpmesh_prompt_token_ids": [12] * MAX_MODEL_LEN}, 400),
    (
        "chat",
        {"messages": [{"role": "wizard", "content": "x"}], "dpmesh_prompt_token_ids": [12]},
        400,
    ),
]


@pytest.mark.parametrize("endpoint,body,status", BAD_INPUTS)
def test_bad_input_gets_openai_error(engine, endpoint, body, status):
    r = post(engine.url, endpoint, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]


def test_a_routers_token_ids_replace_the_text_prompts_encoding(engine):
    """The ids beside a text prompt are what the engine computes (here deliberately not the
    text's own, to tell them apart): the same tokens and usage as the ids sent as the prompt."""
    ids = list(range(40, 60))
    by_ids = post(engine.url, "completions", {"prompt": ids, "max_tokens": 6, "temperature": 0})
    given = post(
        engine.url,
        "completions",
        {
            "prompt": "hello there",
            "dpmesh_prompt_token_ids": ids,
            "max_tokens": 6,
            "temperature": 0,
        },
    )
    assert by_ids.status_code == given.status_code == 200, given.text
    assert given.json()["usage"]["prompt_tokens"] == len(ids)
    assert given.json()["choices"][0]["text"] == by_ids.json()["choices"][0]["text"]


def test_wrong_method_and_path(engine):
    assert httpx.get(engine.url + "/v1/completions").status_code == 405
    assert httpx.get(engine.url + "/v1/nothing").status_code == 404


def test_a_hostile_body_is_refused_before_it_is_read_and_a_huge_prompt_cheaply(engine):
    # the front under uvicorn sees the Content-Length first: 413 with the 50 MB never sent
    host, port = engine.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 50000000\r\n\r\n{"
        )
        assert sock.recv(4096).startswith(b"HTTP/1.1 413")
    assert httpx.get(engine.url + "/server_info").json()["max_request_body_bytes"] == 65536
    # a prompt far past max_model_len inside the body limit: tokenizing stops at the limit
    r = post(engine.url, "completions", {"prompt": "w1 " * 20000, "max_tokens": 1})
    assert r.status_code == 400, r.text
    assert (
        f"maximum context length is {MAX_MODEL_LEN} tokens; the prompt has at least"
        in (r.json()["error"]["message"])
    )


def test_aborted_streams_and_bad_input_leave_nothing_held(engine):
    aborts_before = sum(
        v for (name, _), v in metrics(engine.url).items() if name == "request_aborts"
    )
    for i in range(6):
        body = body_for(
            "completions", True, max_tokens=400, ignore_eos=True, data_parallel_rank=i % DP
        )
        with (
            httpx.Client(timeout=60) as client,
            client.stream("POST", engine.url + "/v1/completions", json=body) as r,
        ):
            assert r.status_code == 200
            next(r.iter_lines())  # one chunk arrived: the request is running; now hang up
    for endpoint, body, _ in BAD_INPUTS:
        post(engine.url, endpoint, body)

    def settled():
        m = metrics(engine.url)
        held = [
            m[(name, r)]
            for name in (
                "kv_blocks_used",
                "inflight_requests",
                "inflight_prompt_tokens",
                "num_requests_running",
                "num_requests_waiting",
            )
            for r in range(DP)
        ]
        return m if not any(held) else None

    m = wait_for(settled, timeout=20)
    assert m, f"blocks or load still held: {metrics(engine.url)}"
    assert sum(v for (name, _), v in m.items() if name == "request_aborts") - aborts_before == 6
    assert httpx.get(engine.url + "/health").status_code == 200


def test_openai_client_unmodified(engine):
    client = openai.OpenAI(base_url=engine.url + "/v1", api_key="unused")
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=5, temperature=0
    )
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 5
    assert chat.usage.prompt_tokens_details.cached_tokens == 0
    comp = client.completions.create(model="tiny", prompt="hello", max_tokens=5, temperature=0)
    assert (
        comp.choices[0].finish_reason == "length"
        and comp.usage.total_tokens == comp.usage.prompt_tokens + 5
    )
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage.completion_tokens == 5 and chunks[-1].choices == []
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == chat.choices[0].message.content  # greedy: same text either way
    comp_chunks = list(
        client.completions.create(
            model="tiny",
            prompt="hello",
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in comp_chunks if c.choices) == comp.choices[0].text
    assert comp_chunks[-1].usage.prompt_tokens == comp.usage.prompt_tokens


# ----- /v1/embeddings ----------------------------------------------------------------------------
def test_embeddings_with_the_openai_client_on_the_pinned_rank(engine):
    """OpenAI's shapes (the openai client parses them), one normalized vector per input (string,
    token ids), computed on the rank asked for, equal to the model's own last-token state."""
    import base64
    import struct

    import torch
    from transformers import AutoModel

    from engine.tiny import ensure_tiny_model

    client = openai.OpenAI(base_url=engine.url + "/v1", api_key="none")
    result = client.embeddings.with_raw_response.create(
        model="tiny",
        input=["the tiny model", "another input"],
        extra_headers={"X-data-parallel-rank": "1"},
    )
    assert result.headers["x-data-parallel-rank"] == "1"
    parsed = result.parse()
    assert [d.index for d in parsed.data] == [0, 1] and parsed.usage.prompt_tokens > 0
    first = parsed.data[0].embedding
    assert abs(sum(v * v for v in first) - 1.0) < 1e-4
    model = AutoModel.from_pretrained(ensure_tiny_model()).eval()
    ids = httpx.post(engine.url + "/v1/embeddings", json={"input": "the tiny model"}, timeout=30)
    assert ids.status_code == 200
    from transformers import AutoTokenizer

    tokens = AutoTokenizer.from_pretrained(ensure_tiny_model()).encode(
        "the tiny model", add_special_tokens=False
    )
    with torch.inference_mode():
        want = model(input_ids=torch.tensor([tokens])).last_hidden_state[0, -1].float()
    want = torch.nn.functional.normalize(want, dim=0)
    assert torch.allclose(torch.tensor(first), want, atol=1e-3)
    # token ids in, base64 out: the same vector
    b64 = httpx.post(engine.url + "/v1/embeddings", timeout=30,
                     json={"input": [tokens], "encoding_format": "base64",
                           "data_parallel_rank": 0})  # fmt: skip
    assert b64.status_code == 200 and b64.headers["x-data-parallel-rank"] == "0"
    raw = base64.b64decode(b64.json()["data"][0]["embedding"])
    decoded = struct.unpack(f"<{len(raw) // 4}f", raw)
    assert torch.allclose(torch.tensor(decoded), want, atol=1e-3)


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"input": ""}, 400, "input"),
        ({"input": []}, 400, "input"),
        ({"input": [[]]}, 400, "input"),
        ({"input": 3}, 400, "input"),
        ({"input": "x", "dimensions": 8}, 400, "dimensions"),
        ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
        ({"input": "word " * (MAX_MODEL_LEN + 10)}, 400, "input"),
        ({"input": "x", "model": "nope"}, 404, "model"),
        ({"input": "x", "data_parallel_rank": DP}, 400, "data_parallel_rank"),
    ],
)
def test_bad_embeddings_requests_are_clear_errors(engine, body, status, param):
    r = httpx.post(engine.url + "/v1/embeddings", json=body, timeout=30)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


# ----- /v1/responses -----------------------------------------------------------------------------
def test_responses_with_the_openai_client_stream_and_not_and_continued(engine):
    """OpenAI's Responses API on the chat path: the openai client parses the object and the
    stream; the streamed text is the non-streamed text (greedy); a continuation carries the stored
    conversation (more input tokens, its prefix cached on the same rank)."""
    client = openai.OpenAI(base_url=engine.url + "/v1", api_key="none")
    pin = {"X-data-parallel-rank": "1"}
    first = client.responses.with_raw_response.create(
        model="tiny", input="name three colours", instructions="answer briefly",
        max_output_tokens=6, temperature=0, extra_headers=pin,
    )  # fmt: skip
    assert first.headers["x-data-parallel-rank"] == "1"
    answer = first.parse()
    assert answer.status == "completed" and answer.id.startswith("resp_")
    assert answer.output_text and answer.usage.output_tokens == 6
    with client.responses.stream(model="tiny", input="name three colours",
                                 instructions="answer briefly", max_output_tokens=6,
                                 temperature=0) as stream:  # fmt: skip
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds and final.output_text == answer.output_text
    more = client.responses.create(
        model="tiny", input="and three more", previous_response_id=answer.id,
        max_output_tokens=4, temperature=0, extra_headers=pin,
    )  # fmt: skip
    assert more.usage.input_tokens > answer.usage.input_tokens
    assert more.usage.input_tokens_details.cached_tokens > 0  # the first turn's prefix, on rank 1
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="tiny", input="x", previous_response_id="resp_nope")
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="tiny", input="x", store=False,
                                tools=[{"type": "web_search"}])  # fmt: skip
    kept_out = client.responses.create(model="tiny", input="x", store=False, max_output_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="tiny", input="y", previous_response_id=kept_out.id)
