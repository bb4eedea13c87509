"""The routing lab replays a trace through the real router onto simulated ranks in virtual time:
every request finishes, the numbers are the engines' own, and cache-aware routing gets the
oracle's hits where round robin cannot."""

from __future__ import annotations

import pytest

from bench.datasets import allowed_token_ids
from bench.runs import routing_lab
from bench.trace import build, read_trace
from engine.tiny import ensure_tiny_model
from engine.tokenizer import load_tokenizer
from tests.bench.test_trace import SHARED_TRACE

pytestmark = pytest.mark.django_db  # the router's config reads the settings only


@pytest.fixture(scope="module")
def samples():
    tok = load_tokenizer(str(ensure_tiny_model()))
    records = read_trace(SHARED_TRACE, 120)
    return build(records, allowed=allowed_token_ids(len(tok), tok), max_model_len=131072).samples


def test_cache_aware_gets_the_oracles_hits_and_round_robin_does_not(samples):
    runs = {
        policy: routing_lab.run(
            samples,
            policy=policy,
            dp_size=2,
            speedup=4.0,
            concurrency=None,
            num_kv_blocks=250_000,
            keep_flights=True,
        )  # fmt: skip
        for policy in ("cache_aware", "round_robin")
    }
    for s in runs.values():
        flights = s["flights"]
        assert len(flights) == len(samples) and all(f.done for f in flights)
        assert all(f.first_token >= f.arrival for f in flights)
        assert s["oracle_hit_rate"] > 0 and s["ttft_mean_s"] > 0
    aware, rr = runs["cache_aware"], runs["round_robin"]
    assert aware["of_oracle"] >= 0.95, aware
    assert rr["of_oracle"] < aware["of_oracle"] - 0.2, (rr, aware)
    assert sum(f.rank == 0 for f in aware["flights"]) not in (0, len(samples))  # both ranks used
