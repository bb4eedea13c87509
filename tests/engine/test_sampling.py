"""Sampling parameters, the sampler, stop conditions and incremental detokenization, on the tiny
model (one engine for the module) and on hand-made logits."""

from __future__ import annotations

import math
import random

import pytest
import torch

from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.llm_engine import LLMEngine
from engine.sampler import _filter, sample
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

N = 32


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(model="tiny", block_size=16, num_kv_blocks=256, max_num_seqs=16))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(21)
    return [[rng.randrange(8, 4000) for _ in range(n)] for n in (9, 23, 40)]


def run(engine: LLMEngine, prompt, **params) -> dict:
    params.setdefault("max_tokens", N)
    return engine.generate([prompt], SamplingParams(**params))[0]


def stream(
    engine: LLMEngine, prompt, params: SamplingParams, request_id: str = "s"
) -> tuple[list[str], list[int], str]:
    """(text deltas, token ids, finish reason) of one request stepped alone."""
    engine.add_request(request_id, prompt, params)
    deltas, ids, reason = [], [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.new_text)
            ids += out.new_token_ids
            reason = out.finish_reason
    return deltas, ids, reason


# ----- SamplingParams ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"temperature": True},
        {"temperature": "1"},
        {"top_p": 0},
        {"top_p": 0.0},
        {"top_p": 1.01},
        {"top_p": -0.5},
        {"top_p": True},
        {"max_tokens": 0},
        {"max_tokens": -3},
        {"max_tokens": True},
        {"max_tokens": 2.0},
        {"top_k": -2},
        {"top_k": True},
        {"top_k": 1.5},
        {"seed": True},
        {"seed": "7"},
        {"seed": 1.0},
    ],
)
def test_sampling_params_rejects(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_sampling_params_accepts_openai_values():
    assert SamplingParams(temperature=0).greedy  # OpenAI clients send 0 for greedy
    assert SamplingParams(temperature=1, top_k=1).greedy
    assert not SamplingParams(temperature=0.7, top_k=-1).greedy
    assert SamplingParams(top_p=1).top_p == 1 and SamplingParams(top_p=1e-9).top_p == 1e-9
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=["", "a"]).stop == ["a"]
    assert SamplingParams(max_tokens=1, seed=0).seed == 0


# ----- the sampler on hand-made logits ------------------------------------------------------------


def test_filter_top_k_and_top_p():
    logits = torch.log(torch.tensor([0.1, 0.5, 0.05, 0.3, 0.05]))
    kept = lambda out: (out > -math.inf).nonzero().flatten().tolist()  # noqa: E731
    assert kept(_filter(logits, 2, 1.0)) == [1, 3]
    assert kept(_filter(logits, 0, 1.0)) == [0, 1, 2, 3, 4]
    assert kept(_filter(logits, -1, 1.0)) == [0, 1, 2, 3, 4]
    assert kept(_filter(logits, 0, 0.45)) == [1]  # the token that crosses top_p is kept
    assert kept(_filter(logits, 0, 0.6)) == [1, 3]
    assert kept(_filter(logits, 0, 0.85)) == [0, 1, 3]
    assert kept(_filter(logits, 0, 1e-9)) == [1]
    assert kept(_filter(logits, 2, 0.45)) == [1]


def test_sampler_draws_only_allowed_tokens():
    logits = torch.log(torch.tensor([[0.1, 0.5, 0.05, 0.3, 0.05]] * 2))
    seqs = [
        Sequence([1], SamplingParams(temperature=1.0, top_k=2, seed=3)),
        Sequence([1], SamplingParams(temperature=1.0, top_p=0.6, seed=4)),
    ]
    drawn = [sample(logits, seqs, torch.Generator().manual_seed(0)) for _ in range(300)]
    assert {d[0] for d in drawn} == {1, 3}
    assert {d[1] for d in drawn} == {1, 3}
    plain = Sequence([1], SamplingParams(temperature=1.0))
    assert {
        sample(logits[:1], [plain], torch.Generator().manual_seed(i))[0] for i in range(300)
    } == {0, 1, 2, 3, 4}


