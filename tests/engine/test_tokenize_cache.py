"""The prefix token cache (engine/tokenize_cache.py): the ids of a text are always those of one
whole encode, shared prefixes are taken from the cache, and a tokenizer that does not split at
word starts turns it off instead of getting other ids."""

import gzip
import random

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, normalizers, trainers

from engine import tokenize_cache
from engine.tiny import CORPUS_PATH, ensure_tiny_bos_model, ensure_tiny_model
from engine.tokenize_cache import PrefixTokenCache
from engine.tokenizer import Tokenizer, load_tokenizer

JUNK = [" ", "  ", "\n", "\n\n", "\t", " 12", "3", "'s", "'", " é", "日本", "🙂", "x", "word",
        " a", "!!", ".", "<|im_start|>", "<|im_end|>", " ", "\r\n", "e\u0301"]  # fmt: skip


@pytest.fixture(scope="module")
def corpus() -> str:
    return gzip.open(CORPUS_PATH, "rt").read()


@pytest.fixture(scope="module")
def tiny() -> Tokenizer:
    return load_tokenizer(str(ensure_tiny_model()))


def _texts(corpus: str, rng: random.Random, count: int):
    for i in range(count):
        if i % 3 == 0:
            yield "".join(rng.choice(JUNK) for _ in range(rng.randrange(50, 6000)))
        else:
            start = rng.randrange(len(corpus) - 50_000)
            yield corpus[start : start + rng.randrange(100, 50_000)]


def test_ids_are_those_of_a_whole_encode(tiny, corpus):
    cache = PrefixTokenCache(tiny, stride=256)
    assert cache.enabled
    rng = random.Random(7)
    for text in _texts(corpus, rng, 120):
        assert cache.encode(text) == tiny.encode(text, add_special_tokens=False)
    assert cache.mismatches == 0 and cache.enabled


def test_a_growing_conversation_encodes_only_its_new_turn(tiny, corpus):
    cache = PrefixTokenCache(tiny, stride=512)
    history = corpus[:20_000]
    assert cache.encode(history) == tiny.encode(history, add_special_tokens=False)
    assert cache.cached_chars == 0
    for turn in range(4):
        reply = corpus[30_000 + turn * 900 :][:900]
        history += f"\nuser: turn {turn} asks again.\nassistant: {reply}"
        encoded_before = cache.encoded_chars
        assert cache.encode(history) == tiny.encode(history, add_special_tokens=False)
        new_chars = cache.encoded_chars - encoded_before
        assert new_chars < 2_000  # the new turn and the chunk it finishes, not the history
    assert cache.cached_chars > 70_000


def test_two_prompts_with_one_system_prompt_share_its_chunks(tiny, corpus):
    cache = PrefixTokenCache(tiny, stride=512)
    system = corpus[:10_000]
    a, b = system + " First question here?", system + " A different one, longer than that."
    cache.encode(a)
    assert cache.encode(b) == tiny.encode(b, add_special_tokens=False)
    assert cache.cached_chars >= 9_000


def test_the_cache_is_bounded_by_tokens(tiny, corpus):
    cache = PrefixTokenCache(tiny, stride=256, capacity_tokens=5_000)
    for i in range(10):
        text = corpus[i * 20_000 : i * 20_000 + 10_000]
        assert cache.encode(text) == tiny.encode(text, add_special_tokens=False)
        assert cache._tokens <= 5_000
    first = corpus[:10_000]  # the oldest text's chunks are gone: encoded again
    before = cache.encoded_chars
    cache.encode(first)
    assert cache.encoded_chars - before == len(first)


def _sentencepiece_like(corpus: str) -> Tokenizer:
    """Llama 2's tokenizer.json shape: a normalizer that prepends "▁" to every text it is given
    and no pre-tokenizer, so a text cut before " word" starts with "▁▁word" where the whole text
    had "▁word"."""
    backend = Backend(models.BPE(unk_token="<unk>"))
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    backend.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>"])
    backend.train_from_iterator([corpus[:50_000]], trainer=trainer)
    return Tokenizer(backend, {"unk_token": "<unk>"}, [])


def test_a_tokenizer_that_does_not_split_at_word_starts_turns_it_off(corpus):
    tokenizer = _sentencepiece_like(corpus)
    cache = PrefixTokenCache(tokenizer, stride=256)
    assert not cache.enabled  # the probe at construction saw other ids
    text = corpus[:5_000]
    assert cache.encode(text) == tokenizer.encode(text, add_special_tokens=False)
    assert cache.cached_chars == 0


def test_a_difference_the_probe_missed_turns_it_off_and_still_answers_right(tiny):
    # an added token with a space in it: a cut inside it splits what the whole encode keeps as one
    tiny_spaced = load_tokenizer(str(ensure_tiny_model()))
    tiny_spaced.backend.add_special_tokens(["<|tool call|>"])
    cache = PrefixTokenCache(tiny_spaced, stride=256)
    assert cache.enabled
    text = "a" * 300 + "<|tool call|>" + " more words" * 40
    assert cache.encode(text) == tiny_spaced.encode(text, add_special_tokens=False)
    assert cache.mismatches == 1 and not cache.enabled
    assert cache.encode(text) == tiny_spaced.encode(text, add_special_tokens=False)


