"""Greedy token ids from the engine equal transformers' ``generate(do_sample=False)``, token for
token, at every position: batched mixed lengths, prefix-cache hits, chunked prefill, preemption."""

import random

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.tiny import ensure_tiny_model

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def reference():
    """transformers' own model (default attention, its own KV cache) and a memo of its outputs."""
    model = AutoModelForCausalLM.from_pretrained(ensure_tiny_model(), dtype=torch.float32).eval()
    memo = {}

    def generate(prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
        key = (tuple(prompt), max_tokens)
        if key not in memo:
            with torch.inference_mode():
                out = model.generate(
                    torch.tensor([prompt]),
                    attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                    max_new_tokens=max_tokens,
                    do_sample=False,
                )
            memo[key] = out[0, len(prompt) :].tolist()
        return memo[key]

    return generate


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(8, 4000) for _ in range(length)]


def make_engine(**kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 512)
    return LLMEngine(EngineConfig(model="tiny", block_size=16, **kw))


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)


def _first_difference(got: list, expected: list) -> int:
    pairs = zip(got + [None], expected + [None], strict=False)
    return next(i for i, (a, b) in enumerate(pairs) if a != b)


def assert_same(engine_out, expected):
    assert engine_out["token_ids"] == expected, (
        f"first difference at position {_first_difference(engine_out['token_ids'], expected)}"
    )


def test_batch_of_mixed_lengths(reference):
    rng = random.Random(1)
    prompts = [random_prompt(rng, n) for n in (1, 5, 17, 64, 131, 300)]
    engine = make_engine()
    outs = engine.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs, strict=True):
        assert_same(out, reference(prompt))
    engine.block_manager.check_integrity([])


def test_prefix_cache_hits(reference):
    rng = random.Random(2)
    shared = random_prompt(rng, 160)  # 10 full blocks
    first = shared + random_prompt(rng, 7)
    engine = make_engine()
    assert_same(engine.generate([first], GREEDY)[0], reference(first))
    follow = [shared + random_prompt(rng, n) for n in (1, 20, 45)] + [
        shared[:100] + random_prompt(rng, 30)
    ]
    outs = engine.generate(follow, GREEDY)
    # 160 shared tokens = 10 blocks; the 100-token head gives 6 full blocks.
    assert [o["num_cached_tokens"] for o in outs] == [160, 160, 160, 96]
    for prompt, out in zip(follow, outs, strict=True):
        assert_same(out, reference(prompt))
    # the whole prompt cached: the last token is recomputed, so the last block cannot hit
    again = engine.generate([first[:160]], GREEDY)[0]
    assert again["num_cached_tokens"] == 144
    assert_same(again, reference(first[:160]))


def test_decodes_sharing_a_prefix_attend_to_it_as_a_group(reference):
    """Cascade attention: decodes whose tables start with the same blocks read them once, in one
    kernel call per group, merged with each row's own blocks by log-sum-exp; same tokens."""
    rng = random.Random(5)
    system, preamble = random_prompt(rng, 200), random_prompt(rng, 90)
    engine = make_engine()
    warm = [system + random_prompt(rng, 3), preamble + random_prompt(rng, 3)]
    engine.generate(warm, GREEDY)  # both prefixes cached
    prompts = [system + random_prompt(rng, n) for n in (1, 9, 33, 70)]
    prompts += [preamble + random_prompt(rng, n) for n in (5, 40)] + [random_prompt(rng, 120)]
    before = engine.runner.cascade_steps
    outs = engine.generate(prompts, GREEDY)
    assert engine.runner.cascade_steps - before >= MAX_TOKENS - 2  # nearly every decode step
    for prompt, out in zip(prompts, outs, strict=True):
        assert_same(out, reference(prompt))
    engine.block_manager.check_integrity([])


def test_cascade_groups_share_only_whole_leading_blocks():
    from engine.paged_context import CASCADE_MIN_BLOCKS, cascade_groups

    shared = list(range(100, 100 + CASCADE_MIN_BLOCKS + 2))
    tables = [shared + [1], shared + [2, 3], shared[:2] + [4] * 8, [7] * 9, shared[:-1]]
    lengths = [16 * len(t) for t in tables]
    lengths[4] = 16 * (len(shared) - 2) + 1  # its last block holds the token being decoded
    groups = cascade_groups(tables, lengths, 16)
    # rows 0, 1, 2, 4 start alike, but row 2 leaves after 2 blocks: the four share 2 (< min),
    # so no group; without row 2 ...
    assert groups == []
    del tables[2], lengths[2]
    groups = cascade_groups(tables, lengths, 16)
    # rows 0, 1, 3 (the old 4): row 3's last block is excluded, so they share len(shared) - 2
    assert groups == [([0, 1, 3], len(shared) - 2)]


