"""The contract that makes routing work: for the same request, the router's block digests are the
engine's (same tokenizer, same chat template, same chained xxh64), so its index speaks the
engine's language. Without a tokenizer it falls back to chained digests of 64-character chunks."""

import pytest
import xxhash

from apps.routing.decision.request_shape import (
    CHUNK_CHARS,
    OFF_LOOP_CHARS,
    load_tokenizer,
    routing_text,
    shape_request,
    text_digests,
    tokenize_off_loop,
)
from engine.digests import chain_digests
from engine.server.openai_api import APIError, chat_prompt, completion_prompt
from engine.tiny import VOCAB_SIZE, ensure_tiny_bos_model, ensure_tiny_model
from engine.tokenizer import GIL_FREE_CHARS

BLOCK = 16


@pytest.fixture(scope="module")
def tiny_path() -> str:
    return str(ensure_tiny_model())


@pytest.fixture(scope="module")
def tokenizer(tiny_path):
    return load_tokenizer(tiny_path)


CHAT = {
    "messages": [
        {
            "role": "system",
            "content": "You are a careful assistant that answers questions about Python.",
        },
        {"role": "user", "content": "How does a for statement iterate over a sequence of items?"},
        {
            "role": "assistant",
            "content": "It asks the object for an iterator and calls next() until it stops.",
        },
        {"role": "user", "content": "And what happens when the loop body raises an exception?"},
    ]
}

CHAT_PARTS = {
    "messages": [
        {
            "role": "system",
            "content": [
                {"type": "text", "text": "You are a careful assistant "},
                {"type": "text", "text": "that answers questions about Python."},
            ],
        },
        {
            "role": "user",
            "content": [{"type": "text", "text": "How does a with statement close a file?"}],
        },
        {"role": "assistant", "content": None},
        {"role": "user", "content": "Explain the context manager protocol briefly."},
    ]
}

PROMPT = (
    "The import statement searches for the named module, then binds the results of that search "
    "to a name in the local scope. Packages are modules that contain other modules."
)


@pytest.mark.parametrize("body", [CHAT, CHAT_PARTS], ids=["strings", "text-parts"])
def test_chat_digests_are_the_engines(body, tiny_path, tokenizer):
    ids = chat_prompt(body, tokenizer)
    shape = shape_request(body, True, tiny_path, BLOCK)
    assert len(ids) >= 4 * BLOCK  # several full blocks, so the comparison means something
    assert shape.digests == chain_digests(ids, BLOCK)
    assert len(shape.digests) == len(ids) // BLOCK
    assert (shape.prompt_tokens, shape.block_tokens) == (len(ids), BLOCK)


def test_text_parts_digest_like_the_joined_string(tiny_path):
    joined = {
        "messages": [
            {"role": "user", "content": "How does a with statement close a file? Tell me."}
        ]
    }
    parts = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "How does a with statement "},
                    {"type": "text", "text": "close a file? Tell me."},
                ],
            }
        ]
    }
    assert (
        shape_request(parts, True, tiny_path, 4).digests
        == shape_request(joined, True, tiny_path, 4).digests
    )


def test_chat_template_is_applied(tiny_path, tokenizer):
    shape = shape_request(CHAT, True, tiny_path, BLOCK)
    raw = "".join(m["content"] for m in CHAT["messages"])
    raw_ids = tokenizer.encode(raw, add_special_tokens=False)
    assert shape.digests[0] != chain_digests(raw_ids, BLOCK)[0]
    assert not set(shape.digests) & set(chain_digests(raw_ids, BLOCK))
    # the generation prompt is part of what the engine prefills
    assert shape.prompt_tokens > len(raw_ids)


def test_completion_string_digests_are_the_engines(tiny_path, tokenizer):
    body = {"prompt": PROMPT}
    ids = completion_prompt(body, tokenizer, vocab_size=VOCAB_SIZE)
    shape = shape_request(body, False, tiny_path, BLOCK)
    assert len(ids) >= 2 * BLOCK
    assert shape.digests == chain_digests(ids, BLOCK)
    assert shape.prompt_tokens == len(ids)
    # a batch of one is the same prompt
    assert shape_request({"prompt": [PROMPT]}, False, tiny_path, BLOCK).digests == shape.digests


