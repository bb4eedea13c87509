"""Prefill/decode disaggregation inside the engine (engine/kv_transfer.py): a prefill engine holds
a prompt's blocks, a decode engine pulls them over a real TCP connection, caches them as its own
and generates; greedy output equals the single-role engine's, token for token (fp32)."""

from __future__ import annotations

import random
import socket
import threading
import time

import pytest

from engine import kv_transfer
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

BS = 16
GREEDY = SamplingParams(max_tokens=12, temperature=0)
PREFILL = SamplingParams(max_tokens=1, temperature=0)


def make_engine(**kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 256)
    return LLMEngine(EngineConfig(model="tiny", block_size=kw.pop("block_size", BS), **kw))


@pytest.fixture(scope="module")
def single():
    engine, memo = make_engine(), {}

    def generate(prompt: list[int]) -> list[int]:
        if tuple(prompt) not in memo:
            memo[tuple(prompt)] = engine.generate([prompt], GREEDY)[0]["token_ids"]
        return memo[tuple(prompt)]

    return generate


@pytest.fixture(scope="module")
def prefill():
    engine = make_engine(max_num_batched_tokens=48)  # chunked: prompts here are longer
    server = kv_transfer.KVServer(
        "127.0.0.1", 0, engine.runner.kv_layout, engine.runner.export_blocks
    )
    yield engine, server
    server.close()


def run(engine: LLMEngine, request_id: str) -> list:
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == request_id]
    return outs


_ids = iter(range(10**6))


def prefill_leg(prefill, prompt: list[int]):
    """Run the prefill leg; returns (request id, its last output) with the blocks offered."""
    engine, server = prefill
    rid = f"p{next(_ids)}"
    engine.add_request(rid, prompt, PREFILL, hold_key=rid)
    last = run(engine, rid)[-1]
    held = engine.held[rid]
    assert last.held_block_ids == held.block_ids and len(held.block_ids) == len(prompt) // BS
    assert engine.take_new_holds() == [(rid, held)]
    server.offer(rid, held.block_ids, held.digests, held.cached_tokens)
    return rid, last


