"""The routing lab for prefill/decode-disaggregated fleets: a trace replayed through the real
``Router`` (``--pd-disaggregation``: each request's prefill leg, then its decode leg) onto
simulated prefill and decode ranks, in virtual time, in one process, beside a co-located fleet of
as many ranks replayed the same way (bench/runs/routing_lab.py).

A request's prefill leg runs on its prefill rank (one output token, its blocks held); then its
decode leg is routed, and its decode rank pulls the full prompt blocks it lacks (the profile's KV
bytes over ``Profile.kv_link_bytes_per_s``: the simulated engine's own transfer model), caches
them, computes the rest of the prompt and decodes. The client's first token is the decode rank's
(vLLM's two-step protocol). Reported per routing: the prefill side's hits (and of the block-rule
oracle), TTFT mean / p50 / p90 / p99, TPOT mean and p90, the decode ranks' max/mean of their
time-averaged running requests, and what the transfer moved::

    .venv/bin/python -m bench.runs.pd_lab \\
        --trace-path bench/traces/mooncake_synthetic_trace.jsonl --num-prompts 1500 \\
        --prefill 2 --decode 2 --dp-size 4 --speedup 1 --num-kv-blocks 250000

``--policy`` names the routings: ``cache_aware`` (both legs ours), ``round_robin`` (both legs),
``sglang`` (the prefill leg by the lab's model of SGLang's cache-aware rule over the prefill ranks,
the decode leg round robin, as sglang-router's PD mode with its defaults; for orientation: the
real routers are compared over HTTP by bench.runs.pd_at_fleet_scale).
"""

from __future__ import annotations

import argparse
import os
import statistics
from dataclasses import dataclass

from bench.oracle import oracle_cached
from bench.runs import routing_lab
from bench.runs.routing_lab import DEFAULT_PROFILE, RankSim, VirtualClock, make_ranks


@dataclass
class PDFlight:
    """One request in the PD lab: its arrival, both legs' dispatches, what it got."""

    arrival: float
    prompt: list[int]
    output_len: int
    prefill: object = None  # the prefill leg's dispatch
    decode: object = None
    prefill_key: str = ""
    decode_key: str = ""
    cached: int = 0  # on the prefill side
    pulled_tokens: int = 0
    first_token: float | None = None
    end: float | None = None


def make_router(policy: str, prefill: int, decode: int, dp_size: int, block_size: int,
                capacity: int, clock):  # fmt: skip
    """The real router in PD mode, its fleet ``prefill`` prefill workers and ``decode`` decode
    workers of ``dp_size`` ranks each; the lab's targets keyed like the router's."""
    from apps.replicas.models import Worker
    from apps.routing.decision.config import RouterConfig
    from apps.routing.decision.demand import PrefixDemand, ServedVolume
    from apps.routing.decision.load import RankLoad
    from apps.routing.decision.policies import POLICIES
    from apps.routing.decision.router import Router
    from apps.routing.live import LiveFleet
    from engine.digests import SCHEME
    from engine.tiny import ensure_tiny_model

    router = Router(
        RouterConfig(
            dp_aware=True,
            policy=policy if policy in POLICIES else "cache_aware",
            pd=True,
            decode_policy="round_robin" if policy in routing_lab.LAB_POLICIES else None,
        )
    )
    if policy in routing_lab.LAB_POLICIES:
        router.role_policies["prefill"] = routing_lab.LAB_POLICIES[policy]()
    router.index.clock = router.clock = clock
    router.demand = PrefixDemand(clock=clock)
    router.volume = ServedVolume(clock=clock)
    live = LiveFleet(router)
    roles = ["prefill"] * prefill + ["decode"] * decode
    for worker_id, role in enumerate(roles, start=1):
        info = {"dp_size": dp_size, "model_id": "tiny", "model_path": str(ensure_tiny_model()),
                "block_size": block_size, "prefix_digest": SCHEME,
                "num_kv_blocks_per_rank": capacity, "disaggregation_mode": role}  # fmt: skip
        url = f"http://{role}-{worker_id}"
        live.worker_saved(
            Worker(id=worker_id, url=url, dp_size=dp_size, model_id="tiny", server_info=info), {}
        )
    for target in router.fleet.all_targets():  # fresh loads on the virtual clock
        target.load = RankLoad(clock=clock)
    return router