def test_completion_token_ids_digests_are_the_engines(tiny_path, tokenizer):
    ids_in = [(7 * i + 3) % VOCAB_SIZE for i in range(50)]
    body = {"prompt": ids_in}
    ids = completion_prompt(body, tokenizer, vocab_size=VOCAB_SIZE)
    shape = shape_request(body, False, tiny_path, BLOCK)
    assert ids == ids_in
    assert len(shape.digests) == 3  # 50 // 16; the partial block has none
    assert shape.digests == chain_digests(ids, BLOCK)
    assert shape.prompt_tokens == 50
    assert shape_request({"prompt": [ids_in]}, False, tiny_path, BLOCK).digests == shape.digests


@pytest.mark.parametrize(
    "chat, flag, bos",
    [(False, None, True), (False, False, False), (False, "yes", None), (True, None, False),
     (True, True, True)],
)  # fmt: skip
def test_a_bos_goes_where_the_engine_puts_one(chat, flag, bos):
    """A tokenizer that adds a BOS (the tiny model's Llama-like variant): the engine puts it
    before a completion's text and not before a chat's templated text, as vLLM does, unless the
    body's ``add_special_tokens`` says otherwise (our engine answers a malformed flag 400; the
    router then routes as the default); the router digests the same ids."""
    path = str(ensure_tiny_bos_model())
    tokenizer = load_tokenizer(path)
    body = {**(CHAT if chat else {"prompt": PROMPT})}
    if flag is not None:
        body["add_special_tokens"] = flag
    shape = shape_request(body, chat, path, BLOCK)
    if bos is None:
        with pytest.raises(APIError) as caught:
            completion_prompt(body, tokenizer, vocab_size=VOCAB_SIZE)
        assert caught.value.status == 400 and caught.value.param == "add_special_tokens"
        bos = True  # routed as the default
        ids = completion_prompt({"prompt": PROMPT}, tokenizer, vocab_size=VOCAB_SIZE)
    elif chat:
        ids = chat_prompt(body, tokenizer)
    else:
        ids = completion_prompt(body, tokenizer, vocab_size=VOCAB_SIZE)
    assert (ids[0] == 0) == bos and ids[bos:] == (
        chat_prompt(CHAT, tokenizer) if chat else tokenizer.encode(PROMPT, add_special_tokens=False)
    )
    assert shape.ids == ids and shape.digests == chain_digests(ids, BLOCK)


def test_block_size_is_the_workers(tiny_path, tokenizer):
    ids = completion_prompt({"prompt": PROMPT}, tokenizer, vocab_size=VOCAB_SIZE)
    shape = shape_request({"prompt": PROMPT}, False, tiny_path, 4)
    assert shape.digests == chain_digests(ids, 4)
    assert len(shape.digests) == len(ids) // 4
    assert shape.block_tokens == 4


