"""What the router reads from a client and writes to an engine: strict JSON in (no NaN or
Infinity, which Python's json takes and JSON has not), the same object out whichever encoder wrote
it (msgspec, or json for what msgspec refuses)."""

import json
from types import SimpleNamespace

import pytest

from apps.routing.proxy import wire
from apps.routing.proxy.endpoint import ProxyError, parse
from apps.routing.proxy.wire import upstream_payload
from controlplane import http1
from engine.digests import block_digest, chain_digests


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_a_body_with_a_non_json_constant_is_a_400(constant):
    with pytest.raises(ProxyError) as err:
        parse(b'{"prompt": "hi", "temperature": ' + constant.encode() + b"}")
    assert err.value.status == 400 and "not valid JSON" in str(err.value.message)


@pytest.mark.parametrize("flavour", ["dpmesh", "vllm"])
@pytest.mark.parametrize(
    "prompt", ["plain", 'café 東京 🙂 "quoted" \\ back\nslash', "lone \ud800 surrogate"]
)
def test_the_upstream_body_is_the_clients_plus_the_routers_fields(prompt, flavour):
    """The router's ids go beside the text to our engine and in its place to vLLM (``ids_for``
    says when); a client's own ids field never passes."""
    worker = SimpleNamespace(rank_fields=("data_parallel_rank",), flavour=flavour)
    dispatch = SimpleNamespace(target=SimpleNamespace(rank=3, worker=worker))
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2**70, "dpmesh_prompt_token_ids": [9]}
    out = json.loads(upstream_payload(body, dispatch, stream=True, ids=[1, 2, 3]))
    ids = {"dpmesh_prompt_token_ids": [1, 2, 3]} if flavour == "dpmesh" else {"prompt": [1, 2, 3]}
    assert out == {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": 2**70,
        "data_parallel_rank": 3,
        "stream_options": {"include_usage": True},
        **ids,
    }


@pytest.mark.parametrize("api_key", ["", "sk-1"])
@pytest.mark.parametrize("rank", [None, 0, 3])
@pytest.mark.parametrize("explains", [False, True])
def test_the_upstream_head_is_the_upstream_headers_on_the_wire(api_key, rank, explains):
    """The head encoded once per target (and the prediction added) is what the dict would be."""
    worker = SimpleNamespace(api_key=api_key)
    dispatch = SimpleNamespace(target=SimpleNamespace(rank=rank, worker=worker),
                               explains=explains, predicted_tokens=96)  # fmt: skip
    for _ in range(2):  # made, then taken as made
        head = wire.upstream_head(dispatch)
        assert head == http1.encode_headers(wire.upstream_headers(dispatch))
    assert (b"authorization: bearer sk-1\r\n" in head.lower()) == bool(api_key)
    assert (b"x-data-parallel-rank: 3\r\n" in head) == (rank == 3)
    assert (b"x-dpmesh-predicted-cached-tokens: 96\r\n" in head) == explains


@pytest.mark.parametrize(
    "flavour, version, fields",
    [
        ("sglang", "0.5.19", {"routed_dp_rank"}),
        ("sglang", "v0.5.9.post1", {"routed_dp_rank"}),
        ("sglang", "0.5.8", {"data_parallel_rank"}),
        ("sglang", "0.4.10rc1", {"data_parallel_rank"}),
        ("sglang", None, {"routed_dp_rank", "data_parallel_rank"}),  # unknown: both, same rank
        ("vllm", "0.32.0", {"data_parallel_rank"}),
        ("dpmesh", None, {"data_parallel_rank"}),
        ("atom", None, {"data_parallel_rank"}),
    ],
)
def test_the_rank_goes_in_the_field_each_flavour_and_release_reads(flavour, version, fields):
    """SGLang renamed its field (sglang#19268, in 0.5.9); the client's own pin fields, whatever
    their name, are replaced by the router's choice."""
    from apps.replicas.discovery import rank_fields

    worker = SimpleNamespace(rank_fields=rank_fields(flavour, version), flavour=flavour)
    dispatch = SimpleNamespace(target=SimpleNamespace(rank=2, worker=worker))
    body = {"prompt": "x", "routed_dp_rank": 0, "data_parallel_rank": 1, "data-parallel-rank": 1}
    out = json.loads(upstream_payload(body, dispatch, stream=False))
    assert {k: v for k, v in out.items() if k != "prompt"} == dict.fromkeys(fields, 2)


def test_chained_digests_are_block_digests_chained():
    ids = [(i * 7919) % 4096 for i in range(16 * 9 + 5)]
    parent, expected = None, []
    for start in range(0, 16 * 9, 16):
        parent = block_digest(parent, ids[start : start + 16])
        expected.append(parent)
    assert chain_digests(ids, 16) == expected
    assert chain_digests(ids[16:], 16, parent=expected[0]) == expected[1:]
    assert chain_digests(ids[:15], 16) == []


@pytest.mark.parametrize(
    "event, usage",
    [
        (b'data: {"choices": [{"text": "a"}], "usage": null}', None),
        (b'data: {"choices":[{"text":"a"}],"usage":null}', None),
        (b'data: {"choices": [{"text": "say \\"usage\\": {\\"x\\": 1}"}], "usage": null}', None),
        (b'data: {"choices": [], "usage": {"prompt_tokens": 3}}', {"prompt_tokens": 3}),
        (b'data: {"choices":[],"usage":{"prompt_tokens":3}}', {"prompt_tokens": 3}),
        (b'data: {"choices": [{"text": "no usage key"}]}', None),
        (b"data: [DONE]", None),
    ],
)
def test_the_usage_of_a_stream_event(event, usage):
    from apps.routing.proxy.wire import usage_of

    assert usage_of(event) == usage


