"""vLLM's KV events into the router's digests, without a vLLM (the real one: tests/vllm/): both
encodings, the engine-hash -> digest map through parent chains and removals, a cleared cache,
lost messages, and the two mismatches that otherwise give a silent 0 %."""

from __future__ import annotations

import time

import msgspec

from apps.routing.feeds.vllm_events import MISMATCH_AFTER_BLOCKS, RankDecoder
from apps.routing.records import zmq_endpoints, zmq_replay_endpoints
from engine.digests import chain_digests

BS = 4
TOKENS = list(range(100, 116))  # four blocks of four
DIGESTS = chain_digests(TOKENS, BS)


def payload(*events, rank=0, ts=None) -> bytes:
    """A vLLM message: [ts (its wall clock), events, rank]."""
    return msgspec.msgpack.encode([time.time() if ts is None else ts, list(events), rank])


def stored_map(hashes, parent, tokens, block_size=BS):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": block_size, "medium": "GPU"}  # fmt: skip


def test_stored_blocks_become_our_chained_digests_through_parent_hashes():
    decoder = RankDecoder(BS)
    first = decoder.decode(0, payload(stored_map([11, 12], None, TOKENS[:8])))
    assert first.events == [("stored", DIGESTS[:2])] and not first.gap and not first.cleared
    # a follow-up continues the chain from its parent's engine hash
    second = decoder.decode(1, payload(stored_map([13, 14], 12, TOKENS[8:])))
    assert second.events == [("stored", DIGESTS[2:])]
    assert decoder.digest_of == dict(zip([11, 12, 13, 14], DIGESTS, strict=True))


def test_a_salted_chain_is_its_tenants_digests():
    """vLLM 0.32 says a chain's first block's ``cache_salt`` in its untagged ``extra_keys`` (after
    the LoRA name, when there is one): the digests are the salted (and adapted) request's, as the
    router keys it (request_shape.tenant_namespace), never the unsalted prompt's."""
    from engine.digests import namespace

    salted = chain_digests(TOKENS, BS, namespace("tenant-a"))
    adapted = chain_digests(TOKENS, BS, namespace("tenant-a", "my-lora"))
    assert adapted[0] not in (salted[0], chain_digests(TOKENS, BS, namespace("my-lora"))[0])
    cases = [
        ([("tenant-a",), None], None, salted),
        ([("my-lora", "tenant-a"), None], "my-lora", adapted),  # the adapter's own chain
        ([(("mm", 0), "tenant-a"), None], None, salted),
    ]
    for extra, lora, want in cases:
        decoder = RankDecoder(BS)
        event = {**stored_map([11, 12], None, TOKENS[:8]), "extra_keys": extra, "lora_name": lora}
        first = decoder.decode(0, payload(event))
        assert first.events == [("stored", want[:2])], (extra, lora)
        second = decoder.decode(1, payload(stored_map([13], 12, TOKENS[8:12])))
        assert second.events == [("stored", [want[2]])]
    decoder = RankDecoder(BS)  # no salt: the plain chain
    plain = {**stored_map([11], None, TOKENS[:4]), "extra_keys": [None]}
    assert decoder.decode(0, payload(plain)).events == [("stored", DIGESTS[:1])]


def test_the_older_positional_encoding_reads_the_same():
    decoder = RankDecoder(BS)
    batch = decoder.decode(
        0,
        payload(
            ["BlockStored", [11, 12], None, TOKENS[:8], BS, None, "GPU"],
            ["BlockRemoved", [11], "GPU"],
        ),
    )
    assert batch.events == [("stored", DIGESTS[:2]), ("removed", [DIGESTS[0]])]


def test_removed_and_cleared_resolve_through_the_map():
    decoder = RankDecoder(BS)
    decoder.decode(0, payload(stored_map([11, 12, 13], None, TOKENS[:12])))
    removed = decoder.decode(1, payload({"type": "BlockRemoved", "block_hashes": [13, 99]}))
    assert removed.events == [("removed", [DIGESTS[2]])]  # 99 was never stored here: skipped
    cleared = decoder.decode(2, payload({"type": "AllBlocksCleared"}))
    assert cleared.cleared and cleared.events == [] and decoder.digest_of == {}


def test_a_sequence_gap_is_reported_and_an_unknown_parent_is_not_guessed():
    decoder = RankDecoder(BS)
    decoder.decode(0, payload(stored_map([11], None, TOKENS[:4])))
    batch = decoder.decode(5, payload(stored_map([42], 41, TOKENS[4:8])))
    assert batch.gap and batch.events == [] and decoder.unresolved == 1


def test_a_block_size_mismatch_is_named_never_silently_zero():
    decoder = RankDecoder(16)
    batch = decoder.decode(0, payload(stored_map([11, 12], None, TOKENS[:8])))
    assert batch.events == [] and "blocks of 4 tokens" in decoder.mismatch


