"""Benchmark workloads, all deterministic for a given seed.

* ``prefix_repetition`` -- vLLM's: ``num_prefixes`` random-token prefixes, each followed by
  ``num_prompts // num_prefixes`` fresh random suffixes, then shuffled.
* ``zipf_prefixes`` -- like ``prefix_repetition``, but each prompt's prefix is drawn from a
  zipf distribution over the prefixes: a few hot ones and a long tail.
* ``random`` -- vLLM's ``random`` with a zero range ratio: independent random prompts of a fixed
  length (no shared prefix), used to compare raw serving speed.
* ``multi_turn`` -- chat conversations sharing one system prompt; the runner sends turn k+1 of a
  conversation only after turn k returned, with the assistant's real replies in the history.
* ``mooncake_trace`` -- a production trace replayed (bench/trace.py): prompts built from the
  trace's prefix block ids, sent in trace order or on its timestamps.

Random token ids avoid special tokens: a special token in the middle of a prompt changes what the
model sees (and a text round trip would drop or re-split it).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

# Below this id the built-in tiny tokenizer keeps its special tokens; used when no tokenizer is
# known.
FIRST_PLAIN_ID = 8


@dataclass
class SampleRequest:
    """One independent request: ``prompt`` is token ids (a list, or an int32 array for traces) or
    a text."""

    prompt: list[int] | str | np.ndarray
    prompt_len: int
    output_len: int
    group: int = -1  # the prefix it shares (prefix_repetition), its trace record, -1 for none
    timestamp_ms: float | None = None  # arrival time in a trace


@dataclass
class Conversation:
    """A multi-turn chat: the user's turns are fixed, the assistant's come from the server."""

    conv_id: int
    system: str
    user_turns: list[str]
    output_len: int


def allowed_token_ids(vocab_size: int, tokenizer=None) -> list[int]:
    """Ids a random prompt may use: the tokenizer's non-special ids, else ``[8, vocab_size)``."""
    if tokenizer is None:
        if vocab_size <= FIRST_PLAIN_ID:
            raise ValueError(f"vocab_size {vocab_size} leaves no plain token ids")
        return list(range(FIRST_PLAIN_ID, vocab_size))
    special = set(tokenizer.all_special_ids)
    return [i for i in range(len(tokenizer)) if i not in special]


def word_token_ids(tokenizer) -> list[int]:
    """Ids that are each one whole space-led word (`` word``) and encode back to themselves: any
    sequence of them decodes to a text that encodes to exactly that sequence, since a word-level
    pre-tokenizer (the tiny model's byte-level BPE, GPT-2's, Llama 3's) splits it at each word.
    Token-id workloads built from them can be sent as text (a router that takes no token ids)
    with the same blocks and the same prefixes."""
    special = set(tokenizer.all_special_ids)
    out = []
    for i in range(len(tokenizer)):
        if i in special:
            continue
        text = tokenizer.decode([i])
        if len(text) > 1 and text[0] == " " and text[1:].isascii() and text[1:].isalpha():
            if tokenizer.encode(text, add_special_tokens=False) == [i]:
                out.append(i)
    return out


def random_ids(rng: random.Random, allowed: list[int], n: int) -> list[int]:
    return [allowed[rng.randrange(len(allowed))] for _ in range(n)]


def text_stable_ids(
    rng: random.Random, allowed: list[int], n: int, tokenizer, max_retry: int = 10
) -> list[int]:
    """``n`` random ids whose decoded text encodes back to exactly ``n`` ids (when it converges).

    Adjacent random tokens often merge or split on a decode/encode round trip, so (like vLLM)
    re-encode, then truncate or top up with fresh random ids, a few times.
    """
    ids = random_ids(rng, allowed, n)
    for _ in range(max_retry):
        ids = tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False)
        if len(ids) == n:
            break
        ids = ids[:n] if len(ids) > n else ids + random_ids(rng, allowed, n - len(ids))
    return ids