def test_seeded_request_ignores_its_batch():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    p = SamplingParams(temperature=1.0, seed=42)
    alone = [
        sample(logits[:1], [s], torch.Generator())[0] for s in [Sequence([1], p)] for _ in range(10)
    ]
    s = Sequence([1], p)
    others = [Sequence([1], SamplingParams(temperature=1.0)) for _ in range(2)]
    batched = [sample(logits, [s, *others], torch.Generator().manual_seed(i))[0] for i in range(10)]
    assert batched == alone


# ----- sampling on the model ----------------------------------------------------------------------


def test_greedy_variants_agree(engine, prompts):
    variants = [
        SamplingParams(max_tokens=N, ignore_eos=True, **kw)
        for kw in (
            {"temperature": 0},
            {"temperature": 1.0, "top_k": 1},
            {"temperature": 1.0, "top_p": 1e-6, "seed": 5},
            {"temperature": 0, "seed": 99},
            {"temperature": 0.5, "top_p": 1e-6},
        )
    ]
    outs = engine.generate([p for p in prompts for _ in variants], variants * len(prompts))
    for i, prompt in enumerate(prompts):
        ids = [o["token_ids"] for o in outs[i * len(variants) : (i + 1) * len(variants)]]
        assert len(ids[0]) == N
        assert ids == [ids[0]] * len(variants)
        assert (
            run(engine, prompt, temperature=0, ignore_eos=True)["token_ids"] == ids[0]
        )  # alone == batched


def test_same_seed_same_output_in_any_batch(engine, prompts):
    params = SamplingParams(max_tokens=N, temperature=1.0, seed=1234, ignore_eos=True)
    alone = engine.generate([prompts[1]], params)[0]["token_ids"]
    mixed = [
        SamplingParams(max_tokens=N, temperature=1.0, ignore_eos=True),
        params,
        SamplingParams(max_tokens=N, temperature=0.8, seed=7, ignore_eos=True),
    ]
    batched = engine.generate([prompts[0], prompts[1], prompts[2]], mixed)[1]["token_ids"]
    assert batched == alone
    other_seed = run(engine, prompts[1], temperature=1.0, seed=1235, ignore_eos=True)["token_ids"]
    assert other_seed != alone
    assert (
        run(engine, prompts[1], temperature=1.0, seed=1234, ignore_eos=True)["token_ids"] == alone
    )


def test_max_tokens_finishes_with_length(engine, prompts):
    for max_tokens in (1, 2, 17):
        out = run(engine, prompts[0], temperature=0, max_tokens=max_tokens, ignore_eos=True)
        assert (len(out["token_ids"]), out["finish_reason"]) == (max_tokens, "length")


def test_stop_token_ids(engine, prompts):
    full = run(engine, prompts[2], temperature=0, ignore_eos=True)["token_ids"]
    stop_id = full[6]
    cut = full.index(stop_id)  # its first occurrence
    out = run(engine, prompts[2], temperature=0, ignore_eos=True, stop_token_ids=[stop_id])
    assert out["token_ids"] == full[: cut + 1]
    assert out["finish_reason"] == "stop"


def test_eos_stops_unless_ignored(engine, prompts):
    full = run(engine, prompts[0], temperature=0, ignore_eos=True)["token_ids"]
    # make the engine treat the 5th greedy token as end-of-sequence
    eos = full[4]
    saved = engine.eos_token_ids
    engine.eos_token_ids = {eos}
    try:
        out = run(engine, prompts[0], temperature=0)
        assert (out["token_ids"], out["finish_reason"]) == (full[: full.index(eos) + 1], "stop")
        assert run(engine, prompts[0], temperature=0, ignore_eos=True)["token_ids"] == full
    finally:
        engine.eos_token_ids = saved


