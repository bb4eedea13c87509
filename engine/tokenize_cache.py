"""Token ids of long texts that share prefixes with recent ones, without encoding the shared part
again.

A chat turn carries the whole conversation before it, an agent's call its long system prompt and
tools, a trace's request the blocks of earlier ones: the router tokenizes each of them to find the
blocks a rank holds, and most of the text is text it has tokenized seconds before (a 100 k-
character prompt is 55-75 ms of one core). ``PrefixTokenCache`` cuts a text into chunks of about
``stride`` characters, always just before a word that follows a space (" word"); keeps each
chunk's ids under the chained hash of the text up to the chunk's end; and encodes only the chunks
after the longest prefix it knows, all in one batch call (the library encodes them in parallel,
without the GIL), or, a tail under ``GIL_FREE_CHARS``, with the single call that keeps the GIL (the
router's loop then never waits a switch interval to get it back). llm-d's prefix-cache scorer
keeps a tokenization prefix store in the same spirit.

Why it is exact: a byte-level BPE pre-tokenizer (GPT-2's and Llama 3's regexes: most Hugging Face
tokenizers) always starts a new piece at " word" after a non-space, and BPE never merges across
pieces, so encoding the chunks apart and joining them gives the ids of the whole text (so does a
Metaspace pre-tokenizer's). Other tokenizers need not split there (Llama 2's normalizer prepends a
"▁" to every text it is given, and no pre-tokenizer keeps BPE from merging across words): each
cache checks its tokenizer on a probe text when it is made, checks its first answers and then one
in ``VERIFY_EVERY`` against a full encode, and turns itself off, for good, at the first
difference. Texts under two chunks are encoded as they are.

``encode_text`` is the call the router and the engine's front make: one cache per tokenizer,
made on first use, for texts of ``2 * STRIDE`` characters or more.
"""

from __future__ import annotations

import logging
import re
import threading
from array import array
from collections import OrderedDict
from itertools import pairwise

import xxhash
from tokenizers import Tokenizer as Backend

from engine.tokenizer import GIL_FREE_CHARS, encode_batch_fast

logger = logging.getLogger(__name__)

# A cut: a space after a non-space character and before a letter.
_CUT = re.compile(r"(?<=\S) (?=[^\W\d_])")
STRIDE = 256  # characters per chunk (texts of two chunks or more go through the cache)
VERIFY_FIRST = 8  # multi-chunk answers checked against a full encode while a cache is new
VERIFY_EVERY = 256  # then one in this many
_PROBE = (
    "The quick brown fox, née Smith, didn't jump over 12 lazy dogs at 3:45pm.\n\n"
    "  Indented   text\twith tabs; unicode: 日本語 テキスト, émigré café, emoji 🙂 here.\n"
    "<|im_start|>user\nHello there <|im_end|> and 'quoted' words, x=1+2 [a] {b} (c) ok...\n"
) * 40