def _drawer(rng: random.Random, allowed: list[int], tokenizer, as_text: bool):
    """``draw(n)``: n fresh token ids, ids that survive a text round trip when ``as_text``."""
    if not as_text:
        return lambda n: random_ids(rng, allowed, n)
    if tokenizer is None:
        raise ValueError("text prompts need a tokenizer (--tokenizer PATH)")
    return lambda n: text_stable_ids(rng, allowed, n, tokenizer)


def prefix_repetition(
    *,
    num_prompts: int,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    output_len: int,
    seed: int,
    allowed: list[int],
    tokenizer=None,
    as_text: bool = False,
) -> list[SampleRequest]:
    """vLLM's prefix_repetition: ``num_prompts // num_prefixes`` prompts per prefix, shuffled.

    ``as_text`` decodes each prompt with ``tokenizer`` (needed by servers that take no id lists);
    its length is then the re-encoded length, which may differ by a token or so at the seam.
    """
    per_prefix = num_prompts // num_prefixes
    if per_prefix == 0:
        raise ValueError(
            f"--num-prompts ({num_prompts}) must be >= "
            f"--prefix-repetition-num-prefixes ({num_prefixes})"
        )
    rng = random.Random(seed)
    draw = _drawer(rng, allowed, tokenizer, as_text)
    samples = []
    for group in range(num_prefixes):
        prefix = draw(prefix_len)
        for _ in range(per_prefix):
            samples.append(
                _sample(prefix + draw(suffix_len), output_len, group, tokenizer, as_text)
            )
    rng.shuffle(samples)
    return samples


def zipf_prefixes(
    *,
    num_prompts: int,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    zipf_s: float,
    output_len: int,
    seed: int,
    allowed: list[int],
    tokenizer=None,
    as_text: bool = False,
) -> list[SampleRequest]:
    """Skewed prefix sharing: each prompt draws its prefix ``k`` (0-based) with probability
    proportional to ``1 / (k + 1) ** zipf_s``, then a fresh suffix. A few hot prefixes carry most
    of the traffic and a long tail carries the rest: a router that keeps every prefix on one rank
    piles the hot ones up, one that spreads them all loses the tail's hits."""
    rng = random.Random(seed)
    draw = _drawer(rng, allowed, tokenizer, as_text)
    prefixes = [draw(prefix_len) for _ in range(num_prefixes)]
    weights = [1.0 / (k + 1) ** zipf_s for k in range(num_prefixes)]
    groups = rng.choices(range(num_prefixes), weights=weights, k=num_prompts)
    return [
        _sample(prefixes[g] + draw(suffix_len), output_len, g, tokenizer, as_text) for g in groups
    ]


def random_prompts(
    *,
    num_prompts: int,
    input_len: int,
    output_len: int,
    seed: int,
    allowed: list[int],
    tokenizer=None,
    as_text: bool = False,
) -> list[SampleRequest]:
    """Independent random prompts of ``input_len`` tokens (no shared prefix)."""
    if as_text and tokenizer is None:
        raise ValueError("text prompts need a tokenizer (--tokenizer PATH)")
    rng = random.Random(seed)
    samples = []
    for _ in range(num_prompts):
        ids = (
            text_stable_ids(rng, allowed, input_len, tokenizer)
            if as_text
            else random_ids(rng, allowed, input_len)
        )
        samples.append(_sample(ids, output_len, -1, tokenizer, as_text))
    return samples


def _sample(ids: list[int], output_len: int, group: int, tokenizer, as_text: bool) -> SampleRequest:
    if not as_text:
        return SampleRequest(ids, len(ids), output_len, group)
    text = tokenizer.decode(ids)
    return SampleRequest(
        text, len(tokenizer.encode(text, add_special_tokens=False)), output_len, group
    )