def test_fallback_without_tokenizer_digests_64_character_chunks():
    text = "".join(chr(ord("a") + i % 26) for i in range(3 * CHUNK_CHARS + 10))
    shape = shape_request({"prompt": text}, False, None, None)
    first = xxhash.xxh64_intdigest(text[:64].encode())  # seed 0
    second = xxhash.xxh64_intdigest(text[64:128].encode(), first)  # the parent is the seed
    assert CHUNK_CHARS == 64
    assert len(shape.digests) == 3  # the trailing 10 characters have no digest
    assert shape.digests[:2] == [first, second]
    assert shape.digests == text_digests(text)
    assert (shape.prompt_tokens, shape.block_tokens) == (len(text) // 4, 16)


def test_fallback_digests_are_chained():
    text = "x" * (4 * CHUNK_CHARS)
    changed = "y" + text[1:]
    base, other = text_digests(text), text_digests(changed)
    assert len(base) == len(other) == 4
    # changing chunk 0 changes every later digest
    assert all(a != b for a, b in zip(base, other, strict=True))
    same_head = text_digests(text[: 2 * CHUNK_CHARS] + "z" * (2 * CHUNK_CHARS))
    assert same_head[:2] == base[:2] and same_head[2] != base[2]


def test_fallback_short_text_has_no_digest():
    assert text_digests("a" * (CHUNK_CHARS - 1)) == []
    assert len(text_digests("a" * CHUNK_CHARS)) == 1
    shape = shape_request({"prompt": "hi"}, False, None, None)
    assert (shape.digests, shape.prompt_tokens) == ([], 1)


def test_fallback_for_chat_uses_roles_and_text():
    body = {
        "messages": [
            {"role": "user", "content": "a" * 70},
            {"role": "assistant", "content": [{"type": "text", "text": "b"}]},
        ]
    }
    text = routing_text(body, True)
    assert text == "user:" + "a" * 70 + "\nassistant:b\n"
    assert shape_request(body, True, None, None).digests == text_digests(text)


def test_a_body_the_tokenizer_path_cannot_parse_falls_back(tiny_path):
    body = {"prompt": {"not": "a prompt"}}
    shape = shape_request(body, False, tiny_path, BLOCK)
    assert shape.block_tokens == CHUNK_CHARS // 4
    assert shape.digests == text_digests(str(body["prompt"]))


LONG = (PROMPT + " ") * (OFF_LOOP_CHARS // len(PROMPT) + 2)


async def test_a_long_prompt_tokenized_off_the_loop_digests_like_the_engine(tiny_path, tokenizer):
    """A long text prompt is tokenized in a worker thread, through the tokenizer's batch call
    (which releases the GIL); the ids, hence the digests, are the engine's, for a completion and
    a chat request; a short one is left to ``shape_request`` inline."""
    assert len(LONG) >= max(OFF_LOOP_CHARS, GIL_FREE_CHARS)
    body = {"prompt": LONG}
    engine_ids = completion_prompt(body, tokenizer, vocab_size=VOCAB_SIZE)
    known = await tokenize_off_loop(body, False, [tiny_path])
    assert known == {tiny_path: engine_ids}
    assert tokenizer.backend.encode(LONG, add_special_tokens=False).ids == engine_ids
    shape = shape_request(body, False, tiny_path, BLOCK, known)
    assert shape.digests == chain_digests(engine_ids, BLOCK)
    assert shape.digests == shape_request(body, False, tiny_path, BLOCK).digests
    chat = {"messages": [{"role": "user", "content": LONG}]}
    known = await tokenize_off_loop(chat, True, [tiny_path])
    assert known == {tiny_path: chat_prompt(chat, tokenizer)}
    assert await tokenize_off_loop({"prompt": PROMPT}, False, [tiny_path]) == {}
    assert await tokenize_off_loop({"prompt": list(range(9000))}, False, [tiny_path]) == {}


def test_known_ids_are_used_as_given(tiny_path):
    """What ``tokenize_off_loop`` computed is what the shape digests (not tokenized again)."""
    ids = list(range(100, 164))
    shape = shape_request({"prompt": "anything"}, False, tiny_path, BLOCK, {tiny_path: ids})
    assert shape.digests == chain_digests(ids, BLOCK) and shape.prompt_tokens == 64


@pytest.mark.parametrize("seed", range(3))
def test_the_native_cores_digests_are_the_pure_ones(seed):
    """The router digests prompts in its native core (apps/routing/decision/csrc/prefix_core.c)
    where it built: the same chained xxh64 as the engine's Python, byte for byte (chunk and block
    edges, seeds and parents of all 64 bits, ids of the whole int32 range)."""
    import random

    from apps.routing.decision import request_shape
    from apps.routing.decision.index import core_module

    core = core_module()
    if core is None:
        pytest.fail("the native core did not build (tests/routing/test_index.py says why)")
    rng = random.Random(seed)
    for _ in range(400):
        data = rng.randbytes(rng.randrange(0, 300))
        start, chunk = rng.choice((0, rng.getrandbits(64))), rng.choice((1, 7, 8, 32, 33, 64))
        want, digest = [], start
        for at in range(0, len(data) - chunk + 1, chunk):
            digest = xxhash.xxh64_intdigest(data[at : at + chunk], digest)
            want.append(digest)
        assert core.text_digests(data, start, chunk) == want
        ids = [rng.randrange(-(2**31), 2**31) for _ in range(rng.randrange(0, 80))]
        block, parent = rng.choice((1, 3, 16)), rng.choice((None, rng.getrandbits(64)))
        assert request_shape.chain_digests(ids, block, parent) == chain_digests(ids, block, parent)
    text = "na\u00efve " * 50
    native = request_shape.text_digests(text, 5)
    assert native == core.text_digests(text.encode(), 5, CHUNK_CHARS)
    ids = list(range(100))
    native_ids = request_shape.chain_digests(ids, 16, 7)
    request_shape._CORE = None  # the pure fallback, where the core does not build: the same
    try:
        assert request_shape.text_digests(text, 5) == native
        assert request_shape.chain_digests(ids, 16, 7) == native_ids
    finally:
        request_shape._CORE = core
    with pytest.raises(OverflowError):
        core.chain_digests([2**31], 1, None)
