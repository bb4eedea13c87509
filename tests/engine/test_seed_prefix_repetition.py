"""The seed's own test: vLLM's prefix_repetition workload (5 prefixes of 512 tokens, 128-token
suffixes, 100 prompts, concurrency 1) against a dp 4 engine. Pinned with data_parallel_rank, every
request after the first of its prefix hits exactly the prefix's 32 blocks; the rank logs and
/metrics must show exactly that. Unpinned round robin must show fewer."""

import random
import re

import httpx
import pytest

from harness.procs import metrics, start_engine

pytestmark = pytest.mark.slow

DP, PREFIX_LEN, SUFFIX_LEN, NUM_PREFIXES, NUM_PROMPTS, BLOCK = 4, 512, 128, 5, 100, 16
OUTPUT_LEN = 4  # the seed uses 128; cached-token counts do not depend on it, test time does
INTERVAL = 20


def prefix_repetition(seed: int) -> list[tuple[int, list[int]]]:
    """(prefix index, token ids) per prompt: random prefixes, a fresh random suffix each,
    shuffled."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(8, 4096) for _ in range(PREFIX_LEN)] for _ in range(NUM_PREFIXES)]
    prompts = [
        (
            i % NUM_PREFIXES,
            prefixes[i % NUM_PREFIXES] + [rng.randrange(8, 4096) for _ in range(SUFFIX_LEN)],
        )
        for i in range(NUM_PROMPTS)
    ]
    rng.shuffle(prompts)
    return prompts


def expected_cached(assignment: list[tuple[int, int]]) -> dict[int, list[int]]:
    """Per rank, the cached tokens of each request in order, from the block rules: a prefix seen
    before on the same rank hits all its full blocks (512 / 16 = 32); the random suffix never
    hits."""
    seen, out = set(), {r: [] for r in range(DP)}
    for prefix, rank in assignment:
        out[rank].append((PREFIX_LEN // BLOCK) * BLOCK if (prefix, rank) in seen else 0)
        seen.add((prefix, rank))
    return out


def run(url: str, prompts, pin: bool) -> list[tuple[int, int]]:
    assignment = []
    with httpx.Client(timeout=120) as client:
        for prefix, ids in prompts:
            body = {"prompt": ids, "max_tokens": OUTPUT_LEN, "temperature": 0, "ignore_eos": True}
            if pin:
                body["data_parallel_rank"] = prefix % DP
            r = client.post(url + "/v1/completions", json=body)
            assert r.status_code == 200, r.text
            rank = int(r.headers["x-data-parallel-rank"])
            assert not pin or rank == prefix % DP
            assignment.append((prefix, rank))
            assert r.json()["usage"]["prompt_tokens"] == PREFIX_LEN + SUFFIX_LEN
    return assignment


def cache_stats_lines(log: str, rank: int) -> list[tuple[int, int, int]]:
    pattern = (
        rf"\[DP{rank}\].*\[Cache Stats {' ' * 8}\] Reqs: (\d+), "
        r"Cached/Total tokens: (\d+)/(\d+), Hit rate: "
    )
    return [tuple(map(int, m)) for m in re.findall(pattern, log)]


def test_pinned_prefixes_hit_exactly_and_round_robin_hits_less(tmp_path):
    with start_engine(
        tmp_path,
        "--dp-size",
        str(DP),
        "--num-kv-blocks",
        "1024",
        "--dp-load-balance",
        "round_robin",
        "--cache-stats-interval",
        str(INTERVAL),
    ) as engine:
        pinned = run(engine.url, prefix_repetition(seed=0), pin=True)
        expected = expected_cached(pinned)
        m = metrics(engine.url)
        log = engine.log()
        for rank in range(DP):
            n = len(expected[rank])
            assert m[("cached_tokens", rank)] == sum(expected[rank])
            assert m[("prompt_tokens", rank)] == n * (PREFIX_LEN + SUFFIX_LEN)
            lines = cache_stats_lines(log, rank)
            assert len(lines) == n // INTERVAL
            last = (n // INTERVAL) * INTERVAL
            assert lines[-1] == (last, sum(expected[rank][:last]), last * (PREFIX_LEN + SUFFIX_LEN))
        assert sum(sum(v) for v in expected.values()) == (NUM_PROMPTS - NUM_PREFIXES) * 512
        assert re.search(
            r"\[DP\d\].*Scheduled prefill batch: 1 reqs, 128 new tokens "
            r"\(cached: \[512\], new: \[128\]\)",
            log,
        )

        # Unpinned, round robin, with fresh prefixes: each prefix must warm several ranks.
        before = sum(m[("cached_tokens", r)] for r in range(DP))
        unpinned = run(engine.url, prefix_repetition(seed=1), pin=False)
        after = metrics(engine.url)
        rr_cached = sum(after[("cached_tokens", r)] for r in range(DP)) - before
        assert rr_cached == sum(sum(v) for v in expected_cached(unpinned).values())
        assert rr_cached < (NUM_PROMPTS - NUM_PREFIXES) * 512
        print(
            f"pinned cached {(NUM_PROMPTS - NUM_PREFIXES) * 512} tokens, "
            f"round robin {int(rr_cached)}"
        )