@pytest.mark.parametrize(
    "content, usage",
    [
        (b'{"choices": [{"text": "a", "logprobs": {"tokens": ["a"]}}],'
         b' "usage": {"prompt_tokens": 3, "prompt_tokens_details": {"cached_tokens": 2}}}',
         {"prompt_tokens": 3, "prompt_tokens_details": {"cached_tokens": 2}}),
        (b'{"choices": [], "usage": null}', None),
        (b'{"choices": []}', None),
        (b'{"usage": [1, 2]}', None),
        (b'[{"usage": {"prompt_tokens": 3}}]', None),
        (b"<html>busy</html>", None),
    ],
)  # fmt: skip
def test_the_usage_of_an_answer_read_whole(content, usage):
    assert wire.usage_from_body(content) == usage


def test_ids_go_beside_the_text_only_when_made_with_the_engines_own_tokenizer(tmp_path):
    """With ``--tokenizer-path`` the router digests prompts with its own tokenizer; its ids must
    not replace the engine's encoding, which may differ (another prompt to the engine)."""
    from apps.routing.decision.config import RouterConfig
    from apps.routing.decision.router import Router
    from apps.routing.proxy.wire import ids_for
    from apps.routing.records import view_of
    from engine.digests import SCHEME

    engine_model, routers_tokenizer = tmp_path / "engine-model", tmp_path / "router-tokenizer"
    engine_model.mkdir(), routers_tokenizer.mkdir()
    info = {
        "dp_size": 1,
        "block_size": 16,
        "model_path": str(engine_model),
        "prefix_digest": SCHEME,
    }
    worker = SimpleNamespace(
        id=1, url="http://127.0.0.1:9", api_key="", model_name="tiny", served_model_name="tiny",
        model_id="tiny", dp_size=1, dp_aware=True, draining=False, health="healthy",
        Health=SimpleNamespace(UNHEALTHY="unhealthy"), server_info=info, overrides={},
    )  # fmt: skip

    def sent(tokenizer_path):
        router = Router(RouterConfig(tokenizer_path=tokenizer_path))
        router.install_worker(view_of(worker, tokenizer_path), {0: 1})
        (target,) = router.fleet.all_targets()
        ids = {router.tokenizer_path_of(target): [1, 2, 3]}
        return ids_for(router, target, ids)

    assert sent(None) == [1, 2, 3]  # the engine's own tokenizer: its ids are the engine's
    assert sent(str(routers_tokenizer)) is None  # the router's own: the engine encodes the text


def test_a_decode_answers_cached_tokens_become_the_prefill_sides():
    """vLLM's decode worker counts the KV it pulled as cached (the whole prompt); the client is
    owed the prefill side's count (apps/routing/proxy/pd.py)."""
    usage = {"prompt_tokens": 300, "completion_tokens": 2,
             "prompt_tokens_details": {"cached_tokens": 288}}  # fmt: skip
    body = json.dumps({"id": "x", "choices": [{"text": "hi"}], "usage": usage}).encode()
    fixed = json.loads(wire.with_cached_tokens(body, 96))
    assert fixed["usage"]["prompt_tokens_details"] == {"cached_tokens": 96}
    assert fixed["choices"] == [{"text": "hi"}] and fixed["usage"]["prompt_tokens"] == 300
    event = b'data: {"choices": [], "usage": {"prompt_tokens": 300, "prompt_tokens_details": null}}'
    out = wire.with_cached_tokens(event, 0)
    assert out.startswith(b"data: ") and wire.usage_of(out)["prompt_tokens_details"] == {
        "cached_tokens": 0
    }
    no_usage = b'data: {"choices": [{"text": "a"}], "usage": null}'
    assert wire.with_cached_tokens(no_usage, 5) == no_usage
    assert wire.cached_tokens_of(json.loads(body)) == 288
    assert wire.cached_tokens_of({"usage": None}) is None


@pytest.mark.parametrize(
    "configured, flavour, bootstrap_port, decoders, protocol",
    [
        ("auto", "dpmesh", 8998, {"dpmesh"}, "sglang"),  # ours in both roles: one step
        ("auto", "dpmesh", None, {"dpmesh"}, "vllm"),  # no bootstrap listener known
        ("auto", "dpmesh", 8998, {"dpmesh", "vllm"}, "vllm"),  # a decode worker not ours
        ("auto", "sglang", 8998, {"sglang"}, "sglang"),
        ("auto", "vllm", None, {"vllm"}, "vllm"),
        ("auto", "atom", None, {"atom"}, "vllm"),
        ("vllm", "dpmesh", 8998, {"dpmesh"}, "vllm"),  # --pd-protocol decides
        ("sglang", "vllm", None, {"vllm"}, "sglang"),
    ],
)
def test_the_pd_protocol_is_one_step_where_every_worker_can_take_it(
    configured, flavour, bootstrap_port, decoders, protocol
):
    prefill = SimpleNamespace(flavour=flavour, bootstrap_port=bootstrap_port)
    assert wire.pd_protocol(configured, prefill, decoders) == protocol
