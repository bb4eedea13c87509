"""The benchmark client: datasets (shapes, determinism), statistics on hand-made samples, SSE
parsing and pacing against a fake server, and one run against a real dp 2 engine whose own
/metrics must agree with what the client reports."""

import asyncio
import contextlib
import io
import json

import httpx
import pytest
from django.core.management import call_command

from bench import cli, datasets, engine_metrics
from bench.cli import build_parser, run
from bench.client import RequestResult, send
from bench.report import format_report
from bench.runner import RunOptions, send_conversations, send_samples
from bench.summary import balance, distribution_ms, per_rank, summarize
from harness.procs import metrics, start_engine


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from engine.tiny import ensure_tiny_model

    return AutoTokenizer.from_pretrained(ensure_tiny_model())


def _prefix_rep(seed=0, **kw):
    args = dict(
        num_prompts=10,
        prefix_len=32,
        suffix_len=16,
        num_prefixes=3,
        output_len=4,
        seed=seed,
        allowed=datasets.allowed_token_ids(4096),
    )
    return datasets.prefix_repetition(**{**args, **kw})


# ----- datasets ----------------------------------------------------------------------------------
def test_prefix_repetition_shape_like_vllm():
    samples = _prefix_rep()
    assert len(samples) == 9  # 10 // 3 prompts per prefix, as vLLM: the remainder is dropped
    assert all(len(s.prompt) == s.prompt_len == 48 and s.output_len == 4 for s in samples)
    assert all(min(s.prompt) >= datasets.FIRST_PLAIN_ID and max(s.prompt) < 4096 for s in samples)
    by_group = {}
    for s in samples:
        by_group.setdefault(s.group, []).append(s.prompt)
    assert sorted(len(v) for v in by_group.values()) == [3, 3, 3]
    for prompts in by_group.values():
        assert len({tuple(p[:32]) for p in prompts}) == 1  # one shared prefix
        assert len({tuple(p[32:]) for p in prompts}) == 3  # a fresh suffix each
    assert len({tuple(v[0][:32]) for v in by_group.values()}) == 3
    assert [s.group for s in samples] != sorted(s.group for s in samples)  # shuffled


def test_prefix_repetition_is_seeded():
    assert _prefix_rep(seed=7) == _prefix_rep(seed=7)
    assert _prefix_rep(seed=7) != _prefix_rep(seed=8)
    with pytest.raises(ValueError, match="num-prompts"):
        _prefix_rep(num_prompts=2)


def test_allowed_ids_skip_the_tokenizers_special_tokens(tokenizer):
    allowed = datasets.allowed_token_ids(4096, tokenizer)
    assert not set(allowed) & set(tokenizer.all_special_ids)
    assert len(allowed) == len(tokenizer) - len(set(tokenizer.all_special_ids))


def test_text_prompts_round_trip_to_the_target_length(tokenizer):
    allowed = datasets.allowed_token_ids(4096, tokenizer)
    samples = _prefix_rep(allowed=allowed, tokenizer=tokenizer, as_text=True)
    assert all(isinstance(s.prompt, str) for s in samples)
    assert all(abs(s.prompt_len - 48) <= 2 for s in samples)  # exact per part; the seam may merge
    same = [tokenizer.encode(s.prompt) for s in samples if s.group == samples[0].group]
    assert all(ids[:24] == same[0][:24] for ids in same)  # the shared prefix tokenizes the same
    assert _prefix_rep(allowed=allowed, tokenizer=tokenizer, as_text=True) == samples


def test_random_prompts_are_independent_and_seeded():
    allowed = datasets.allowed_token_ids(4096)
    a = datasets.random_prompts(num_prompts=5, input_len=20, output_len=3, seed=1, allowed=allowed)
    assert [s.prompt_len for s in a] == [20] * 5 and len({tuple(s.prompt) for s in a}) == 5
    assert a == datasets.random_prompts(
        num_prompts=5, input_len=20, output_len=3, seed=1, allowed=allowed
    )