# ----- multi-turn chat ---------------------------------------------------------------------------
# Plain English words: every tokenizer splits them into few tokens, and random picks of them make
# user turns that never share a prefix by accident.
WORDS = """
able about above across act add after again against age ago agree air all allow almost alone along
already also always among amount and animal answer any appear apply area arm around arrive art ask
at away back bad bag ball bank base be bear beat become bed before begin behind believe below best
better between big bird bit black blue board boat body book both box boy bring brother build busy
but buy call came can car care carry case cat catch cause cell center chair chance change check
child choose city class clean clear close cloud cold color come common cook corn cost count country
course cover cross cry cut dance dark day dead deal dear decide deep did differ direct do doctor dog
door down draw dream dress drink drive drop dry during each early earth east easy eat edge effect
egg eight end enough enter even evening event ever every exact example eye face fact fall family far
farm fast father fear feel few field fight fill final find fine finger fire first fish five floor
flower fly follow food foot for force forest form four free friend from front fruit full game garden
gas gather gentle girl give glass go gold good grass great green ground group grow guess half hand
happy hard hat have head hear heart heat heavy help here high hill hold home hope horse hot hour
house how huge hunt idea if inch insect iron island job join jump just keep key kind king know lady
lake land large last late laugh law lay lead learn leave left leg letter level lie life lift light
like line list listen little live long look lost loud love low machine main make man many map mark
market matter may mean measure meet melody metal middle might mile milk mind minute miss moment
money month moon more morning most mother mountain move much music must name nation near need never
new next night nine noise north note nothing notice now number object ocean off offer office often
oil old once one open order other out over page paint pair paper park part party pass path pay
people perhaps person pick picture piece place plain plan plant play please point poor port power
press pretty print probable problem pull push put quick quiet quite race rain raise reach read ready
real reason red remember rest rich ride right ring river road rock room root rope rose round row
rule run safe sail salt same sand save say school science sea season seat second see seed seem sell
send sense serve set seven shape share sharp ship shoe shop short shout show side sign silent silver
simple sing sister sit six size skin sky sleep slow small smell smile snow soft soil some song soon
sound south space speak special speed spell spend spring square stand star start state stay step
stick still stone stop store story straight strange stream street strong student study such sugar
summer sun supply sure surface swim table tail take talk tall teach team tell ten test than thank
the then there thick thin thing think third three through throw tie time tiny together tone tool top
touch toward town track trade train travel tree trip true try turn twenty two under unit until up
use usual valley value very view village visit voice wait walk wall want warm wash watch water wave
way wear weather week weight well west wheel while white whole why wide wife wild will win wind
window wing winter wire wish with woman wonder wood word work world write yard year yellow young
""".split()


def random_text(rng: random.Random, n_tokens: int, tokenizer=None) -> str:
    """Random words of about ``n_tokens`` tokens (exactly measured when a tokenizer is given)."""
    if tokenizer is None:
        # ~1.3 tokens a word
        return " ".join(rng.choice(WORDS) for _ in range(max(1, n_tokens * 3 // 4)))
    words = [rng.choice(WORDS) for _ in range(max(1, n_tokens))]  # every word is at least one token
    lo, hi = 1, len(words)
    while lo < hi:  # the most words whose text stays within n_tokens
        mid = (lo + hi + 1) // 2
        if len(tokenizer.encode(" ".join(words[:mid]), add_special_tokens=False)) <= n_tokens:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo])


def multi_turn(
    *,
    num_conversations: int,
    num_turns: int,
    system_len: int,
    user_len: int,
    output_len: int,
    seed: int,
    tokenizer=None,
) -> list[Conversation]:
    """Conversations sharing one system prompt, each with ``num_turns`` user turns of random
    words."""
    rng = random.Random(seed)
    system = "You are a helpful assistant. " + random_text(rng, system_len, tokenizer)
    return [
        Conversation(
            c, system, [random_text(rng, user_len, tokenizer) for _ in range(num_turns)], output_len
        )
        for c in range(num_conversations)
    ]