def token_boundaries(engine, ids: list[int]) -> list[int]:
    """Character offsets in the decoded text where each token's text ends."""
    return [
        len(engine.tokenizer.decode(ids[: i + 1], skip_special_tokens=True))
        for i in range(len(ids))
    ]


def test_stop_strings_are_cut_and_never_streamed(engine, prompts):
    params = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)
    _, ids, _ = stream(engine, prompts[1], params)
    full = engine.tokenizer.decode(ids, skip_special_tokens=True)
    ends = token_boundaries(engine, ids)
    # a stop string that straddles a token boundary, somewhere in the middle of the output
    b = next(
        e for e in ends[len(ends) // 2 :] if 3 <= e <= len(full) - 3 and full[e - 2 : e + 2].strip()
    )
    for stop in (
        [full[b - 2 : b + 2]],
        [full[b - 2 : b + 2], "\x00never"],
        [full[b : b + 3], full[b - 2 : b + 2]],
    ):
        expected = full[: min(full.find(s) for s in stop if s in full)]
        deltas, out_ids, reason = stream(
            engine,
            prompts[1],
            SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, stop=stop),
        )
        assert reason == "stop"
        assert "".join(deltas) == expected
        assert out_ids == ids[: len(out_ids)] and len(out_ids) < len(ids)
        # generation ends with the token that completes the first stop string
        completes = min(full.find(s) + len(s) for s in stop if s in full)
        assert len(out_ids) == next(k + 1 for k, end in enumerate(ends) if end >= completes)


def test_stop_string_absent_runs_to_length(engine, prompts):
    out = run(engine, prompts[1], temperature=0, ignore_eos=True, stop=["\x00\x01"])
    assert out["finish_reason"] == "length" and len(out["token_ids"]) == N


# ----- detokenization -----------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_streamed_text_equals_full_decode(engine, prompts, seed):
    params = SamplingParams(max_tokens=64, temperature=1.2, seed=seed, ignore_eos=True)
    deltas, ids, reason = stream(engine, prompts[seed - 1], params)
    assert reason == "length" and len(ids) == 64
    assert "".join(deltas) == engine.tokenizer.decode(ids, skip_special_tokens=True)


def test_detokenizer_holds_back_split_characters(engine):
    text = "héllo wörld ✓ 日本 naïve café — “quotes”"
    ids = engine.tokenizer.encode(text)
    assert any("\ufffd" in engine.tokenizer.decode([i]) for i in ids)  # some characters span tokens
    detok = IncrementalDetokenizer(engine.tokenizer, [])
    deltas = []
    for n in range(1, len(ids) + 1):
        assert not detok.add(ids[:n])
        deltas.append(detok.delta(finished=False))
    detok.flush(ids)
    deltas.append(detok.delta(finished=True))
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


def test_detokenizer_special_tokens_are_skipped(engine):
    eos = engine.tokenizer.eos_token_id
    ids = engine.tokenizer.encode("ab cd") + [eos] + engine.tokenizer.encode(" ef")
    detok = IncrementalDetokenizer(engine.tokenizer, [])
    deltas = []
    for n in range(1, len(ids) + 1):
        detok.add(ids[:n])
        deltas.append(detok.delta(finished=False))
    detok.flush(ids)
    deltas.append(detok.delta(finished=True))
    assert "".join(deltas) == "ab cd ef"


def test_detokenizer_stop_string_across_tokens(engine):
    text = "héllo wörld ✓ end"
    ids = engine.tokenizer.encode(text)
    detok = IncrementalDetokenizer(engine.tokenizer, ["wörld"])
    deltas, stopped_at = [], None
    for n in range(1, len(ids) + 1):
        if detok.add(ids[:n]):
            stopped_at = n
            break
        deltas.append(detok.delta(finished=False))
        assert "w" not in "".join(deltas)  # a possible stop-string start is held back
    deltas.append(detok.delta(finished=True))
    assert stopped_at is not None and "".join(deltas) == "héllo "
    assert engine.tokenizer.decode(ids[:stopped_at]).endswith("wörld")