def test_multi_turn_shape_and_determinism(tokenizer):
    convs = datasets.multi_turn(
        num_conversations=4,
        num_turns=3,
        system_len=100,
        user_len=20,
        output_len=5,
        seed=3,
        tokenizer=tokenizer,
    )
    assert len(convs) == 4 and all(len(c.user_turns) == 3 and c.output_len == 5 for c in convs)
    assert len({c.system for c in convs}) == 1
    assert 95 <= len(tokenizer.encode(convs[0].system)) <= 115
    assert all(15 <= len(tokenizer.encode(t)) <= 20 for c in convs for t in c.user_turns)
    assert len({t for c in convs for t in c.user_turns}) == 12
    again = datasets.multi_turn(
        num_conversations=4,
        num_turns=3,
        system_len=100,
        user_len=20,
        output_len=5,
        seed=3,
        tokenizer=tokenizer,
    )
    assert again == convs


# ----- statistics --------------------------------------------------------------------------------
def _result(ttft, latency, out, prompt=100, cached=None, rank=None, itl=(), ok=True):
    return RequestResult(
        ok=ok,
        ttft=ttft,
        latency=latency,
        output_tokens=out,
        prompt_tokens=prompt,
        cached_tokens=cached,
        rank=rank,
        itl=list(itl),
        error="" if ok else "boom",
    )


def test_distribution_and_balance():
    d = distribution_ms([0.001, 0.002, 0.003, 0.010])
    assert d["mean"] == pytest.approx(4.0) and d["median"] == pytest.approx(2.5)
    assert d["p99"] == pytest.approx(3 + 0.97 * 7)  # numpy's linear interpolation, as vLLM
    assert distribution_ms([]) == {"mean": 0.0, "median": 0.0, "p99": 0.0}
    assert balance({0: 3, 1: 1}) == pytest.approx(1.5)
    assert balance({0: 4, 1: 0, 2: 0, 3: 0}) == pytest.approx(4.0)
    assert balance({}) is None


def test_summary_numbers_from_hand_made_results():
    results = [
        _result(0.1, 1.1, 11, prompt=100, cached=0, rank=0, itl=[0.1] * 10),
        _result(0.2, 0.6, 5, prompt=200, cached=150, rank=0, itl=[0.1] * 4),
        _result(0.3, 0.3, 1, prompt=100, cached=50, rank=1),
        _result(0, 0, 0, ok=False, rank=1),
    ]
    s = summarize(results, duration_s=2.0, dp_size=3)
    assert (s["completed"], s["failed"]) == (3, 1)
    assert s["total_input_tokens"] == 400 and s["total_output_tokens"] == 17
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_throughput"] == pytest.approx(8.5)
    assert s["total_token_throughput"] == pytest.approx(208.5)
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0) and s["ttft_ms"]["median"] == pytest.approx(
        200.0
    )
    assert s["tpot_ms"]["mean"] == pytest.approx(
        100.0
    )  # (1.1-0.1)/10 and (0.6-0.2)/4; 1-token request left out
    assert s["itl_ms"]["median"] == pytest.approx(100.0)
    assert s["cached_tokens"] == 200 and s["hit_rate"] == pytest.approx(0.5)
    ranks = s["per_rank"]["ranks"]
    assert ranks["0"] == {"requests": 2, "prompt_tokens": 300, "cached_tokens": 150}
    assert ranks["2"] == {
        "requests": 0,
        "prompt_tokens": 0,
        "cached_tokens": 0,
    }  # known dp_size, idle rank
    assert s["per_rank"]["requests_max_over_mean"] == pytest.approx(2.0)
    assert s["errors"] == ["boom"]
    assert per_rank([_result(0.1, 0.2, 2)]) == {}  # no rank header: no per-rank table
    assert summarize([_result(0.1, 0.2, 2)], 1.0)["hit_rate"] is None  # no cached_tokens reported


