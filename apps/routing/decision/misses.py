"""Why a prompt was not all served from cache: a reason for every prompt token the engine computed.

At routing time the router knows, in the chosen target's tokens, what it predicted cached there,
the deepest match any candidate had, whether it could place the request at all (a dropped pin
lets the engine choose the rank) and whether it saw tokens (a tokenizer) or only text. When the
engine reports its cached tokens ``c``, every prompt token from ``c`` on is given the first
reason whose span covers it, in this order:

- ``mispredicted``: the router believed the target held it and the engine did not;
- ``pin_not_honoured``: the worker drops the rank pin on this path, so nothing was placed;
- ``no_tokenizer``: routed on text digests (the worker's tokenizer could not be loaded): the
  router cannot say where its blocks are;
- ``placed_elsewhere``: another candidate held it (balance, a session's home, the time check),
  or a rank the client's pin ruled out;
- ``evicted``: the target held it before and lost it (its engine's KV events, the index's LRU or
  TTL);
- ``diverged``: the session's previous turn (same ``X-Session-ID`` or ``user``) had these
  positions too, but rendered differently from token ``k`` on (a template that rewrites earlier
  turns, a client that edits its history);
- ``tenant_key``: cached, but under another key (without this request's ``cache_salt`` or LoRA
  adapter);
- ``never_seen``: nowhere the router knows;
- ``tail``: the last prompt token and the partial block before it, which no engine serves from
  cache.

The counts add up to the prompt tokens minus the engine's cached ones. Most of it is known at
routing time (``MissPlan``, built by ``Router.route``); the evicted, tenant and diverged spans are
looked up only when a request missed (``MissReasons.finished``), so a request that hit all it
could costs one comparison.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict, deque

from engine.digests import chain_digests

REASONS = (
    "mispredicted",
    "pin_not_honoured",
    "no_tokenizer",
    "placed_elsewhere",
    "evicted",
    "diverged",
    "tenant_key",
    "never_seen",
    "tail",
)
# how much of the sessions' last turns the router keeps to find where a turn diverges
SESSION_TURN_TOKENS = 4_000_000
DIVERGENCES_KEPT = 50  # the latest divergences, for the dashboard
SNIPPET_TOKENS = 24  # either side of the divergence, for the two renderings


class Turn:
    """A session's last turn as routed: its token ids and digests, in one tokenizer's terms."""

    __slots__ = ("ids", "digests", "block_tokens", "tokenizer")

    def __init__(self, ids, digests: list[int], block_tokens: int, tokenizer: str | None):
        self.ids, self.digests = array("i", ids), digests
        self.block_tokens, self.tokenizer = block_tokens, tokenizer


class MissPlan:
    """What the router knew when it routed one request (positions in its target's tokens)."""

    __slots__ = ("target", "session", "shape", "predicted", "best", "unplaced", "text", "previous",
                 "tokenizer")  # fmt: skip

    def __init__(self, target: str, session, shape, predicted: int, best: int, *,
                 unplaced: bool, text: bool, previous: Turn | None, tokenizer):  # fmt: skip
        self.target, self.session, self.shape = target, session, shape
        self.predicted, self.best = predicted, max(best, predicted)
        self.unplaced, self.text = unplaced, text
        self.previous = previous  # the session's turn before this one, when in the same terms
        self.tokenizer = tokenizer  # its path, for the divergence's two renderings


def divergence(previous: Turn, ids, digests: list[int]) -> int:
    """The first token where ``ids`` leaves ``previous`` (its length when it continues it)."""
    bt = previous.block_tokens
    block = 0
    for old, new in zip(previous.digests, digests, strict=False):
        if old != new:
            break
        block += 1
    start = block * bt
    old_ids = previous.ids
    end = min(len(old_ids), len(ids))
    for i in range(start, end):
        if old_ids[i] != ids[i]:
            return i
    return end


class MissReasons:
    """This router process's miss reasons: tokens per target and reason, the sessions' last
    turns, and the latest divergences."""

    def __init__(self, index, turn_tokens: int = SESSION_TURN_TOKENS):
        self.index = index  # the router's PrefixIndex (evicted blocks, the tenant check)
        self.tokens: dict[tuple[str, str], int] = {}  # (target key, reason) -> tokens
        self.requests = 0  # requests classified (their engine reported cached tokens)
        self.turns: OrderedDict[str, Turn] = OrderedDict()
        self.turn_tokens, self._held = turn_tokens, 0
        self.divergences: deque[dict] = deque(maxlen=DIVERGENCES_KEPT)
        self.diverged_sessions: dict[str, int] = {}  # session -> diverged tokens (bounded)

    # ----- routing time --------------------------------------------------------------------
    def previous_turn(self, session: str | None, shape, tokenizer: str | None) -> Turn | None:
        """The session's last turn, when it is in the same terms as ``shape`` (then this turn
        replaces it)."""
        if not session or shape.ids is None:
            return None
        turn = self.turns.get(session)
        self._remember(session, Turn(shape.ids, shape.digests, shape.block_tokens, tokenizer))
        if turn is None or turn.block_tokens != shape.block_tokens or turn.tokenizer != tokenizer:
            return None
        return turn

    def _remember(self, session: str, turn: Turn) -> None:
        old = self.turns.pop(session, None)
        if old is not None:
            self._held -= len(old.ids)
        self.turns[session] = turn
        self._held += len(turn.ids)
        while self._held > self.turn_tokens and self.turns:
            _, gone = self.turns.popitem(last=False)
            self._held -= len(gone.ids)

    # ----- the end ---------------------------------------------------------------------------
    def explain(self, plan: MissPlan, prompt_tokens: int, cached: int) -> tuple[dict, int | None]:
        """Tokens per reason for ``prompt_tokens - cached`` (only the reasons with some), and the
        token where the turn left the session's last one (None: it did not, or no session)."""
        shape = plan.shape
        bt = shape.block_tokens
        hittable = min(shape.hittable_blocks * bt, max(0, prompt_tokens - 1))
        out: dict[str, int] = {}
        diverged_at = None
        if cached < hittable:
            # each reason's span, in order; a span that ends where the engine's cached tokens
            # do, or before, names nothing
            spans = []
            if plan.predicted > cached:
                spans.append(("mispredicted", 0, plan.predicted))
            if plan.unplaced:
                spans.append(("pin_not_honoured", 0, hittable))
            else:
                if plan.best > max(plan.predicted, cached):
                    spans.append(("placed_elsewhere", plan.predicted, plan.best))
                if plan.text:
                    spans.append(("no_tokenizer", 0, hittable))
                else:
                    diverged_at = self._lost_spans(plan, spans)
            _claim(spans, cached, hittable, out)
        return self._tail(out, prompt_tokens, hittable, cached), diverged_at

    @staticmethod
    def _tail(out: dict[str, int], prompt_tokens: int, hittable: int, cached: int) -> dict:
        """``out`` with what no reason claimed of the hittable part (never seen) and the tail."""
        missed = hittable - max(cached, 0)
        rest = missed - sum(out.values())
        if rest > 0:
            out["never_seen"] = out.get("never_seen", 0) + rest
        tail = prompt_tokens - max(hittable, cached)
        if tail > 0:
            out["tail"] = tail
        return out

    def _lost_spans(self, plan: MissPlan, spans: list) -> int | None:
        """The spans only a look at the index and the session can name (added to ``spans``):
        evicted from the target, diverged from the session's last turn, cached under another
        tenant key. Returns where the turn diverged (None: it did not)."""
        shape, bt = plan.shape, plan.shape.block_tokens
        digests = shape.digests
        start = plan.predicted // bt
        run = self.index.evicted_run(plan.target, digests, start)
        if run:
            spans.append(("evicted", start * bt, (start + run) * bt))
        previous, at = plan.previous, None
        if previous is not None:
            at = divergence(previous, shape.ids, digests)
            held = len(previous.digests) * bt  # the last turn's full blocks, all cached by it
            if at < held:  # those from ``at`` on are no use to this turn
                spans.append(("diverged", at // bt * bt, held))
            else:
                at = None
        if shape.namespace is not None and shape.ids is not None:
            plain = chain_digests(shape.ids, bt)
            deepest = max(self.index.match(plain).values(), default=0)
            spans.append(("tenant_key", 0, deepest * bt))
        return at

    def count(self, plan: MissPlan, reasons: dict[str, int], diverged_at: int | None) -> None:
        """Count one request's reasons (``explain``'s, with its engine's cached tokens)."""
        self.requests += 1
        for reason, n in reasons.items():
            key = (plan.target, reason)
            self.tokens[key] = self.tokens.get(key, 0) + n
        if diverged_at is not None and reasons.get("diverged"):
            self._record_divergence(plan, plan.previous, diverged_at, reasons["diverged"])

    def _record_divergence(self, plan: MissPlan, previous: Turn, at: int, tokens: int) -> None:
        session = plan.session
        sessions = self.diverged_sessions
        sessions[session] = sessions.get(session, 0) + tokens
        if len(sessions) > 1000:  # keep the worst 800 (a sort per 200 new sessions, not each)
            for name in sorted(sessions, key=sessions.get)[: len(sessions) - 800]:
                del sessions[name]
        self.divergences.append({
            "session": session,
            "target": plan.target,
            "token": at,
            "tokens": tokens,
            "previous": _render(plan.tokenizer, previous.ids, at),
            "current": _render(plan.tokenizer, plan.shape.ids, at),
        })  # fmt: skip

    def worst_sessions(self, n: int = 10) -> list[tuple[str, int]]:
        """The sessions that lost the most tokens to divergence, most first."""
        items = sorted(self.diverged_sessions.items(), key=lambda kv: -kv[1])
        return items[:n]

    def as_dict(self, renderings: bool) -> dict:
        """For GET /misses and the dashboard; the prompts' text only with ``renderings``."""
        targets: dict[str, dict[str, int]] = {}
        for (key, reason), n in self.tokens.items():
            targets.setdefault(key, {})[reason] = n
        divergences = [
            d if renderings else {k: v for k, v in d.items() if k not in ("previous", "current")}
            for d in reversed(self.divergences)
        ]
        return {
            "requests": self.requests,
            "reasons": list(REASONS),
            "targets": targets,
            "divergences": divergences,  # latest first
            "worst_sessions": [{"session": s, "tokens": n} for s, n in self.worst_sessions()],
        }


def _render(tokenizer_path: str | None, ids, at: int) -> dict:
    """The tokens around ``at`` as text: before it and from it on."""
    before = list(ids[max(0, at - SNIPPET_TOKENS) : at])
    after = list(ids[at : at + SNIPPET_TOKENS])
    if tokenizer_path:
        from apps.routing.decision.request_shape import tokenizer_or_none

        tokenizer = tokenizer_or_none(tokenizer_path)
        if tokenizer is not None:
            return {"before": tokenizer.decode(before), "from": tokenizer.decode(after)}
    return {"before": " ".join(map(str, before)), "from": " ".join(map(str, after))}


def _claim(spans: list, cached: int, hittable: int, out: dict[str, int]) -> None:
    """Give each span's reason, in order, the tokens of its span that are missed (from
    ``cached`` to ``hittable``) and not yet given to an earlier reason."""
    claimed: list[tuple[int, int]] = []  # the spans given so far, disjoint, in order
    for reason, start, end in spans:
        low, end = max(start, cached), min(end, hittable)
        if end <= low:
            continue
        pos, given = low, 0
        for s, e in claimed:
            if pos >= end:
                break
            if e <= pos:
                continue
            if s > pos:
                given += min(s, end) - pos
            pos = max(pos, e)
        if end > pos:
            given += end - pos
        if given:
            out[reason] = out.get(reason, 0) + given
        claimed.append((low, end))
        claimed.sort()
