"""The router's state and its one decision: which target serves this request.

One ``Router`` per router process, built by the process start (apps/routing/process.py) and
handed to what needs it: the ASGI app puts it in each request's scope (controlplane/asgi.py), the
background loops are given it. Tests build their own.

Who serves comes in as ``WorkerView``s: ``install_worker``, ``remove_worker`` ... keep the fleet,
the index and the volume consistent with each other. The replicas' records reach it through the
process's ``LiveFleet`` (apps/routing/live.py), which reads the rows; the router never does.
"""

from __future__ import annotations

import logging
import random
import time

from apps.routing.decision.config import RouterConfig
from apps.routing.decision.demand import PrefixDemand, ServedVolume
from apps.routing.decision.dispatch import Dispatch, DispatchObserver
from apps.routing.decision.fleet import Fleet, Target, WorkerView
from apps.routing.decision.index import PrefixIndex
from apps.routing.decision.misses import MissPlan, MissReasons
from apps.routing.decision.policies import DecodeLeg, Policy, make_policy
from apps.routing.decision.request_shape import RequestShape, shape_request
from apps.routing.decision.router_stats import RouterStats
from apps.routing.decision.sessions import SessionTable
from apps.routing.decision.timing import Timing

logger = logging.getLogger(__name__)

# the time check overrides the policy's choice only for a clearly quicker first token: by more
# than this many seconds and by more than this share of the quicker one's predicted TTFT
TIME_CHECK_FLOOR_S = 0.02
# the paths whose prompts fill the prefix cache: any other (embeddings, scoring) is routed by load
# with nothing predicted cached and nothing inserted into the index
CACHED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses"})
TIME_CHECK_RATIO = 0.5


class NoTarget(Exception):
    """No available target serves the requested model."""