def test_router_overhead_rounds_reduce_to_medians_and_the_ratios_follow_them():
    from bench.runs.router_overhead import medians, summary

    def run(p50, rps, cpu=None):
        r = {"p50_us": p50, "p90_us": p50 + 10, "p99_us": p50 + 50, "mean_us": p50 + 5,
             "rps": rps, "requests": 100, "errors": 0, "non_2xx": 1}  # fmt: skip
        return r if cpu is None else {**r, "cpu_us": cpu}

    ours = medians([run(160, 6000, 140.0), run(150, 6100, 130.0), run(400, 2000, 300.0)])
    assert (ours["p50_us"], ours["rps"], ours["cpu_us"]) == (160, 6000, 140.0)  # one bad round
    assert (ours["requests"], ours["non_2xx"], ours["rounds"]) == (300, 3, 3)
    direct = medians([run(40, 24000), run(38, 25000), run(39, 24500)])
    assert "cpu_us" not in direct  # not measured: not made up
    peer = medians([run(110, 9000, 70.0), run(108, 8800, 72.0), run(109, 8900, 71.0)])
    results = [{**direct, "target": "direct (stand-in)", "connections": 1},
               {**ours, "target": "dpmesh router cache_aware", "connections": 1},
               {**peer, "target": "sglang-router cache_aware", "connections": 1}]  # fmt: skip
    row = next(ln for ln in summary(results).splitlines() if ln.startswith("| dpmesh"))
    # added p50 (160 - 39) / (109 - 39), req/s 6000 / 8900, CPU 140 / 71
    assert "| +0.121 | 1.73x | 0.67x | 140.0 | 1.97x |" in row


def test_engine_metrics_parse_and_delta():
    def text(r0, r1):
        return "".join(
            f'dpmesh_engine_{name}_total{{model_name="tiny",rank="{rank}"}} {value}\n'
            for rank, vals in ((0, r0), (1, r1))
            for name, value in zip(
                ("requests", "prompt_tokens", "cached_tokens"), vals, strict=True
            )
        )

    before = engine_metrics.parse(
        "# TYPE dpmesh_engine_requests_total counter\n" + text((1, 10, 0), (0, 0, 0))
    )
    after = engine_metrics.parse(text((4, 400, 96), (2, 200, 0)))
    s = engine_metrics.summarize(engine_metrics.delta(before, after))
    assert s["ranks"]["0"] == {"requests": 3, "prompt_tokens": 390, "cached_tokens": 96}
    assert s["totals"] == {"requests": 5, "prompt_tokens": 590, "cached_tokens": 96}
    assert s["requests_max_over_mean"] == pytest.approx(1.2)
    assert engine_metrics.metrics_url("http://h:1") == "http://h:1/metrics"
    assert engine_metrics.metrics_url("http://h:1/x/metrics") == "http://h:1/x/metrics"


# ----- the client against a fake server -----------------------------------------------------------
def _sse(*events) -> bytes:
    return b"".join(
        b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n"
        for e in events
    )


def _fake_stream(words: list[str], prompt_tokens=10, cached=4, rank="1") -> httpx.Response:
    chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
    chunks += [{"choices": [{"index": 0, "delta": {"content": w}}]} for w in words]
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(words),
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    return httpx.Response(
        200,
        headers={"X-Data-Parallel-Rank": rank, "content-type": "text/event-stream"},
        content=_sse(*chunks, {"choices": [], "usage": usage}, b"[DONE]"),
    )


async def test_send_reads_timing_usage_rank_and_errors():
    def handler(request):
        body = json.loads(request.content)
        if body.get("fail") == "http":
            return httpx.Response(400, json={"error": {"message": "bad"}})
        if body.get("fail") == "event":
            return httpx.Response(
                200, content=_sse({"choices": [{"text": "a"}]}, {"error": {"message": "died"}})
            )
        return _fake_stream(["a", "b", "c"])

    async with httpx.AsyncClient(
        transport=httpx.MockTransport(handler), base_url="http://fake"
    ) as client:
        ok = await send(client, "/v1/chat/completions", {})
        bad = await send(client, "/v1/completions", {"fail": "http"})
        died = await send(client, "/v1/completions", {"fail": "event"})
    assert ok.ok and ok.text == "abc" and ok.rank == 1 and len(ok.itl) == 2
    assert (ok.prompt_tokens, ok.output_tokens, ok.cached_tokens) == (10, 3, 4)
    assert 0 < ok.ttft <= ok.latency
    assert not bad.ok and bad.status == 400 and "bad" in bad.error and bad.rank is None
    assert not died.ok and "died" in died.error