def test_answers_are_checked_while_new_then_one_in_many(tiny, corpus, monkeypatch):
    cache = PrefixTokenCache(tiny, stride=256)
    checks = []
    full = cache._full
    monkeypatch.setattr(cache, "_full", lambda text: checks.append(len(text)) or full(text))
    for i in range(tokenize_cache.VERIFY_FIRST + tokenize_cache.VERIFY_EVERY):
        cache.encode(corpus[i * 100 : i * 100 + 2_000])
    assert len(checks) == tokenize_cache.VERIFY_FIRST + 1


def test_prompts_of_a_few_thousand_characters_sharing_a_prefix_encode_only_their_tail(tiny, corpus):
    """The router tokenizes every prompt to route it, on its event loop below
    ``OFF_LOOP_CHARS``: a system prompt or a few-shot prefix of ~3,500 characters under ~400
    characters of question is taken from the cache after its first request (encode_text, the
    router's call), its new tail encoded in one call."""
    cache = tokenize_cache.prefix_token_cache(tiny)
    prefix = corpus[100_000:103_500]
    questions = [corpus[200_000 + 1_000 * i :][:400] for i in range(4)]
    for i, question in enumerate(questions):
        text = f"{prefix} {question}"
        cached, encoded = cache.cached_chars, cache.encoded_chars
        assert tokenize_cache.encode_text(tiny, text) == tiny.encode(text, add_special_tokens=False)
        if i:  # the prefix's chunks are known: the tail and the chunk it finishes, no more
            assert cache.cached_chars - cached >= len(prefix) - tokenize_cache.STRIDE
            assert cache.encoded_chars - encoded < len(question) + tokenize_cache.STRIDE
    assert cache.mismatches == 0 and cache.enabled


def test_a_transformers_fast_tokenizer_gets_one_too(corpus):
    """The real engine's front encodes with transformers' tokenizer: its ``tokenizers`` backend
    is cut the same way, and the ids stay those of its own ``encode``."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(ensure_tiny_model()))
    cache = tokenize_cache.prefix_token_cache(tokenizer)
    assert cache is not None and cache.enabled
    history = corpus[:9_000]
    for turn in ("\nuser: and then?", "\nassistant: then this.\nuser: and after that?"):
        history += turn
        assert tokenize_cache.encode_text(tokenizer, history) == tokenizer.encode(
            history, add_special_tokens=False
        )
    assert cache.cached_chars >= 8_000 and cache.mismatches == 0


@pytest.mark.parametrize("limit", [64, 2_000, 32_768])
def test_a_limit_gives_the_same_ids_or_stops_once_the_text_is_too_long(tiny, corpus, limit):
    rng = random.Random(limit)
    for text in _texts(corpus, rng, 12):
        full = tiny.encode(text, add_special_tokens=False)
        if len(full) <= limit:
            assert tokenize_cache.encode_text(tiny, text, limit) == full
        else:
            with pytest.raises(tokenize_cache.TooManyTokens) as caught:
                tokenize_cache.encode_text(tiny, text, limit)
            # a true lower bound, past the limit
            assert limit < caught.value.at_least <= len(full)


def test_a_huge_text_costs_what_the_limit_costs_not_what_the_text_does(tiny):
    text = " ".join(f"w{k % 10} word{k % 7}" for k in range(1_500_000))  # ~18 MB
    limit = 32_768
    before = tokenize_cache.counters()["encoded"]
    with pytest.raises(tokenize_cache.TooManyTokens):
        tokenize_cache.encode_text(tiny, text, limit)
    encoded = tokenize_cache.counters()["encoded"] - before
    assert encoded <= 4 * limit * 2, (encoded, len(text))  # heads of limit chars, doubling
    # no word starts to cut at, and over limit x the longest token: refused unread
    blob = "x" * (limit * tokenize_cache.longest_token(tiny) + 1)
    before = tokenize_cache.counters()["encoded"]
    with pytest.raises(tokenize_cache.TooManyTokens):
        tokenize_cache.encode_text(tiny, blob, limit)
    assert tokenize_cache.counters()["encoded"] == before


def test_special_tokens_are_those_the_tokenizer_adds_around_a_text(tiny, corpus):
    """A Llama-like tokenizer (the tiny model's BOS variant) puts its BOS before a text encoded
    with special tokens: ``special=True`` gives those ids, short text or long (through the
    cache), and a limit counts the BOS; the tiny model's own tokenizer adds nothing."""
    bos = load_tokenizer(str(ensure_tiny_bos_model()))
    assert tokenize_cache.special_tokens_around(bos) == ([0], [])
    assert tokenize_cache.special_tokens_around(tiny) == ([], [])
    rng = random.Random(5)
    texts = list(_texts(corpus, rng, 6))
    for text in [*texts, "a", "<|im_start|>user\nhi"]:
        want = bos.encode(text, add_special_tokens=True)
        assert want[0] == 0
        assert tokenize_cache.encode_text(bos, text, special=True) == want
        assert tokenize_cache.encode_text(bos, text) == want[1:]
        assert tokenize_cache.encode_text(tiny, text, special=True) == want[1:]
        if text not in texts:
            continue
        assert tokenize_cache.encode_text(bos, text, len(want), special=True) == want
        with pytest.raises(tokenize_cache.TooManyTokens) as caught:
            tokenize_cache.encode_text(bos, text, len(want) - 1, special=True)
        assert len(want) - 1 < caught.value.at_least <= len(want)