def test_chunked_prefill(reference):
    rng = random.Random(3)
    prompts = [random_prompt(rng, n) for n in (300, 150, 77)]
    engine = make_engine(max_num_batched_tokens=48)
    outs = engine.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs, strict=True):
        assert_same(out, reference(prompt))


def test_preempted_and_resumed(reference):
    rng = random.Random(4)
    prompts = [random_prompt(rng, n) for n in (40, 40, 40, 40)]
    max_tokens = 60
    # each request ends at 100 tokens = 7 blocks; 4 x 7 = 28 > 20 blocks, so some must be preempted
    engine = make_engine(num_kv_blocks=20)
    outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0))
    assert engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs, strict=True):
        assert_same(out, reference(prompt, max_tokens))
    engine.block_manager.check_integrity([])


def test_past_the_old_2048_token_context(reference):
    """The tiny model has 32 k positions (v2): a 3,000-token prompt, prefilled in chunks and then
    continued from the prefix cache, decodes as transformers does."""
    rng = random.Random(11)
    engine = make_engine(num_kv_blocks=512, max_num_batched_tokens=512)
    assert engine.max_model_len == 32768
    long = random_prompt(rng, 3000)
    assert_same(engine.generate([long], GREEDY)[0], reference(long))
    longer = long + random_prompt(rng, 40)
    out = engine.generate([longer], GREEDY)[0]
    assert_same(out, reference(longer))
    assert out["num_cached_tokens"] >= 2992  # the first prompt's full blocks


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 1.6e-2)])
def test_cascade_merge_equals_attention_over_the_whole_context(dtype, tol):
    """The batched log-sum-exp merge of two groups' shared blocks (one group's block ids
    consecutive: a view of the pool; the other's not: gathered) and an ungrouped row, through
    ``attend``, equals plain SDPA over each row's whole table."""
    from types import SimpleNamespace

    from engine.model_runner import ModelRunner
    from engine.paged_attention import attend

    torch.manual_seed(0)
    bs, kv_heads, heads, head_dim = 4, 2, 4, 16
    shared_a, shared_b = [10, 11, 12, 13, 14], [20, 3, 22, 5]
    # (table, length with the token being decoded); rows of the two groups interleave
    rows = [
        (shared_a + [30], 5 * bs + 3),
        (shared_b + [33], 4 * bs + 2),
        (shared_a + [31, 32], 6 * bs + 3),
        (shared_b + [34, 35], 5 * bs + 1),
        ([40, 41, 42], 2 * bs + 2),
    ]
    kv = torch.randn(2, 1, kv_heads, 48, bs, head_dim).to(dtype)
    runner = SimpleNamespace(block_size=bs, device=torch.device("cpu"), dtype=dtype, kv=kv)
    runner.cascade_steps = 0
    items = [
        SimpleNamespace(seq=SimpleNamespace(block_table=t), start=n - 1, num_tokens=1)
        for t, n in rows
    ]
    paged = ModelRunner._context(runner, SimpleNamespace(items=items))
    assert [cg.members.tolist() for cg in paged.cascade] == [[0, 2], [1, 3]]
    assert paged.cascade[0].block_slice == slice(10, 15) and paged.cascade[1].block_slice is None
    assert paged.cascade_lse_bias is not None  # row 4 is in no group
    t = len(rows)
    q = torch.randn(t, heads, head_dim).to(dtype).transpose(0, 1)  # [H, T, D], strided
    key = torch.randn(kv_heads, t, head_dim).to(dtype)
    value = torch.randn(kv_heads, t, head_dim).to(dtype)
    scale = head_dim**-0.5
    with torch.inference_mode():
        out = attend(0, q, key, value, paged, scale)  # [T, H, D]
    for r, (table, length) in enumerate(rows):
        k = kv[0, 0][:, table].reshape(kv_heads, -1, head_dim)[None, :, :length].float()
        v = kv[1, 0][:, table].reshape(kv_heads, -1, head_dim)[None, :, :length].float()
        expect = F.scaled_dot_product_attention(
            q[None, :, r : r + 1].float(), k, v, scale=scale, enable_gqa=True
        )
        torch.testing.assert_close(out[r].float(), expect[0, :, 0], atol=tol, rtol=tol)