async def test_a_stream_is_read_to_its_end_and_its_connection_used_again():
    """After ``[DONE]`` the client reads the stream's end (its last chunk), as OpenAI's SDK and
    vLLM's bench do: the connection goes back to the pool. Closing it unread instead had every
    streamed request open a connection of its own, which no real client does (and which hid a
    server's delayed-ACK stall that only a reused connection shows: docs/benchmarks.md)."""
    connections = []

    async def serve(reader, writer):
        connections.append(writer)
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            await answer(reader, writer)

    async def answer(reader, writer):
        while head := await reader.readuntil(b"\r\n\r\n"):
            length = next(
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            await reader.readexactly(length)
            events = _sse({"choices": [{"index": 0, "text": "a"}]}, b"[DONE]")
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"transfer-encoding: chunked\r\n\r\n"
                + b"%x\r\n%s\r\n0\r\n\r\n"
                % (len(events), events)
            )
            await writer.drain()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server, httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
        results = [await send(client, "/v1/completions", {"stream": True}) for _ in range(3)]
    assert all(r.ok and r.done and r.text == "a" for r in results)
    assert len(connections) == 1


async def test_conversations_carry_replies_and_respect_the_concurrency_cap():
    seen, inflight, peak = [], [0], [0]

    async def handler(request):
        body = json.loads(request.content)
        seen.append(body)
        inflight[0] += 1
        peak[0] = max(peak[0], inflight[0])
        await asyncio.sleep(0.01)
        inflight[0] -= 1
        turn = sum(m["role"] == "user" for m in body["messages"])
        return _fake_stream([f"reply{turn}:", body["messages"][1]["content"][:5]])

    convs = [datasets.Conversation(i, "sys", [f"u{i}-{t}" for t in range(3)], 4) for i in range(5)]
    opts = RunOptions(
        base_url="http://fake",
        model="m",
        max_concurrency=2,
        progress=False,
        transport=httpx.MockTransport(handler),
    )
    run_ = await send_conversations(opts, convs)
    assert len(run_.results) == 15 and all(r.ok for r in run_.results) and peak[0] == 2
    last = [b for b in seen if len(b["messages"]) == 6]
    assert len(last) == 5
    for body in last:
        m = body["messages"]
        assert [x["role"] for x in m] == [
            "system",
            "user",
            "assistant",
            "user",
            "assistant",
            "user",
        ]
        assert m[2]["content"] == "reply1:" + m[1]["content"][:5] and m[4]["content"].startswith(
            "reply2:"
        )
        assert (
            body["ignore_eos"] is True
            and body["temperature"] == 0
            and body["stream_options"]["include_usage"]
        )


async def test_samples_are_paced_by_the_request_rate():
    samples = _prefix_rep(num_prompts=6, num_prefixes=1)
    opts = RunOptions(
        base_url="http://fake",
        model="m",
        request_rate=50.0,
        progress=False,
        transport=httpx.MockTransport(lambda r: _fake_stream(["x"])),
    )
    run_ = await send_samples(opts, samples)
    starts = [r.start for r in run_.results]
    assert len(starts) == 6 and starts[-1] - starts[0] > 0.02  # 5 exponential gaps of mean 20 ms
    assert {r.meta["group"] for r in run_.results} == {0}


# ----- what a router tells about its workers ------------------------------------------------------
def _router(workers: list[dict] | None):
    """A fake router: no /server_info, its /v1/models, and ``workers`` on GET /workers (None: no
    workers API at all, as any other OpenAI server)."""

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny"}, {"id": "other"}]})
        if request.url.path == "/workers" and workers is not None:
            return httpx.Response(200, json={"workers": workers})
        return httpx.Response(404, json={"error": "not found"})

    return httpx.Client(base_url="http://router", transport=httpx.MockTransport(answer))


def _worker(model: str, health: str, path: str, dp_size: int = 2, overrides=None) -> dict:
    info = {"model_path": path, "vocab_size": 4096, "block_size": 16, "max_model_len": 2048}
    return {"model": model, "health": health, "dp_size": dp_size, "server_info": info,
            "overrides": overrides or {}}  # fmt: skip