class PrefixTokenCache:
    """``encode(text)`` = ``tokenizer.encode(text, add_special_tokens=False)``, remembering the
    ids of recent texts' chunks (up to ``capacity_tokens`` in all, least recently used out).
    ``tokenizer``: this project's lean ``engine.tokenizer.Tokenizer`` or a transformers fast
    tokenizer (``backend_of``). Thread-safe: the router and the front encode in worker threads."""

    def __init__(self, tokenizer, stride: int = STRIDE, capacity_tokens: int = 2_000_000):
        self.tokenizer, self.backend = tokenizer, backend_of(tokenizer)
        self.stride, self.capacity_tokens = stride, capacity_tokens
        self._chunks: OrderedDict[int, array] = OrderedDict()  # chained hash -> the chunk's ids
        self._tokens = 0
        self._lock = threading.Lock()
        self._answers = 0  # multi-chunk encodes so far (for the verification schedule)
        self.cached_chars = self.encoded_chars = self.mismatches = 0
        self.enabled = self._encode_chunks(_PROBE, self._cuts(_PROBE, 64)) == self._full(_PROBE)
        if not self.enabled:
            logger.info(
                "tokenizer %s does not split at word starts: its long texts are encoded whole",
                getattr(tokenizer, "name_or_path", "?"),
            )

    # ----- the one public call --------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        cuts = self._cuts(text, self.stride) if self.enabled else []
        if len(cuts) < 3:  # one chunk: nothing to share
            self.encoded_chars += len(text)
            return self._full(text)
        spans = list(pairwise(cuts))
        keys, parent = [], 0
        for a, b in spans:
            parent = xxhash.xxh64_intdigest(text[a:b].encode("utf-8", "surrogatepass"), parent)
            keys.append(parent)
        known: list[array] = []
        with self._lock:
            for key in keys:
                ids = self._chunks.get(key)
                if ids is None:
                    break
                self._chunks.move_to_end(key)
                known.append(ids)
        held = len(known)
        rest = self._encode_batch([text[a:b] for a, b in spans[held:]])
        self.cached_chars += cuts[held]
        self.encoded_chars += len(text) - cuts[held]
        fresh = [array("I", ids) for ids in rest]
        with self._lock:
            for key, ids in zip(keys[held:], fresh, strict=True):
                if key not in self._chunks:
                    self._chunks[key] = ids
                    self._tokens += len(ids)
            while self._tokens > self.capacity_tokens and self._chunks:
                self._tokens -= len(self._chunks.popitem(last=False)[1])
            self._answers += 1
            check = self._answers <= VERIFY_FIRST or self._answers % VERIFY_EVERY == 0
        joined = array("I")  # joined in C, not int by int (this holds the GIL)
        for ids in known + fresh:
            joined.extend(ids)
        out = joined.tolist()
        if check and out != self._full(text):
            self._disable(text)
            return self._full(text)
        return out

    # ----- helpers --------------------------------------------------------------------------
    @staticmethod
    def _cuts(text: str, stride: int) -> list[int]:
        """0, each chunk's end, len(text): the first cut at or after every ``stride`` characters
        from the last one. A text's cuts before position p depend only on text[:p + 1], so two
        texts sharing a prefix share its chunks."""
        cuts, pos = [0], stride
        while pos < len(text):
            match = _CUT.search(text, pos)
            if match is None:
                break
            cuts.append(match.start())
            pos = match.start() + stride
        cuts.append(len(text))
        return cuts

    def _full(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _encode_batch(self, chunks: list[str]) -> list[list[int]]:
        """Each chunk's ids: a few short ones (a cached prefix's new tail) one by one, holding the
        GIL as the tokenizer's single call does for a short text (engine/tokenizer.py
        ``GIL_FREE_CHARS``); more in the batch call, which releases it and spreads them on the
        library's threads."""
        if sum(map(len, chunks)) < GIL_FREE_CHARS:
            encode = self.backend.encode
            return [encode(chunk, add_special_tokens=False).ids for chunk in chunks]
        return encode_batch_fast(self.backend, chunks, add_special_tokens=False)

    def _encode_chunks(self, text: str, cuts: list[int]) -> list[int]:
        chunks = [text[a:b] for a, b in pairwise(cuts)]
        return [i for ids in self._encode_batch(chunks) for i in ids]

    def _disable(self, text: str) -> None:
        with self._lock:
            self.mismatches += 1
            self.enabled = False
            self._chunks.clear()
            self._tokens = 0
        logger.warning(
            "tokenizer %s: chunked ids differed from the whole text's (%d characters): "
            "its prefix token cache is off",
            getattr(self.tokenizer, "name_or_path", "?"),
            len(text),
        )


_CACHES: dict = {}  # tokenizer -> its PrefixTokenCache (None: not a lean one)
_CACHES_LOCK = threading.Lock()


def backend_of(tokenizer) -> Backend | None:
    """The ``tokenizers.Tokenizer`` under ``tokenizer``: ours keeps it as ``backend``,
    transformers' fast tokenizers as ``_tokenizer``; None for any other kind."""
    for name in ("backend", "_tokenizer"):
        backend = getattr(tokenizer, name, None)
        if isinstance(backend, Backend):
            return backend
    return None


def prefix_token_cache(tokenizer) -> PrefixTokenCache | None:
    """The prefix token cache of ``tokenizer`` (one per tokenizer, made on first use); None for
    one without a ``tokenizers`` backend."""
    with _CACHES_LOCK:
        if tokenizer not in _CACHES:
            known = backend_of(tokenizer) is not None
            _CACHES[tokenizer] = PrefixTokenCache(tokenizer) if known else None
        return _CACHES[tokenizer]


class TooManyTokens(ValueError):
    """A text holds more than ``limit`` tokens: at least ``at_least`` (what encoding a head of it
    counted; the rest was never encoded)."""

    def __init__(self, at_least: int, limit: int):
        super().__init__(f"at least {at_least} tokens, over the limit of {limit}")
        self.at_least, self.limit = at_least, limit


def encode_text(tokenizer, text: str, limit: int | None = None, special: bool = False) -> list[int]:
    """``tokenizer.encode(text, add_special_tokens=special)``; a long text through the
    tokenizer's prefix token cache. With ``limit``: ``TooManyTokens`` as soon as the text is known
    to hold more than ``limit`` tokens, at a cost bounded by the limit, not by the text
    (``_bounded``). ``special``: what the tokenizer's post-processor adds around a text (a
    Llama's BOS), as vLLM, SGLang and our engine add it to a completion's text prompt."""
    if special:
        around = special_tokens_around(tokenizer)
        if around is None:  # a post-processor that does more than add tokens: encode it whole
            ids = tokenizer.encode(text, add_special_tokens=True)
            if limit is not None and len(ids) > limit:
                raise TooManyTokens(len(ids), limit)
            return ids
        head, tail = around
        if head or tail:
            extra = len(head) + len(tail)
            try:
                ids = encode_text(tokenizer, text, None if limit is None else limit - extra)
            except TooManyTokens as exc:
                raise TooManyTokens(max(exc.at_least + extra, limit + 1), limit) from None
            return [*head, *ids, *tail]
    # a character is at most 4 UTF-8 bytes and a token at least one: up to limit / 4 characters
    # cannot be too many
    if limit is not None and len(text) > limit // 4:
        return _bounded(tokenizer, text, limit)
    return _encode(tokenizer, text)


_AROUND: dict = {}  # tokenizer -> the ids its post-processor puts around a text (None: not that)


def special_tokens_around(tokenizer) -> tuple[list[int], list[int]] | None:
    """The ids the tokenizer's post-processor puts before and after a text it encodes with special
    tokens (``[bos]``, ``[]`` for a Llama; ``[]``, ``[]`` for most others), found once per
    tokenizer from two probes; None when its output is not the plain encoding with tokens
    around it."""
    if tokenizer in _AROUND:
        return _AROUND[tokenizer]
    around = None
    for probe in ("hello world", " Two probes, 2 lengths: the same tokens around each."):
        plain = tokenizer.encode(probe, add_special_tokens=False)
        full = tokenizer.encode(probe, add_special_tokens=True)
        at = next(
            (i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain),
            None,
        )
        found = None if at is None or not plain else (full[:at], full[at + len(plain) :])
        if found is None or (around is not None and found != around):
            around = None
            break
        around = found
    _AROUND[tokenizer] = around
    return around


def _encode(tokenizer, text: str) -> list[int]:
    cache = prefix_token_cache(tokenizer) if len(text) >= 2 * STRIDE else None
    if cache is not None:
        return cache.encode(text)
    return tokenizer.encode(text, add_special_tokens=False)


def _bounded(tokenizer, text: str, limit: int) -> list[int]:
    """Encode heads of ``text`` cut at a word start (where a byte-level BPE's pieces begin, so a
    head's ids are the whole text's first ids; without one nearby, where the head ends), of
    ``limit`` characters and doubling, until what a head holds plus the least the rest can hold
    (its characters / the longest token's, ``longest_token``) passes ``limit`` (then the whole
    text does) or the head is the text. A text longer than ``limit`` x the longest token is
    refused unread. The last head holds at most twice the characters of ``limit`` tokens, and
    the prefix token cache encodes only each head's new chunks: a 15 MB prompt in front of a
    32 k-token model costs what at most ~256 k characters cost, not 15 MB."""
    longest = longest_token(tokenizer)
    if len(text) > limit * longest:
        raise TooManyTokens(len(text) // longest, limit)
    chars = limit
    while chars < len(text):
        match = _CUT.search(text, chars, chars + 256)
        end = match.start() if match else chars
        count = len(_encode(tokenizer, text[:end])) + (len(text) - end) // longest
        if count > limit:
            raise TooManyTokens(count, limit)
        chars = 2 * end
    ids = _encode(tokenizer, text)
    if len(ids) > limit:
        raise TooManyTokens(len(ids), limit)
    return ids


_LONGEST: dict = {}  # tokenizer -> its longest token's length in characters


def longest_token(tokenizer) -> int:
    """The most characters of text one token of ``tokenizer`` can stand for: its longest
    vocabulary entry (a byte-level BPE entry has a character per byte, a SentencePiece one a
    character per character, and a byte-fallback entry, 6 characters for one byte, only makes
    this larger: a bound either way); 64 when the vocabulary cannot be read."""
    if tokenizer not in _LONGEST:
        backend = backend_of(tokenizer)
        vocab = backend.get_vocab() if backend is not None else {}
        _LONGEST[tokenizer] = max(map(len, vocab), default=64) or 64
    return _LONGEST[tokenizer]


def counters() -> dict[str, int]:
    """Over this process's caches: characters taken from them, characters encoded through them,
    and caches turned off by a chunked encode that differed from the whole text's."""
    with _CACHES_LOCK:
        caches = [c for c in _CACHES.values() if c is not None]
    return {
        "cached": sum(c.cached_chars for c in caches),
        "encoded": sum(c.encoded_chars for c in caches),
        "mismatches": sum(c.mismatches for c in caches),
    }