def test_a_tokenizer_mismatch_is_named_once_enough_blocks_match_nothing_routed():
    decoder = RankDecoder(BS)
    tokens = list(range(MISMATCH_AFTER_BLOCKS * BS))
    batch = decoder.decode(
        0, payload(stored_map(list(range(1, MISMATCH_AFTER_BLOCKS + 1)), None, tokens))
    )
    stored = batch.events[0][1]
    decoder.routed(stored[:1] + list(range(MISMATCH_AFTER_BLOCKS)))
    decoder.check_language(stored)  # one routed block matches: fine
    assert decoder.mismatch is None
    other = RankDecoder(BS)
    other.decode(0, payload(stored_map(list(range(1, MISMATCH_AFTER_BLOCKS + 1)), None, tokens)))
    other.check_language(stored)  # the router sent nothing here yet: nothing to compare
    assert other.mismatch is None
    other.routed(list(range(MISMATCH_AFTER_BLOCKS)))  # it sent other blocks: the digests differ
    other.check_language(stored)
    assert "tokenizer or chat template" in other.mismatch


def test_a_sequence_that_starts_over_is_a_new_process_with_an_empty_cache():
    decoder = RankDecoder(BS)
    decoder.decode(40, payload(stored_map([11, 12], None, TOKENS[:8])))
    batch = decoder.decode(0, payload(stored_map([21], None, TOKENS[:4])))  # vLLM restarted
    assert batch.cleared and not batch.gap and decoder.restarts == 1
    assert batch.events == [("stored", DIGESTS[:1])] and decoder.digest_of == {21: DIGESTS[0]}


def test_publishers_and_replay_sockets_are_read_apart_from_kv_event_sources():
    """vLLM's /kv_event_sources: each rank's KVEventsConfig, both endpoints offset by rank."""
    sources = {
        str(r): {"enable_kv_cache_events": True, "publisher": "zmq",
                 "endpoint": f"tcp://*:{5557 + r}", "replay_endpoint": f"tcp://*:{5600 + r}",
                 "buffer_steps": 10000, "topic": "kv-events"}
        for r in range(2)
    }  # fmt: skip
    info = {"flavour": "vllm", "dp_size": 2, "kv_event_sources": sources}
    url = "http://10.0.0.5:8000"
    assert zmq_endpoints(url, info) == ("tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558")
    assert zmq_replay_endpoints(url, info, 2) == ("tcp://10.0.0.5:5600", "tcp://10.0.0.5:5601")
    for rank in sources.values():
        rank["replay_endpoint"] = None
    assert zmq_replay_endpoints(url, info, 2) == ()
    assert zmq_endpoints(url, info) == ("tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558")


def test_history_stored_before_the_router_routed_there_is_no_mismatch():
    """A replay brings blocks other clients had vLLM store before this router routed anything
    there: they never match what it sent, and must not be read as a tokenizer mismatch."""
    decoder = RankDecoder(BS)
    decoder.routed(DIGESTS)  # the router starts routing here now
    old = [list(range(1000 + 4 * i, 1004 + 4 * i)) for i in range(MISMATCH_AFTER_BLOCKS + 4)]
    for seq, tokens in enumerate(old):  # stamped a minute ago: history
        batch = decoder.decode(
            seq, payload(stored_map([500 + seq], None, tokens), ts=time.time() - 60)
        )
        decoder.check_language([d for _, ds in batch.events for d in ds])
    assert decoder.mismatch is None
    batch = decoder.decode(99, payload(stored_map([11, 12, 13, 14], None, TOKENS)))
    decoder.check_language([d for _, ds in batch.events for d in ds])
    assert decoder.mismatch is None and decoder.routed_hits == 4


async def test_the_reader_hands_on_a_burst_whole_and_in_order():
    """``follow`` reads its ZMQ socket when the loop sees the descriptor ready, and ZMQ signals
    edges: a reader that waited after one message of a burst would sit on the rest until the
    next burst. A real publisher sends 500 messages back to back; every one arrives, in order."""
    import asyncio

    import zmq

    from apps.routing.feeds.vllm_events import follow
    from harness.procs import free_port

    context = zmq.Context()
    publisher = context.socket(zmq.PUB)
    publisher.setsockopt(zmq.LINGER, 0)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    publisher.bind(endpoint)
    seen: list[int] = []
    reader = asyncio.ensure_future(follow(endpoint, lambda seq, _: seen.append(seq)))
    try:
        seq = 0
        while not seen:  # until the subscription has reached the publisher (ZMQ's slow joiner)
            publisher.send_multipart([b"", seq.to_bytes(8, "big"), b"probe"])
            seq += 1
            await asyncio.sleep(0.02)
        first = seq
        for seq in range(first, first + 500):
            publisher.send_multipart([b"", seq.to_bytes(8, "big"), b"x" * 200])
        for _ in range(250):
            if seen[-1] == first + 499:
                break
            await asyncio.sleep(0.02)
        burst = [s for s in seen if s >= first]
        assert burst == list(range(first, first + 500))
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        publisher.close()
        context.term()