class PDReplay(routing_lab.Replay):
    """The co-located replay's event loop with two kinds of rank: a request goes to its prefill
    rank, then (its prefill done, its KV pulled) to its decode rank."""

    def __init__(self, router, clock: VirtualClock, ranks: dict[str, RankSim], profile,
                 block_size: int, concurrency, waiting):  # fmt: skip
        super().__init__(ranks, router, clock, concurrency, waiting)  # ranks by target key
        self.profile, self.block_size = profile, block_size
        self.running_area: dict[str, float] = dict.fromkeys(ranks, 0.0)  # running x seconds
        self.last_change: dict[str, float] = dict.fromkeys(ranks, 0.0)

    def _account(self, key: str) -> None:
        """Integrate ``key``'s running requests over time up to now (decode balance)."""
        rank = self.ranks[key]
        self.running_area[key] += len(rank.flights) * (self.clock.now - self.last_change[key])
        self.last_change[key] = self.clock.now

    def send(self, flight: PDFlight) -> None:
        from engine.sampling_params import SamplingParams

        self.in_flight += 1
        flight.arrival = self.clock.now
        flight.prefill = self.router.route({"prompt": flight.prompt}, False, None, role="prefill")
        flight.prefill_key = key = flight.prefill.target.key
        rid = f"p{next(self.order)}"
        rank = self.ranks[key]
        rank.engine.add_request(rid, flight.prompt, SamplingParams(max_tokens=1), hold_key=rid)
        self._account(key)
        rank.flights[rid] = flight
        if not rank.busy:
            self.start_step(key)

    def step_done(self, key: str, outputs) -> None:
        rank = self.ranks[key]
        for out in outputs:
            flight = rank.flights[out.request_id]
            if flight.prefill_key == key and flight.decode is None:
                if out.finished:  # the prefill leg: its one token; now the decode leg
                    flight.cached = out.num_cached_tokens
                    flight.prefill.first_token()
                    usage = {"prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}
                    flight.prefill.finish(ok=True, usage=usage)
                    self._account(key)
                    del rank.flights[out.request_id]
                    self.route_decode(flight, out.request_id)
                continue
            if flight.first_token is None and out.num_output_tokens:
                flight.first_token = self.clock.now
                flight.decode.first_token()
            if out.finished:
                flight.end = self.clock.now
                usage = {"prompt_tokens_details": {"cached_tokens": flight.cached}}
                flight.decode.finish(ok=True, usage=usage)
                self._account(key)
                del rank.flights[out.request_id]
                self.in_flight -= 1
                if self.concurrency and self.waiting:
                    self.send(self.waiting.pop())
        rank.busy = False
        if rank.engine.has_unfinished_requests():
            self.start_step(key)

    def route_decode(self, flight: PDFlight, hold_key: str) -> None:
        """Route the decode leg; its rank pulls the blocks it lacks, which takes the transfer's
        modeled time."""
        from engine.sampling_params import SamplingParams
        from engine.sequence import Sequence

        flight.decode = self.router.route({"prompt": flight.prompt}, False, None, role="decode")
        flight.decode_key = key = flight.decode.target.key
        engine = self.ranks[key].engine
        usable = (len(flight.prompt) - 1) // self.block_size
        seq = Sequence(flight.prompt, SamplingParams(), block_size=self.block_size)
        first = len(engine.block_manager.cached_prefix(seq, usable))
        flight.pulled_tokens = (usable - first) * self.block_size
        seconds = self.profile.transfer_seconds(flight.pulled_tokens)
        self.push(self.clock.now + seconds, "pulled", (flight, hold_key, first, usable - first))

    def pulled(self, flight: PDFlight, hold_key: str, first: int, count: int) -> None:
        from engine.sampling_params import SamplingParams

        self.ranks[flight.prefill_key].engine.release_held(hold_key)
        rank = self.ranks[flight.decode_key]
        if count:
            rank.engine.import_prefix(flight.prompt, first, b"", count)
        rid = f"d{next(self.order)}"
        params = SamplingParams(max_tokens=flight.output_len, ignore_eos=True)
        rank.engine.add_request(rid, flight.prompt, params, cached_tokens=flight.cached)
        self._account(flight.decode_key)
        rank.flights[rid] = flight
        if not rank.busy:
            self.start_step(flight.decode_key)

    def drive(self) -> None:
        import heapq

        while self.events:
            self.clock.now, _, kind, payload = heapq.heappop(self.events)
            if kind == "arrive":
                self.send(payload)
            elif kind == "pulled":
                self.pulled(*payload)
            else:
                self.step_done(*payload)


def run(samples, *, policy: str, prefill: int, decode: int, dp_size: int,
        speedup: float | None, concurrency: int | None, profile: str = DEFAULT_PROFILE,
        block_size: int = 16, num_kv_blocks: int | None = None,
        long_threshold: int | None = None) -> dict:  # fmt: skip
    """Replay ``samples`` through a PD fleet and return the summary."""
    from engine.sim.profiles import get_profile

    clock = VirtualClock()
    count = (prefill + decode) * dp_size
    sims = make_ranks(count, profile, block_size, num_kv_blocks, long_threshold)
    capacity = sims[0].engine.block_manager.num_blocks
    router = make_router(policy, prefill, decode, dp_size, block_size, capacity, clock)
    targets = sorted(router.fleet.all_targets(), key=lambda t: t.key)
    ranks = {t.key: sim for t, sim in zip(targets, sims, strict=True)}
    flights = [
        PDFlight(f.arrival, f.prompt, f.output_len)
        for f in routing_lab.make_flights(samples, speedup)
    ]
    replay = PDReplay(router, clock, ranks, get_profile(profile), block_size, concurrency,
                      waiting=list(reversed(flights)))  # fmt: skip
    if concurrency and not speedup:
        for _ in range(min(concurrency, len(replay.waiting))):
            replay.send(replay.waiting.pop())
    else:
        for flight in flights:
            replay.push(flight.arrival, "arrive", flight)
    replay.drive()
    for key in ranks:
        replay._account(key)
    decode_keys = [t.key for t in targets if t.worker.role == "decode"]
    leaks = sum(len(sim.engine.held) for sim in sims)
    assert not leaks, f"{leaks} prefill holds never released"
    return summarize(flights, block_size, clock.now, [replay.running_area[k] for k in decode_keys])


def tpot(flight) -> float | None:
    if flight.output_len < 2 or flight.end is None:
        return None
    return (flight.end - flight.first_token) / (flight.output_len - 1)


def summarize(flights, block_size: int, end: float, decode_area: list[float]) -> dict:
    prompt = sum(len(f.prompt) for f in flights)
    cached = sum(f.cached for f in flights)
    ordered = sorted(flights, key=lambda f: f.arrival)
    oracle = sum(oracle_cached([f.prompt for f in ordered], block_size))
    ttft = sorted(f.first_token - f.arrival for f in flights)
    q = statistics.quantiles(ttft, n=100)
    tpots = sorted(t for t in map(tpot, flights) if t is not None)
    mean_area = sum(decode_area) / len(decode_area) if decode_area else 0.0
    return {
        "requests": len(flights),
        "hit_rate": cached / prompt,
        "oracle_hit_rate": oracle / prompt,
        "of_oracle": cached / oracle if oracle else None,
        "ttft_mean_s": statistics.fmean(ttft),
        "ttft_p50_s": q[49],
        "ttft_p90_s": q[89],
        "ttft_p99_s": q[98],
        "tpot_mean_s": statistics.fmean(tpots) if tpots else float("nan"),
        "tpot_p90_s": statistics.quantiles(tpots, n=10)[8] if len(tpots) > 1 else float("nan"),
        "decode_max_mean": max(decode_area) / mean_area if mean_area else float("nan"),
        "pulled_tokens": sum(f.pulled_tokens for f in flights),
        "duration_s": end,
    }


def colocated(samples, args, policy: str, dp: int) -> dict:
    """The same samples on a co-located fleet of as many ranks (routing_lab.run), with TPOT."""
    s = routing_lab.run(samples, policy=policy, dp_size=dp, speedup=args.speedup,
                        concurrency=args.max_concurrency, profile=args.profile,
                        block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                        keep_flights=True,
                        long_threshold=args.long_prefill_token_threshold)  # fmt: skip
    flights = s.pop("flights")
    tpots = sorted(t for t in map(tpot, flights) if t is not None)
    s["tpot_mean_s"] = statistics.fmean(tpots) if tpots else float("nan")
    s["tpot_p90_s"] = statistics.quantiles(tpots, n=10)[8] if len(tpots) > 1 else float("nan")
    return s


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bench.runs.pd_lab", description=__doc__.split("\n")[0])
    parser.add_argument("--trace-path", required=True)
    parser.add_argument("--num-prompts", type=int, default=1500)
    parser.add_argument("--trace-block-tokens", type=int, default=512)
    parser.add_argument("--prefill", type=int, default=2, help="prefill workers")
    parser.add_argument("--decode", type=int, default=2, help="decode workers")
    parser.add_argument("--dp-size", type=int, default=4, help="ranks per worker")
    parser.add_argument("--speedup", type=float, default=None)
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--policy", nargs="+", default=["cache_aware", "sglang", "round_robin"])
    parser.add_argument("--colocated", nargs="*", default=["cache_aware"],
                        help="co-located routings to put beside (none: skip)")  # fmt: skip
    parser.add_argument("--profile", default=DEFAULT_PROFILE)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--long-prefill-token-threshold", type=int, default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    import django

    django.setup()
    import logging

    logging.getLogger("engine").setLevel(logging.WARNING)
    from bench.datasets import allowed_token_ids
    from bench.trace import build, read_trace
    from engine.sim.profiles import get_profile
    from engine.tiny import ensure_tiny_model
    from engine.tokenizer import load_tokenizer

    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.speedup and not args.max_concurrency:
        parser.error("give --speedup (open loop on the timestamps) or --max-concurrency")
    tokenizer = load_tokenizer(str(ensure_tiny_model()))
    workload = build(
        read_trace(args.trace_path, args.num_prompts),
        allowed=allowed_token_ids(len(tokenizer), tokenizer),
        block_tokens_=args.trace_block_tokens,
        max_model_len=get_profile(args.profile).max_model_len,
    )
    ranks = (args.prefill + args.decode) * args.dp_size
    print(f"{len(workload.samples)} requests, profile {args.profile}, PD {args.prefill} prefill + "
          f"{args.decode} decode workers x DP {args.dp_size} vs co-located DP {ranks}")  # fmt: skip
    print(f"{'fleet':<10} {'routing':<12} {'hit':>6} {'of orc':>6} {'ttft mean':>9} {'p50':>7} "
          f"{'p90':>7} {'p99':>7} {'tpot':>7} {'tpot p90':>8} {'dec max/mean':>12} "
          f"{'pulled Mtok':>11}")  # fmt: skip
    for policy in args.policy:
        s = run(workload.samples, policy=policy, prefill=args.prefill, decode=args.decode,
                dp_size=args.dp_size, speedup=args.speedup, concurrency=args.max_concurrency,
                profile=args.profile, block_size=args.block_size,
                num_kv_blocks=args.num_kv_blocks,
                long_threshold=args.long_prefill_token_threshold)  # fmt: skip
        print_row("pd", policy, s)
    for policy in args.colocated:
        print_row(f"co-loc {ranks}", policy, colocated(workload.samples, args, policy, ranks))
    return 0


def print_row(fleet: str, policy: str, s: dict) -> None:
    print(f"{fleet:<10} {policy:<12} {s['hit_rate']:>6.3f} {s['of_oracle']:>6.3f} "
          f"{s['ttft_mean_s']:>9.3f} {s['ttft_p50_s']:>7.3f} {s['ttft_p90_s']:>7.3f} "
          f"{s['ttft_p99_s']:>7.3f} {s['tpot_mean_s'] * 1000:>6.1f}m "
          f"{s['tpot_p90_s'] * 1000:>7.1f}m {s.get('decode_max_mean', float('nan')):>12.2f} "
          f"{s.get('pulled_tokens', 0) / 1e6:>11.2f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
