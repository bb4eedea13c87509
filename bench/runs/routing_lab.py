"""The routing lab: a trace replayed through the real ``Router`` onto simulated ranks, in virtual
time, in one process. Minutes of a fleet's traffic take seconds, so routing policies can be
compared and tuned; the numbers that count are measured over HTTP afterwards
(``bench.runs.routers_on_our_engine --simulate``: real processes, real time).

Each rank is the simulated engine's own ``LLMEngine`` (its scheduler, block manager, prefix cache
and step-time model: engine/sim/), stepped by a discrete-event loop instead of sleeping: a step
that starts at ``t`` delivers its tokens at ``t`` + its modeled time. The router is the one
``runrouter`` serves with (policy, index, load, the ``Dispatch`` ends), its clocks the virtual
one; first tokens and ends reach it when the engine produces them (the HTTP hop is not modeled).

    .venv/bin/python -m bench.runs.routing_lab \\
        --trace-path bench/traces/mooncake_synthetic_trace.jsonl --num-prompts 1500 \\
        --dp-size 4 --speedup 1 --num-kv-blocks 250000 --policy cache_aware sglang round_robin

``sglang`` is a model of SGLang's router's cache-aware rule (its defaults: balance when the
busiest rank has > 64 more and > 1.5x the requests of the idlest, else the best prefix match
when it covers > 30 % of the prompt, else the rank whose cache holds least), for orientation; the
real one is compared over HTTP.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from bench.oracle import floor_ttft, oracle_cached

DEFAULT_PROFILE = "h100-llama3.1-8b"


@dataclass
class Flight:
    """One request in the lab: when it arrived, its dispatch, what it got."""

    arrival: float
    prompt: list[int]
    output_len: int
    dispatch: object = None
    rank: int = -1
    first_token: float | None = None
    cached: int = 0
    done: bool = False
    end: float | None = None


@dataclass
class RankSim:
    engine: object
    busy: bool = False
    flights: dict[str, Flight] = field(default_factory=dict)


class VirtualClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_ranks(dp_size: int, profile: str, block_size: int, num_kv_blocks: int | None,
               long_threshold: int | None = None):  # fmt: skip
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sim.profiles import get_profile

    prof = get_profile(profile)
    ranks = []
    for _ in range(dp_size):
        config = EngineConfig(
            model="tiny",
            simulate=profile,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            max_num_seqs=prof.max_num_seqs,
            max_num_batched_tokens=prof.max_num_batched_tokens,
            max_model_len=prof.max_model_len,
            long_prefill_token_threshold=(
                prof.long_prefill_token_threshold if long_threshold is None else long_threshold
            ),
        )
        engine = LLMEngine(config)
        engine.runner.end_step = lambda started: None  # virtual time: no sleeping
        ranks.append(RankSim(engine))
    return ranks


def make_router(policy: str, dp_size: int, block_size: int, capacity: int, clock):
    """The real router, its fleet one simulated worker of ``dp_size`` ranks."""
    from apps.replicas.models import Worker
    from apps.routing.decision.config import RouterConfig
    from apps.routing.decision.demand import PrefixDemand, ServedVolume
    from apps.routing.decision.load import RankLoad
    from apps.routing.decision.policies import POLICIES
    from apps.routing.decision.router import Router
    from apps.routing.live import LiveFleet
    from engine.digests import SCHEME
    from engine.tiny import ensure_tiny_model

    unchecked = policy.endswith(UNCHECKED)  # cache_aware with its choices not time-checked
    policy = policy.removesuffix(UNCHECKED)
    router = Router(
        RouterConfig(
            dp_aware=True,
            policy=policy if policy in POLICIES else "cache_aware",
            time_check=not unchecked,
        )
    )
    if policy in LAB_POLICIES:
        router.policy = LAB_POLICIES[policy]()
    router.index.clock = clock
    router.clock = clock  # dispatches time their first tokens on it: the time model learns it
    router.demand = PrefixDemand(clock=clock)  # the prefixes' shares on the virtual clock
    router.volume = ServedVolume(clock=clock)  # the ranks' shares of the work, likewise
    info = {"dp_size": dp_size, "model_id": "tiny", "model_path": str(ensure_tiny_model()),
            "block_size": block_size, "prefix_digest": SCHEME,
            "num_kv_blocks_per_rank": capacity}  # fmt: skip
    worker = Worker(id=1, url="http://lab", dp_size=dp_size, model_id="tiny", server_info=info)
    LiveFleet(router).worker_saved(worker, {})
    for target in router.fleet.all_targets():  # fresh loads on the virtual clock
        target.load = RankLoad(clock=clock)
    return router


class Replay:
    """One replay's moving parts: the ranks, the router, the virtual clock and the event heap
    (time, order, kind, payload), in time order. ``order`` breaks ties and names requests, so a
    replay is deterministic."""

    def __init__(self, ranks: list[RankSim] | dict, router, clock: VirtualClock, concurrency,
                 waiting):  # fmt: skip
        self.ranks, self.router, self.clock = ranks, router, clock
        self.concurrency = concurrency
        self.waiting = waiting  # closed loop: the next to send is last
        self.events: list = []
        self.order = itertools.count()
        self.in_flight = 0

    def push(self, at: float, kind: str, payload) -> None:
        heapq.heappush(self.events, (at, next(self.order), kind, payload))

    def send(self, flight: Flight) -> None:
        """Route ``flight`` now and hand it to its rank (which starts a step if idle)."""
        from engine.sampling_params import SamplingParams

        self.in_flight += 1
        flight.arrival = self.clock.now
        flight.dispatch = self.router.route({"prompt": flight.prompt}, False, None)
        flight.rank = flight.dispatch.target.rank
        rank = self.ranks[flight.rank]
        rid = f"r{next(self.order)}"
        rank.engine.add_request(
            rid, flight.prompt, SamplingParams(max_tokens=flight.output_len, ignore_eos=True)
        )
        rank.flights[rid] = flight
        if not rank.busy:
            self.start_step(flight.rank)

    def start_step(self, r) -> None:
        """Run rank ``r``'s next step now (``r``: its index in ``ranks``, or its key where
        ``ranks`` is a dict: the PD lab's); its outputs arrive after its modeled time."""
        rank = self.ranks[r]
        runner = rank.engine.runner
        before = runner.modeled_s
        outputs = rank.engine.step()
        rank.busy = True
        self.push(self.clock.now + runner.modeled_s - before, "step", (r, outputs))

    def step_done(self, r: int, outputs) -> None:
        """Deliver a step's outputs: first tokens and ends reach the router as they would."""
        rank = self.ranks[r]
        for out in outputs:
            flight = rank.flights[out.request_id]
            if flight.first_token is None and out.num_output_tokens:
                flight.first_token = self.clock.now
                flight.dispatch.first_token()
            if out.finished:
                flight.cached, flight.done, flight.end = out.num_cached_tokens, True, self.clock.now
                usage = {"prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}
                flight.dispatch.finish(ok=True, usage=usage)
                del rank.flights[out.request_id]
                self.in_flight -= 1
                if self.concurrency and self.waiting:
                    self.send(self.waiting.pop())
        rank.busy = False
        if rank.engine.has_unfinished_requests():
            self.start_step(r)

    def drive(self) -> None:
        """Handle events in time order until none is left."""
        while self.events:
            self.clock.now, _, kind, payload = heapq.heappop(self.events)
            if kind == "arrive":
                self.send(payload)
            else:
                self.step_done(*payload)


def make_flights(samples, speedup: float | None) -> list[Flight]:
    """A flight per sample, arriving on its timestamp over ``speedup`` (all at 0 without)."""
    t0 = samples[0].timestamp_ms or 0.0
    return [
        Flight(
            ((s.timestamp_ms or 0.0) - t0) / 1000.0 / speedup if speedup else 0.0,
            [int(t) for t in s.prompt],
            s.output_len,
        )
        for s in samples
    ]


def run(samples, *, policy: str, dp_size: int, speedup: float | None, concurrency: int | None,
        profile: str = DEFAULT_PROFILE, block_size: int = 16,
        num_kv_blocks: int | None = None, keep_flights: bool = False,
        long_threshold: int | None = None) -> dict:  # fmt: skip
    """Replay ``samples`` (bench.datasets.SampleRequest with token-id prompts and, for
    ``speedup``, timestamps) and return the summary."""
    clock = VirtualClock()
    ranks = make_ranks(dp_size, profile, block_size, num_kv_blocks, long_threshold)
    capacity = ranks[0].engine.block_manager.num_blocks
    router = make_router(policy, dp_size, block_size, capacity, clock)
    flights = make_flights(samples, speedup)
    replay = Replay(ranks, router, clock, concurrency, waiting=list(reversed(flights)))
    if concurrency and not speedup:
        for _ in range(min(concurrency, len(replay.waiting))):
            replay.send(replay.waiting.pop())
    else:
        for flight in flights:
            replay.push(flight.arrival, "arrive", flight)
    replay.drive()
    summary = summarize(flights, ranks, block_size, clock.now)
    if keep_flights:  # each request's arrival, rank, dispatch (what was predicted) and cached
        summary["flights"] = flights
    return summary


def summarize(flights: list[Flight], ranks: list[RankSim], block_size: int, end: float) -> dict:
    prompt = sum(len(f.prompt) for f in flights)
    cached = sum(f.cached for f in flights)
    ordered = sorted(flights, key=lambda f: f.arrival)
    oracle = sum(oracle_cached([f.prompt for f in ordered], block_size))
    per_rank = [0] * len(ranks)
    for f in flights:
        per_rank[f.rank] += len(f.prompt)
    ttft = sorted(f.first_token - f.arrival for f in flights)
    q = statistics.quantiles(ttft, n=100)
    return {
        "requests": len(flights),
        "hit_rate": cached / prompt,
        "oracle_hit_rate": oracle / prompt,
        "of_oracle": cached / oracle if oracle else None,
        "max_mean": max(per_rank) / (sum(per_rank) / len(per_rank)),
        "ttft_mean_s": statistics.fmean(ttft),
        "ttft_p50_s": q[49],
        "ttft_p90_s": q[89],
        "ttft_p99_s": q[98],
        "duration_s": end,
    }


# ----- a model of SGLang's cache-aware rule, for orientation ------------------------------------
class SGLangLike:
    name = "sglang"

    def __init__(self, cache_threshold=0.3, balance_abs=64, balance_rel=1.5):
        self.cache_threshold, self.balance_abs, self.balance_rel = (
            cache_threshold, balance_abs, balance_rel)  # fmt: skip

    def choose(self, targets, shape, matched, shared_blocks=0):
        loads = [t.load.inflight for t in targets]
        if max(loads) - min(loads) > self.balance_abs and max(loads) > self.balance_rel * min(
            loads
        ):
            return min(targets, key=lambda t: t.load.inflight)
        best = max(targets, key=lambda t: matched.get(t.key, 0))
        blocks = max(1, len(shape.digests))
        if matched.get(best.key, 0) / blocks > self.cache_threshold:
            return best
        return min(targets, key=lambda t: t.load.dispatched)  # "smallest tree": least sent


LAB_POLICIES = {"sglang": SGLangLike}
UNCHECKED = "-no-time-check"  # a policy name's suffix: the router's time check off


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bench.runs.routing_lab", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--trace-path", required=True)
    parser.add_argument("--num-prompts", type=int, default=1500)
    parser.add_argument("--trace-block-tokens", type=int, default=512)
    parser.add_argument("--dp-size", type=int, nargs="+", default=[4])
    parser.add_argument("--speedup", type=float, default=None)
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--policy", nargs="+", default=["cache_aware", "sglang", "round_robin"])
    parser.add_argument("--profile", default=DEFAULT_PROFILE)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=None,
        help="the ranks' scheduler (engine.scheduler); default the profile's (GPU: 0, vLLM's)",
    )
    parser.add_argument("--svg", default=None, help="write a TTFT CDF per DP size here ({dp})")
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    import django

    django.setup()
    import logging

    logging.getLogger("engine").setLevel(logging.WARNING)  # the ranks' per-prefill lines
    from bench.datasets import allowed_token_ids
    from bench.trace import build, read_trace
    from engine.tiny import ensure_tiny_model
    from engine.tokenizer import load_tokenizer

    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.speedup and not args.max_concurrency:
        parser.error("give --speedup (open loop on the timestamps) or --max-concurrency")
    tokenizer = load_tokenizer(str(ensure_tiny_model()))
    allowed = allowed_token_ids(len(tokenizer), tokenizer)
    from engine.sim.profiles import get_profile

    workload = build(
        read_trace(args.trace_path, args.num_prompts),
        allowed=allowed,
        block_tokens_=args.trace_block_tokens,
        max_model_len=get_profile(args.profile).max_model_len,
    )
    print(
        f"{len(workload.samples)} requests ({workload.skipped} over the context skipped), "
        f"profile {args.profile}, block {args.block_size}"
    )
    header = (f"{'dp':>3} {'policy':<12} {'hit':>6} {'oracle':>6} {'of orc':>6} {'max/mean':>8}"
              f" {'ttft mean':>9} {'p50':>7} {'p90':>7} {'p99':>7}")  # fmt: skip
    print(header)
    profile = get_profile(args.profile)
    floor = sorted(floor_ttft([list(s.prompt) for s in workload.samples], profile.cost,
                              profile.max_num_batched_tokens, args.block_size))  # fmt: skip
    q = statistics.quantiles(floor, n=100)
    # each prompt alone on an idle rank with the oracle's cache: no router gets below it
    print(f"{'':>3} {'floor':<12} {'':>6} {'':>6} {'':>6} {'':>8} {statistics.fmean(floor):>9.3f} "
          f"{q[49]:>7.3f} {q[89]:>7.3f} {q[98]:>7.3f}")  # fmt: skip
    for dp in args.dp_size:
        curves = []
        for policy in args.policy:
            s = run(workload.samples, policy=policy, dp_size=dp, speedup=args.speedup,
                    concurrency=args.max_concurrency, profile=args.profile,
                    block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                    keep_flights=bool(args.svg),
                    long_threshold=args.long_prefill_token_threshold)  # fmt: skip
            if args.svg:
                ttft = sorted(f.first_token - f.arrival for f in s.pop("flights"))
                curves.append({"router": policy, "ttft_sorted": ttft})
            print(
                f"{dp:>3} {policy:<12} {s['hit_rate']:>6.3f} {s['oracle_hit_rate']:>6.3f} "
                f"{s['of_oracle']:>6.3f} {s['max_mean']:>8.2f} {s['ttft_mean_s']:>9.3f} "
                f"{s['ttft_p50_s']:>7.3f} {s['ttft_p90_s']:>7.3f} {s['ttft_p99_s']:>7.3f}",
                flush=True,
            )
        if args.svg:
            from bench.runs.routers_at_fleet_scale import cdf_svg

            title = f"TTFT CDF, routing lab, {len(workload.samples)} Mooncake requests, DP {dp}"
            Path(args.svg.format(dp=dp)).write_text(cdf_svg(curves, title))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