class Router:
    def __init__(self, config: RouterConfig | None = None, rng: random.Random | None = None):
        self.config = config or RouterConfig()
        self.rng = rng or random.Random()
        self.fleet = Fleet()
        self.index = PrefixIndex(ttl_s=self.config.prefix_ttl_s)
        self.demand = PrefixDemand()
        self.volume = ServedVolume()  # each target's prompt tokens of the last minutes
        self.sessions = SessionTable(ttl_s=self.config.session_ttl_s)
        self.stats = RouterStats()
        self.misses = MissReasons(self.index)  # why prompts were not all cached (misses.py)
        self.timing = Timing()  # what a first token costs in time, per worker, as observed
        self.clock = time.perf_counter  # what a dispatch times itself with (the lab: virtual)
        self.policy: Policy = self._make_policy(self.config.policy)
        # prefill/decode disaggregation: each leg's own policy, when one is set for it
        self.role_policies: dict[str, Policy] = {
            role: self._make_policy(name)
            for role, name in (
                ("prefill", self.config.prefill_policy),
                ("decode", self.config.decode_policy),
            )
            if name
        }
        self.decode_leg = DecodeLeg(rng=self.rng)  # cache_aware's decode leg (policies.py)
        # told of every decision and prefill end (apps/routing/feeds/shared_index.py, kv_events.py)
        self.observers: list[DispatchObserver] = []

    def _make_policy(self, name: str) -> Policy:
        if name == "cache_aware":
            return make_policy(name, rng=self.rng, decode_weight=self.config.decode_weight)
        return make_policy(name, rng=self.rng)

    def set_policy(self, name: str) -> None:
        """Switch the policy for the next requests (the index keeps learning either way)."""
        self.policy = self._make_policy(name)
        self.config.policy = name
        logger.info("routing policy is now %s", name)

    def sync_capacity(self) -> None:
        """Bound each target's index by its engine's KV capacity (after targets were put)."""
        for target in self.fleet.all_targets():
            self.index.set_capacity(target.key, target.worker.capacity_blocks)

    def route(
        self,
        body: dict,
        chat: bool,
        model: str | None,
        exclude: set[str] = frozenset(),
        rank: int | None = None,
        session: str | None = None,
        ids_by_path: dict[str, list[int] | None] | None = None,
        role: str | None = None,
        path: str | None = None,
        predict: bool = True,
        settle_later: bool = False,
    ) -> Dispatch:
        """Choose a target and commit: begin its load, insert the request's blocks into the index
        for it (the engine caches them as it prefills), tell the observers. The returned dispatch
        owns the request's end. ``rank``: only that DP rank of a worker (the client's pin);
        ``session``: the client's session id (apps/routing/decision/sessions.py), kept on its rank;
        ``ids_by_path``: the prompt's token ids per tokenizer path, when already computed
        (``tokenizer_paths`` and request_shape.tokenize_off_loop); ``role``: one leg of a
        prefill/decode-disaggregated request, among the workers of that role, by its policy;
        ``path``: the OpenAI path it goes to (default by ``chat``): where the chosen worker drops
        the rank pin (``WorkerView.pin_check``), the placement is not believed: no hit is
        predicted and the index learns nothing from it; nor with ``predict`` False (the engine's
        prompt is not the one the router sees: a Responses continuation, whose earlier turns are
        in the engine's store).

        ``settle_later``: the choice is committed here (the circuit's trial), the rest (the load,
        the index insert, the observers, the stats, the session, the miss plan) by the dispatch's
        ``settle``, which the proxy calls right after it wrote the request to the engine
        (``http1.Pool.post``'s ``sent``): the engine starts on it that much sooner, and the
        bookkeeping runs while the router waits for the answer. Nothing runs between the two but
        that write (no other request is routed in between, so the load it reads is the same), and
        a dispatch settles before anything reads its load or ends it."""

        def allowed(t: Target) -> bool:
            return t.key not in exclude and (rank is None or t.rank == rank)

        candidates = self.fleet.candidates(model, role)
        if exclude or rank is not None:
            candidates = [t for t in candidates if allowed(t)]
        if not candidates and model and len(self.fleet.models()) == 1:
            candidates = [t for t in self.fleet.candidates(None, role) if allowed(t)]
        if not candidates:
            self.stats.no_target += 1
            which = f"{role} worker" if role else "worker"
            raise NoTarget(
                f"no available {which} serves model {model!r}" if model else f"no available {which}"
            )
        policy = self.role_policies.get(role, self.policy) if role else self.policy
        if role == "decode" and policy.name == "cache_aware":
            policy = self.decode_leg  # the prompt is computed: load decides, transfer breaks ties
        shapes, matched, shared = self._match(body, chat, model, candidates, ids_by_path)
        primary = shapes[candidates[0].key]
        # how hot the shared prefix is (counting this request): the policy copies only a hot one
        prefix = primary.digests[shared - 1] if 0 < shared <= len(primary.digests) else None
        self.demand.add(prefix)
        if prefix is not None:
            primary.prefix_requests, primary.prefix_share = self.demand.asked(prefix)
        primary.volume_excess = self.volume.excess([t.key for t in candidates])
        if role != "decode":  # read by the policy only to break a tie, before anything changes
            primary.warm_of = lambda: self._warm(candidates, primary)
        home = self.sessions.home(session, candidates) if session else None
        target = home or policy.choose(candidates, primary, matched, shared)
        if home is None and self.config.time_check and policy.name == "cache_aware":
            target = self._quicker(target, candidates, shapes, matched, primary)
        shape = shapes[target.key]
        path = path or ("/v1/chat/completions" if chat else "/v1/completions")
        placed = (
            predict
            and path in CACHED_PATHS
            and (target.rank is None or target.worker.pin_check.get(path, True))
        )
        predicted = self._cached_tokens(target, shape, matched, primary) if placed else 0
        if not placed:  # the engine picks the rank: its blocks are nowhere the index could say
            shape = RequestShape([], shape.prompt_tokens, shape.block_tokens, shape.chat)
        # A session's turn: its private history is already there (it continues), or a chat request
        # with none anywhere (a conversation starts here and its next turns will follow). Counting
        # starts at once matters: a burst of new conversations is placed before any of them has a
        # second turn, and placing them by in-flight requests alone lets the rank that answers
        # fastest collect more conversations than the others.
        continues = matched.get(target.key, 0) > shared
        # a decode leg computes no prompt: nothing to explain
        explains = predict and path in CACHED_PATHS and role != "decode"
        dispatch = Dispatch(
            target,
            shape,
            predicted,
            trial=target.breaker.dispatched(),
            stats=self.stats,
            observers=self.observers,
            clock=self.clock,
            misses=self.misses if explains else None,
        )

        def settle() -> None:
            # the load first: the time model's sample reads the queue before this request joins
            dispatch.timing_sample = self.timing.dispatched(
                target, shape.prompt_tokens - predicted + target.load.queued_prefill_tokens
            )
            dispatch.ticket = target.load.begin(
                shape.prompt_tokens, shape.prompt_tokens - predicted, continues or chat
            )
            if explains:
                pinned = model if rank is not None else None
                plan = self._miss_plan(target, candidates, shapes, matched, primary, predicted,
                                       placed, session, pinned, role)  # fmt: skip
                plan.shape = shape
                dispatch.plan = plan
            if session:
                self.sessions.record(session, target.key, kept=home is not None)
            self.index.insert(target.key, shape.digests)
            self.volume.add(target.key, shape.prompt_tokens)
            for observer in self.observers:
                observer.routed(target.key, shape.digests)
            self.stats.dispatched(target.key, shape.prompt_tokens, predicted)

        if settle_later:
            dispatch.pending = settle
        else:
            settle()
        return dispatch

    def _warm(self, candidates: list[Target], primary: RequestShape) -> frozenset[str]:
        """On an idle fleet, the rank used last keeps the ties while the request fits its cache
        (``RequestShape.warm``); nothing while anything is in flight."""
        if any(t.load.inflight for t in candidates):
            return frozenset()
        keys = self.timing.warm_keys(candidates)
        return frozenset(k for k in keys if self.index.room(k) >= len(primary.digests))

    def _miss_plan(self, target, candidates, shapes, matched, primary, predicted, placed,
                   session, pinned_model=None, role=None) -> MissPlan:  # fmt: skip
        """What the miss reasons need to know of this decision (apps/routing/decision/misses.py):
        the deepest match of any candidate, in the target's tokens; the session's last turn. A
        request pinned to a rank (``pinned_model``: its model) also looks at the ranks the pin
        ruled out that digest its prompt alike: what they held was placed elsewhere too."""
        shape = shapes[target.key]
        best = predicted
        if placed:
            mine = matched.get(target.key, 0)
            for t in candidates if matched else ():  # (nothing held anywhere: none held more)
                if matched.get(t.key, 0) > mine:
                    best = max(best, self._cached_tokens(t, shapes[t.key], matched, primary))
            if pinned_model is not None:
                alike = (target.worker.tokenizer_path, target.worker.block_size)
                others = [t.key for t in self.fleet.candidates(pinned_model, role)
                          if t.key not in shapes
                          and (t.worker.tokenizer_path, t.worker.block_size) == alike]  # fmt: skip
                held = max(self.index.match(shape.digests, others).values(), default=0)
                best = max(best, min(held, shape.hittable_blocks) * shape.block_tokens)
        tokenizer = self.tokenizer_path_of(target)
        previous = self.misses.previous_turn(session, shape, tokenizer) if session else None
        return MissPlan(target.key, session, shape, predicted, best, unplaced=not placed,
                        text=shape.ids is None, previous=previous,
                        tokenizer=tokenizer)  # fmt: skip

    @staticmethod
    def _cached_tokens(target: Target, shape: RequestShape, matched, primary) -> int:
        """The prompt tokens the index expects ``target`` to have cached (``matched`` counts
        ``primary``'s blocks; ``shape`` is the request in ``target``'s)."""
        blocks = matched.get(target.key, 0) * primary.block_tokens // shape.block_tokens
        return min(blocks, shape.hittable_blocks) * shape.block_tokens

    def _quicker(self, chosen: Target, candidates, shapes, matched, primary) -> Target:
        """The time check (``RouterConfig.time_check``): ``chosen`` unless the time model
        (apps/routing/decision/timing.py) expects another candidate's first token clearly sooner:
        by more than ``TIME_CHECK_FLOOR_S`` and by more than ``TIME_CHECK_RATIO`` of the quicker
        one's. The policy counts tokens and their future (what a copy costs the next requests);
        this catches where its token weights misjudge the present on an engine: waking an idle
        rank that costs a measured second, a queue that costs more than recomputing a prefix.
        It judges only with the evidence for the case at hand: an idle fleet where every
        candidate's worker shows a significant move cost, a busy one where each shows a
        significant cost per running request (apps/routing/decision/timing.py); anywhere else
        the policy's choice stands, so a fleet the model knows nothing about is routed by the
        policy alone."""
        if len(candidates) < 2:
            return chosen
        # what the model must know to judge: on an idle fleet what waking a rank costs, on a
        # busy one what a running request costs; without it, the policy's choice stands
        busy = any(t.load.inflight for t in candidates)
        known = {}  # worker id -> (its timing, its fit)
        for t in candidates:
            worker_id = t.worker.worker_id
            if worker_id not in known:
                timing = self.timing.of(worker_id)
                fit = timing.recent_fit()
                if not (fit.running_significant if busy else fit.move_significant):
                    return chosen
                known[worker_id] = timing, fit
        predictions = {}
        for t in candidates:
            (timing, fit), shape = known[t.worker.worker_id], shapes[t.key]
            wait = shape.prompt_tokens - self._cached_tokens(t, shape, matched, primary)
            predictions[t.key] = fit.predict(
                wait + t.load.queued_prefill_tokens,
                t.load.inflight,
                Timing.would_move(timing, t),
            )
        quickest = min(candidates, key=lambda t: predictions[t.key])
        gain = predictions[chosen.key] - predictions[quickest.key]
        if gain > TIME_CHECK_FLOOR_S and gain > TIME_CHECK_RATIO * predictions[quickest.key]:
            self.stats.time_checked += 1
            return quickest
        return chosen

    def tokenizer_paths(self, model: str | None) -> set[str]:
        """The tokenizers the candidates for ``model`` digest prompts with."""
        paths = {self.tokenizer_path_of(t) for t in self.fleet.candidates(model)}
        if not paths and model:
            paths = {self.tokenizer_path_of(t) for t in self.fleet.candidates(None)}
        return {p for p in paths if p}

    def tokenizer_path_of(self, target: Target) -> str | None:
        """The tokenizer this router digests ``target``'s prompts with (None: text digests)."""
        worker = target.worker
        if not (worker.block_size or self.config.tokenizer_path):
            return None
        return self.config.tokenizer_path or worker.tokenizer_path

    def _match(self, body: dict, chat: bool, model, candidates: list[Target], ids_by_path=None):
        """The request's shape for each candidate (workers may differ in tokenizer or block size,
        and in whether ``model`` is a LoRA adapter of theirs: each is matched in its own digests),
        the matches in units of the first candidate's blocks, and the shared-prefix depth in those
        units."""
        groups: dict[tuple, list[Target]] = {}
        first = candidates[0].worker
        if all(t.worker is first for t in candidates):  # one worker's ranks: one group
            adapter = model if model in first.adapters else None
            groups[(first.tokenizer_path, first.block_size, adapter)] = candidates
        else:
            for t in candidates:
                adapter = model if model in t.worker.adapters else None
                key = (t.worker.tokenizer_path, t.worker.block_size, adapter)
                groups.setdefault(key, []).append(t)
        shapes, matched, shared = {}, {}, 0
        unit = None
        for (_, _, adapter), members in groups.items():
            shape = self._shape(body, chat, members[0], ids_by_path, adapter)
            unit = unit or shape.block_tokens
            for t in members:
                shapes[t.key] = shape
            held, branch = self.index.lookup(shape.digests, [t.key for t in members])
            for key, blocks in held.items():
                matched[key] = min(blocks, shape.hittable_blocks) * shape.block_tokens // unit
            shared = max(shared, branch * shape.block_tokens // unit)
        return shapes, matched, shared

    def _shape(
        self, body: dict, chat: bool, target: Target, ids_by_path=None, adapter=None
    ) -> RequestShape:
        worker = target.worker
        return shape_request(
            body,
            chat,
            self.config.tokenizer_path or worker.tokenizer_path,
            worker.block_size or (16 if self.config.tokenizer_path else None),
            ids_by_path,
            adapter,
        )

    # ----- who serves: views of the replicas' records, installed by apps/routing/live.py --------
    def install_worker(self, view: WorkerView, rank_ids: dict[int | None, int]) -> None:
        """Serve a worker's targets. Targets that survive keep their load and breaker; an engine
        that restarted (its instance id changed) has empty caches, so the index forgets what it
        believed there, as it does for ranks that are gone (dp_size or dp-awareness changed)."""
        old = self.fleet.workers.get(view.worker_id)
        before = {t.key for t in self.fleet.targets.get(view.worker_id, [])}
        restarted = (
            old is not None and old.instance_id is not None and view.instance_id != old.instance_id
        )
        targets = self.fleet.put(view, rank_ids)
        stale = before if restarted else before - {t.key for t in targets}
        for key in stale:
            self.index.remove_rank(key)
        if restarted:
            logger.info("worker %s restarted: forgetting what its ranks had cached", view.url)
        for target in targets:
            self.index.set_capacity(target.key, target.worker.capacity_blocks)

    def forget_cache(self, worker_id: int) -> None:
        """The worker's engine may have restarted unseen: forget what its ranks held."""
        for target in self.fleet.targets.get(worker_id, []):
            self.index.remove_rank(target.key)

    def remove_worker(self, worker_id: int) -> None:
        for target in self.fleet.targets.get(worker_id, []):
            self.index.remove_rank(target.key)
            self.volume.forget(target.key)
        self.timing.forget(worker_id)
        self.fleet.remove(worker_id)

    def set_draining(self, worker_id: int, draining: bool) -> None:
        view = self.fleet.workers.get(worker_id)
        if view is not None:
            view.draining = draining

    def worker_state(self, worker_id: int) -> dict | None:
        """Health as this process sees it, and each target's circuit, load and index size (with
        what the observers know of it: precise or not), or None when the worker is not served."""
        view = self.fleet.workers.get(worker_id)
        if view is None:
            return None
        targets = [
            {
                "key": t.key,
                "rank": t.rank,
                "circuit": t.breaker.state,
                "inflight_requests": t.load.requests,
                "inflight_prompt_tokens": t.load.prompt_tokens,
                "index_blocks": self.index.size(t.key),
                **{k: v for o in self.observers for k, v in o.target_state(t.key).items()},
            }
            for t in self.fleet.targets.get(worker_id, [])
        ]
        timing = self.timing.workers.get(worker_id)
        return {
            "health": "healthy" if view.healthy else "unhealthy",
            "targets": targets,
            "timing": timing.fit.as_dict() if timing else None,
            # a completion's text prompt goes to it as token ids (apps/routing/feeds/prompt_ids.py)
            "prompt_ids": view.prompt_ids,
        }