def test_a_routers_workers_give_the_model_facts_bench_needs():
    workers = [
        _worker("other", "healthy", "/m/other"),
        _worker("tiny", "unhealthy", "/m/down"),
        _worker("tiny", "healthy", "/m/tiny", overrides={"tokenizer_path": "/tok/tiny"}),
    ]
    with _router(workers) as client:
        assert cli._server_info(client) == {} and cli._models(client) == ["tiny", "other"]
        info = cli._fleet_info(client, "tiny")
    # the healthy worker of the model, its registration's tokenizer first; two workers: no dp_size
    assert info == {"vocab_size": 4096, "block_size": 16, "max_model_len": 2048,
                    "model_path": "/tok/tiny"}  # fmt: skip
    with _router([_worker("tiny", "healthy", "/m/tiny")]) as client:
        assert cli._fleet_info(client, "tiny")["dp_size"] == 2  # one worker: its ranks are ours
    with _router(None) as client:
        assert cli._fleet_info(client, "tiny") == {}


# ----- against a real engine ---------------------------------------------------------------------
@pytest.mark.slow
def test_against_a_dp2_engine_the_reported_hits_match_the_engines_metrics(tmp_path):
    with start_engine(tmp_path, "--dp-size", "2", "--num-kv-blocks", "256") as engine:
        before = metrics(engine.url)
        args = build_parser().parse_args(
            [
                "--base-url",
                engine.url,
                "--dataset-name",
                "prefix_repetition",
                "--num-prompts",
                "12",
                "--prefix-repetition-prefix-len",
                "64",
                "--prefix-repetition-suffix-len",
                "32",
                "--prefix-repetition-num-prefixes",
                "2",
                "--prefix-repetition-output-len",
                "4",
                "--max-concurrency",
                "2",
                "--engine-metrics-url",
                engine.url,
                "--disable-tqdm",
                "--json",
                str(tmp_path / "r.json"),
            ]
        )
        report = run(args)
        after = metrics(engine.url)
        s = report["summary"]
        assert s["completed"] == 12 and s["failed"] == 0 and s["total_output_tokens"] == 48
        assert s["total_input_tokens"] == 12 * 96
        for rank in (0, 1):
            row = s["per_rank"]["ranks"][str(rank)]
            assert (
                row["cached_tokens"]
                == after[("cached_tokens", rank)] - before[("cached_tokens", rank)]
            )
            assert (
                row["prompt_tokens"]
                == after[("prompt_tokens", rank)] - before[("prompt_tokens", rank)]
            )
            assert row["requests"] == after[("requests", rank)] - before[("requests", rank)]
            assert report["engine_metrics"]["ranks"][str(rank)] == row
        cached = sum(after[("cached_tokens", r)] - before[("cached_tokens", r)] for r in (0, 1))
        assert (
            s["cached_tokens"] == cached and cached % 64 == 0 and cached >= 64 * 4
        )  # whole prefixes only
        assert s["hit_rate"] == pytest.approx(cached / (12 * 96))
        assert json.loads((tmp_path / "r.json").read_text())["summary"]["cached_tokens"] == cached
        assert "Hit rate" in format_report(report)

        # The manage.py wrapper, on multi-turn chat: the same flags, the same accounting.
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            call_command(
                "bench",
                "--base-url",
                engine.url,
                "--dataset-name",
                "multi_turn",
                "--multi-turn-conversations",
                "3",
                "--multi-turn-turns",
                "2",
                "--multi-turn-system-len",
                "64",
                "--multi-turn-user-len",
                "16",
                "--multi-turn-output-len",
                "4",
                "--max-concurrency",
                "3",
                "--engine-metrics-url",
                engine.url,
                "--disable-tqdm",
                "--json",
                str(tmp_path / "mt.json"),
            )
        mt = json.loads((tmp_path / "mt.json").read_text())
        assert mt["summary"]["completed"] == 6 and mt["summary"]["cached_tokens"] > 0
        assert mt["summary"]["cached_tokens"] == mt["engine_metrics"]["totals"]["cached_tokens"]
        assert "Serving Benchmark Result" in out.getvalue()