def decode_leg(decode: LLMEngine, prefill, rid: str, prompt: list[int], remote_cached: int):
    """Pull what ``decode`` lacks, then generate; returns (outputs, blocks pulled, hit tokens)."""
    engine, server = prefill
    seq = Sequence(prompt, GREEDY, block_size=BS)
    usable = min(len(engine.held[rid].block_ids), (len(prompt) - 1) // BS)
    first = len(decode.block_manager.cached_prefix(seq, usable))
    wanted = list(range(first, usable))
    layout = decode.runner.kv_layout
    data, cached = kv_transfer.pull(
        "127.0.0.1", server.port, rid, wanted, [seq.digest(i) for i in wanted], layout
    )
    assert cached == remote_cached
    served = server.done.get(timeout=5)
    assert served.request_id == rid and served.blocks == len(wanted)
    assert engine.release_held(rid)
    if wanted:
        assert decode.import_prefix(prompt, first, data, len(wanted)) == len(wanted)
    out_id = f"d{next(_ids)}"
    local = decode.add_request(out_id, prompt, GREEDY, cached_tokens=remote_cached)
    outs = run(decode, out_id)
    return outs, len(wanted), local.num_cached_tokens


def rand(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(8, 4000) for _ in range(n)]


@pytest.mark.parametrize("length", [BS * 5 + 7, BS * 6, 3, BS + 1])
def test_a_pulled_prefill_decodes_as_the_single_engine_does(single, prefill, length):
    rng = random.Random(length)
    prompt = rand(rng, length)
    decode = make_engine()
    rid, last = prefill_leg(prefill, prompt)
    outs, pulled, hit = decode_leg(decode, prefill, rid, prompt, last.num_cached_tokens)
    tokens = [t for o in outs for t in o.new_token_ids]
    assert tokens == single(prompt)
    usable = (length - 1) // BS
    assert pulled == usable and hit == usable * BS  # every pulled block is a hit there
    assert outs[-1].num_cached_tokens == last.num_cached_tokens == 0  # the prefill side's
    prefill[0].block_manager.check_integrity([])
    decode.block_manager.check_integrity([])
    assert prefill[0].block_manager.usage().used == 0  # released once pulled


def test_hits_on_either_side_pull_only_what_the_decode_rank_lacks(single, prefill):
    rng = random.Random(7)
    shared = rand(rng, BS * 4)
    decode = make_engine()
    first = shared + rand(rng, 20)
    rid, last = prefill_leg(prefill, first)
    outs, pulled, _ = decode_leg(decode, prefill, rid, first, last.num_cached_tokens)
    assert pulled == 5 and [t for o in outs for t in o.new_token_ids] == single(first)
    # the same prefix again: a hit on the prefill side, and the decode rank has its 4 blocks
    second = shared + rand(rng, 40)
    rid, last = prefill_leg(prefill, second)
    assert last.num_cached_tokens == BS * 4
    outs, pulled, hit = decode_leg(decode, prefill, rid, second, last.num_cached_tokens)
    assert pulled == 2 and hit == BS * 6  # 4 of its own and 2 pulled
    assert [t for o in outs for t in o.new_token_ids] == single(second)
    assert outs[-1].num_cached_tokens == BS * 4  # what the prefill side had
    decode.block_manager.check_integrity([])


def test_a_layout_that_differs_is_refused_at_the_handshake(prefill):
    prompt = rand(random.Random(3), BS * 3)
    rid, _ = prefill_leg(prefill, prompt)
    other = make_engine(block_size=32, num_kv_blocks=64)
    with pytest.raises(kv_transfer.TransferError, match="layouts differ") as info:
        kv_transfer.pull("127.0.0.1", prefill[1].port, rid, [0], [0], other.runner.kv_layout)
    assert info.value.status == 400
    # the hold stays for a proper pull; then a second pull finds nothing held
    seq = Sequence(prompt, GREEDY, block_size=BS)
    layout = prefill[0].runner.kv_layout
    kv_transfer.pull("127.0.0.1", prefill[1].port, rid, [0], [seq.digest(0)], layout)
    assert prefill[1].done.get(timeout=5).request_id == rid
    assert prefill[0].release_held(rid)
    with pytest.raises(kv_transfer.TransferError, match="no KV is held"):
        kv_transfer.pull("127.0.0.1", prefill[1].port, rid, [0], [seq.digest(0)], layout)


def test_blocks_of_another_prompt_are_refused(prefill):
    prompt = rand(random.Random(4), BS * 3)
    rid, _ = prefill_leg(prefill, prompt)
    other = Sequence(rand(random.Random(5), BS * 3), GREEDY, block_size=BS)
    layout = prefill[0].runner.kv_layout
    with pytest.raises(kv_transfer.TransferError, match="other blocks") as info:
        kv_transfer.pull("127.0.0.1", prefill[1].port, rid, [0, 1], [other.digest(0),
                         other.digest(1)], layout)  # fmt: skip
    assert info.value.status == 400
    assert prefill[1].done.get(timeout=5).request_id == rid  # served: released all the same
    assert prefill[0].release_held(rid)
    prefill[0].block_manager.check_integrity([])


def test_a_prefill_side_that_dies_mid_transfer_is_a_502_not_a_hang():
    listener = socket.create_server(("127.0.0.1", 0))

    def half_answer():
        conn, _ = listener.accept()
        kv_transfer.recv_frame(conn)
        kv_transfer.send_frame(conn, {"ok": True, "digests": [1], "bytes": 1000})
        conn.sendall(b"x" * 10)
        conn.close()

    threading.Thread(target=half_answer, daemon=True).start()
    with pytest.raises(kv_transfer.TransferError) as info:
        kv_transfer.pull("127.0.0.1", listener.getsockname()[1], "r", [0], [1], {})
    assert info.value.status == 502
    listener.close()


def test_a_hold_never_pulled_is_released_at_its_deadline(prefill):
    engine, server = prefill
    rid, _ = prefill_leg(prefill, rand(random.Random(6), BS * 2 + 1))
    assert engine.block_manager.usage().used == 2
    engine.held[rid].deadline = 0.0
    assert engine.expire_held(1.0, server.take) == [rid]
    assert engine.block_manager.usage().used == 0
    engine.block_manager.check_integrity([])


def test_a_pull_waits_for_a_prefill_still_running_and_a_failed_one_ends_it_at_once(prefill):
    """SGLang's protocol sends both legs at once: the pull may come first."""
    engine, server = prefill
    prompt = rand(random.Random(8), BS * 3 + 2)
    seq = Sequence(prompt, GREEDY, block_size=BS)
    layout = engine.runner.kv_layout
    got = {}

    def decode_side():
        got["pulled"] = kv_transfer.pull(
            "127.0.0.1", server.port, "room-1", [0, 1, 2],
            [seq.digest(i) for i in range(3)], layout, wait_s=10,
        )  # fmt: skip

    waiter = threading.Thread(target=decode_side)
    waiter.start()
    engine.add_request("late", prompt, PREFILL, hold_key="room-1")
    run(engine, "late")
    for key, held in engine.take_new_holds():
        server.offer(key, held.block_ids, held.digests, held.cached_tokens)
    waiter.join(10)
    assert len(got["pulled"][0]) == 3 * engine.runner.bytes_per_block
    assert server.done.get(timeout=5).request_id == "room-1"
    assert engine.release_held("room-1")

    started = time.monotonic()
    threading.Timer(0.3, server.fail, ("room-2", "the prefill was aborted")).start()
    with pytest.raises(kv_transfer.TransferError, match="aborted"):
        kv_transfer.pull("127.0.0.1", server.port, "room-2", [0], [0], layout, wait_s=10)
    assert time.monotonic() - started < 5


def test_simulated_engines_take_the_roles_and_the_transfer_takes_the_profiles_time():
    """--simulate: no KV exists, so a pull moves none; the hits are real (the decode rank caches
    the blocks) and the transfer's modeled time is the profile's KV bytes over its link."""
    from engine.sim.profiles import KV_LINK_CPU_TINY, get_profile

    sim = dict(simulate="cpu-tiny", simulate_speedup=1000.0, num_kv_blocks=128)
    prefill_engine, decode = make_engine(**sim), make_engine(**sim)
    server = kv_transfer.KVServer(
        "127.0.0.1", 0, prefill_engine.runner.kv_layout, prefill_engine.runner.export_blocks
    )
    try:
        prompt = rand(random.Random(9), BS * 4 + 3)
        rid, last = prefill_leg((prefill_engine, server), prompt)
        outs, pulled, hit = decode_leg(decode, (prefill_engine, server), rid, prompt, 0)
        assert pulled == 4 and hit == 4 * BS and outs[-1].finished
        profile = get_profile("cpu-tiny")
        expected = profile.transfer_seconds(4 * BS)
        assert decode.runner.transfer_s(4) == pytest.approx(expected / 1000.0)
        assert expected == pytest.approx(4 * BS * profile.kv_bytes_per_token / KV_LINK_CPU_TINY)
    finally:
        server.close()
