"""The router's model of each rank's prefix cache: which block digests it probably holds.

A request's digests are inserted for the rank it was routed to (Dynamo's "approximate mode").
Each rank's set is an LRU bounded by that rank's KV capacity (an engine cannot hold more blocks
than its pool), and entries expire after a TTL. A wrong prediction heals by itself: a request that
missed has recomputed and cached those blocks by the time it finishes.

Engines that publish their KV events (ours: ``GET /kv_events``, apps/routing/feeds/kv_events.py)
also correct it: a snapshot replaces a rank's set (``replace``), stored blocks are inserted, evicted
ones removed (``remove``). The inserts at routing time stay: they cover the requests whose
blocks the engine has not stored yet (a burst of siblings).

Two implementations, one behaviour: ``NativePrefixIndex`` keeps the per-digest state in flat C
tables (csrc/prefix_core.c, built at first use like the engine's kernel: serving/native.py), where
``PurePrefixIndex`` keeps it in dicts, where every digest of a request costs ~10 probes of large
dicts of boxed ints; the flat tables do the same 2-4x cheaper. ``PrefixIndex`` is the
native one where it builds (``DPMESH_PURE_INDEX=1``: the pure one); tests/routing/test_index.py
runs both and compares them on random operation sequences.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import time
from collections import OrderedDict
from pathlib import Path

from serving import native

logger = logging.getLogger(__name__)

LOST_KEPT = 200_000  # evicted digests remembered (~20 MB at most)
# a chain inserted again on the rank whose latest insert it was, within this long, is left as it
# is: it is already the rank's most recent entry, and only its timestamps (the TTL's) would move
RENEW_AFTER_S = 1.0


def named(keys: list[str], mask: int) -> list[str]:
    """The rank keys of a holders' bitset (bit i: ``keys[i]``)."""
    out, index = [], 0
    while mask:
        if mask & 1:
            out.append(keys[index])
        mask >>= 1
        index += 1
    return out


class PurePrefixIndex:
    """The index in Python dicts (the reference; where the native core does not build)."""

    def __init__(self, ttl_s: float = 600.0, default_capacity: int = 100_000, clock=time.monotonic):
        self.ttl_s, self.default_capacity, self.clock = ttl_s, default_capacity, clock
        self.ranks: dict[str, OrderedDict[int, float]] = {}  # rank key -> digest -> last use
        self.capacity: dict[str, int] = {}
        # digest -> the ranks holding it, one bit each (``holders`` names them): an int per
        # digest, not a set, since a long prompt inserts ~1,000 new digests a request on the
        # router's event loop (a set each cost 8.4 ms for 1,300 digests into a full index)
        self.owners: dict[int, int] = {}
        self._bits: dict[str, int] = {}  # rank key -> its bit (assigned once)
        self._keys: list[str] = []  # bit index -> rank key
        # Fan-out: a block followed by two different blocks is a shared prefix's end (a system
        # prompt, a few-shot header); a chain of single-child blocks is one session's history.
        self.first_child: dict[int, int] = {}
        self.branching: set[int] = set()
        # digest -> the ranks that held it and lost it (evicted by their engine, its LRU or the
        # TTL): the miss reasons' "evicted" (apps/routing/decision/misses.py). Two plain dicts,
        # the recent one and the one before, each up to half of ``lost_cap``: when the recent one
        # fills it becomes the one before and the oldest half is dropped whole. An ordered LRU
        # cost three operations on a 200,000-entry OrderedDict per evicted digest, 40 % of an
        # insert that evicts (a unique prompt into a full index); this costs one dict store
        self.lost: dict[int, int] = {}
        self.lost_before: dict[int, int] = {}
        self.lost_cap = LOST_KEPT
        # no entry of any rank expires before this (the oldest last use + the TTL, or later: a
        # lower bound, so a lookup checks one number instead of every rank's oldest entry)
        self._expires_at = float("inf")
        # rank key -> its latest insert (its digests, when), while nothing has been removed or
        # evicted from that rank since (``insert``'s shortcut)
        self._latest: dict[str, tuple[list[int], float]] = {}

    def set_capacity(self, key: str, blocks: int | None) -> None:
        self.capacity[key] = blocks or self.default_capacity
        self._trim(key)

    def _bit(self, key: str) -> int:
        bit = self._bits.get(key)
        if bit is None:
            bit = self._bits[key] = 1 << len(self._keys)
            self._keys.append(key)
        return bit

    def _named(self, mask: int) -> list[str]:
        return named(self._keys, mask)

    def holders(self, digest: int) -> set[str]:
        """The rank keys holding ``digest``."""
        return set(self._named(self.owners.get(digest, 0)))

    def match(self, digests: list[int], keys: list[str] | None = None) -> dict[str, int]:
        """Leading blocks of ``digests`` each rank holds (only ranks with at least one)."""
        return self.lookup(digests, keys)[0]

    def shared_blocks(self, digests: list[int]) -> int:
        """How many leading blocks of ``digests`` are a prefix several requests branch from: up to
        the deepest known branching block, or to where this request itself leaves a known chain
        (its next block differs from the one that followed there before)."""
        return self.lookup(digests, ())[1]

    def lookup(self, digests: list[int], keys=None) -> tuple[dict[str, int], int]:
        """``match(digests, keys)`` and ``shared_blocks(digests)`` in one walk of the digests
        (the router asks both of every request)."""
        if self.clock() >= self._expires_at:  # expired entries leave first
            self._expire()
        bits = self._bits
        alive = 0
        for key in self.ranks if keys is None else keys:
            alive |= bits.get(key, 0)  # a rank without entries drops out at the first block
        matched: dict[str, int] = {}
        depth = shared = 0
        owners, branching, first_child = self.owners, self.branching, self.first_child
        last = len(digests) - 1
        for i, digest in enumerate(digests):
            holders = owners.get(digest, 0)
            if not holders:
                break
            if alive:
                still = alive & holders
                if still != alive:  # the ones that dropped out matched ``depth``
                    if depth:
                        for key in self._named(alive & ~still):
                            matched[key] = depth
                    alive = still
                if alive:
                    depth += 1
            if digest in branching:
                shared = i + 1
            else:
                child = first_child.get(digest)
                if child is not None and i < last and child != digests[i + 1]:
                    shared = i + 1
        if alive and depth:
            for key in self._named(alive):
                matched[key] = depth
        return matched, shared

    def insert(self, key: str, digests: list[int]) -> None:
        """Record that rank ``key`` now holds ``digests`` (most recently used)."""
        now = self.clock()
        # the same blocks as the rank's latest insert (a prompt sent again, the same insert from
        # another router process): every one of them is there, the most recent, in this order
        # (the rank's LRU has not been trimmed nor any block removed since), so inserting them
        # again would change nothing but their timestamps
        latest = self._latest.get(key)
        if latest is not None and now - latest[1] < RENEW_AFTER_S and latest[0] == digests:
            return
        # names bound once: a 15 k-token prompt is ~1,000 digests, twice a request (here and from
        # the engine's KV events), on the router's event loop
        first_child, branching = self.first_child, self.branching
        for parent, child in zip(digests, digests[1:], strict=False):
            if first_child.setdefault(parent, child) != child:
                branching.add(parent)
        self._expires_at = min(self._expires_at, now + self.ttl_s)
        lru = self.ranks.setdefault(key, OrderedDict())
        owners, to_end, bit = self.owners, lru.move_to_end, self._bit(key)
        get = owners.get
        # the head ends most recent: like the engine, evict tails first
        for digest in reversed(digests):
            if digest in lru:
                to_end(digest)
            else:
                owners[digest] = get(digest, 0) | bit
            lru[digest] = now
        self._latest[key] = (list(digests), now)
        self._trim(key)  # (which forgets it again if it evicts anything)

    def remove(self, key: str, digests: list[int]) -> int:
        """Rank ``key`` no longer holds ``digests`` (its engine evicted them); returns how many
        it had."""
        lru = self.ranks.get(key)
        if lru is None:
            return 0
        self._latest.pop(key, None)
        removed = 0
        for digest in digests:
            if lru.pop(digest, None) is not None:
                self._disown(digest, key)
                self._lose(digest, key)
                removed += 1
        return removed

    def replace(self, key: str, digests: list[int]) -> None:
        """Rank ``key`` holds exactly ``digests`` (an engine's snapshot), all as recently used."""
        keep = set(digests)
        self._latest.pop(key, None)
        lru = self.ranks.setdefault(key, OrderedDict())
        self.remove(key, [d for d in lru if d not in keep])
        now, bit = self.clock(), self._bit(key)
        self._expires_at = min(self._expires_at, now + self.ttl_s)
        for digest in digests:
            if digest in lru:
                lru.move_to_end(digest)  # the LRU stays in time order: expired entries lead
            else:
                self.owners[digest] = self.owners.get(digest, 0) | bit
            lru[digest] = now
        self._trim(key)

    def remove_rank(self, key: str) -> None:
        self._latest.pop(key, None)
        for digest in self.ranks.pop(key, {}):
            self._disown(digest, key)
        self.capacity.pop(key, None)

    def _expire(self) -> None:
        """Drop every rank's expired entries; the next time one can expire."""
        oldest = float("inf")
        for key, lru in self.ranks.items():
            self._trim(key)
            if lru:
                oldest = min(oldest, next(iter(lru.values())))
        self._expires_at = oldest + self.ttl_s

    def _trim(self, key: str) -> None:
        """Evict ``key``'s least recently used digests past its capacity, and the expired ones
        (``_disown`` and ``_lose`` inlined: a unique prompt into a full index evicts as many
        digests as it inserts, on the router's event loop)."""
        lru = self.ranks.get(key)
        if not lru:
            return
        excess = len(lru) - self.capacity.get(key, self.default_capacity)
        deadline = self.clock() - self.ttl_s
        if excess <= 0 and next(iter(lru.values())) >= deadline:
            return
        self._latest.pop(key, None)  # blocks leave: the latest chain may be one of them
        bit = self._bits[key]
        keep = ~bit
        owners, first_child, branching = self.owners, self.first_child, self.branching
        lost, half = self.lost, max(1, self.lost_cap // 2)
        popitem = lru.popitem
        while lru and (excess > 0 or next(iter(lru.values())) < deadline):
            digest, _ = popitem(last=False)
            excess -= 1
            holders = owners.get(digest)
            if holders is not None:
                holders &= keep
                if holders:
                    owners[digest] = holders
                else:
                    del owners[digest]
                    first_child.pop(digest, None)
                    branching.discard(digest)
            lost[digest] = lost.get(digest, 0) | bit
            if len(lost) >= half:
                lost = self._next_lost()

    def _lose(self, digest: int, key: str) -> None:
        lost = self.lost
        lost[digest] = lost.get(digest, 0) | self._bits[key]
        if len(lost) >= max(1, self.lost_cap // 2):
            self._next_lost()

    def _next_lost(self) -> dict[int, int]:
        """The recent half of the lost digests becomes the older one; a new recent one begins."""
        self.lost_before, self.lost = self.lost, {}
        return self.lost

    def evicted_run(self, key: str, digests: list[int], start: int) -> int:
        """How many blocks of ``digests`` from ``start`` on rank ``key`` held and lost, in a row."""
        bit = self._bits.get(key)
        if bit is None:
            return 0
        lost, before, run = self.lost, self.lost_before, 0
        for digest in digests[start:]:
            if not (lost.get(digest, 0) | before.get(digest, 0)) & bit:
                break
            run += 1
        return run

    def _disown(self, digest: int, key: str) -> None:
        holders = self.owners.get(digest)
        if holders is not None:
            holders &= ~self._bits[key]
            if holders:
                self.owners[digest] = holders
            else:
                del self.owners[digest]
                self.first_child.pop(digest, None)
                self.branching.discard(digest)

    def size(self, key: str) -> int:
        return len(self.ranks.get(key, ()))

    def room(self, key: str) -> int:
        """Blocks ``key`` can still take before its engine evicts (as far as this index knows)."""
        return self.capacity.get(key, self.default_capacity) - self.size(key)


# ----- the native core (csrc/prefix_core.c) ---------------------------------------------------
# the index's tables and the digests (prefix_core.c, which holds the module), the cache_aware
# policy's costs (cache_aware.c: apps/routing/decision/policies.py)
CORE_SOURCES = tuple(Path(__file__).parent / "csrc" / name
                     for name in ("prefix_core.c", "cache_aware.c"))  # fmt: skip
CORE_NAME = "dpmesh_prefix_core"
# no contraction of a * b + c into one fused step: the policy's costs must round as Python's do
CORE_CFLAGS = ("-O2", "-fPIC", "-shared", "-ffp-contract=off")
CORE_BUILD_WAIT_S = 120.0


def _core_key() -> str:
    digest = hashlib.sha256()
    for source in CORE_SOURCES:
        digest.update(source.read_bytes() + b"\0")
    for part in (
        *CORE_CFLAGS,
        sys.version,
        platform.machine(),
        sysconfig.get_config_var("EXT_SUFFIX"),
    ):
        digest.update(b"\0" + str(part).encode())
    return digest.hexdigest()[:16]


def _build_core(scratch: Path) -> Path:
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None:
        compiler = "cc"
    out = scratch / f"{CORE_NAME}.so"
    command = [compiler, *CORE_CFLAGS, "-I", sysconfig.get_paths()["include"],
               *map(str, CORE_SOURCES), "-o", str(out), "-lm"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip()[-2000:]}")
    return out


_core: dict[str, object] = {}  # "module" (None when unavailable), "error"


def core_module():
    """The compiled core (built on first call, imported from the cache after), or None: no
    compiler, a build error, or ``DPMESH_PURE_INDEX`` set. The failure is logged once."""
    if "module" in _core:
        return _core["module"]
    module = None
    try:
        if os.environ.get("DPMESH_PURE_INDEX"):
            raise RuntimeError("DPMESH_PURE_INDEX is set")
        built = native.cached_build(CORE_NAME, _core_key(), _build_core, CORE_BUILD_WAIT_S)
        module = native.import_file(CORE_NAME, built)
    except Exception as exc:  # compiler missing, build error, the wait ran out
        _core["error"] = f"{type(exc).__name__}: {str(exc).strip()[-2000:]}"
        if not os.environ.get("DPMESH_PURE_INDEX"):
            logger.warning(
                "native prefix index unavailable, using the pure one: %s", _core["error"]
            )
    _core["module"] = module
    return module


def _listed(digests) -> list[int]:
    """The digests as the core takes them: a list (the caller's own, not a copy, when it is one)."""
    return digests if type(digests) is list else list(digests)


class NativePrefixIndex:
    """The index over the C core: the same methods and results as ``PurePrefixIndex``. The
    pure index's dicts (``ranks``, ``owners``, ``first_child``, ``branching``, ``lost``,
    ``lost_before``) are snapshots here, built when read (for tests and inspection)."""

    def __init__(self, ttl_s: float = 600.0, default_capacity: int = 100_000, clock=time.monotonic):
        self.ttl_s, self.default_capacity, self.clock = ttl_s, default_capacity, clock
        self.capacity: dict[str, int] = {}
        self._core = core_module().Core(LOST_KEPT)
        self._bits: dict[str, int] = {}  # rank key -> its slot in the core (assigned once)
        self._keys: list[str] = []  # slot -> rank key
        # the ranks with an LRU, in the order the pure index's ``ranks`` has them (the order a
        # TTL sweep trims them in, which the lost digests' halves depend on)
        self._ranks: dict[str, int] = {}
        self._expires_at = float("inf")  # as the pure index's
        self._latest: dict[str, tuple[list[int], float]] = {}  # as the pure index's

    def _bit(self, key: str) -> int:
        slot = self._bits.get(key)
        if slot is None:
            slot = self._bits[key] = len(self._keys)
            self._keys.append(key)
        return slot

    def _named(self, mask: int) -> list[str]:
        return named(self._keys, mask)

    # ----- the pure index's state, as snapshots ----------------------------------------------
    @property
    def ranks(self) -> dict[str, OrderedDict[int, float]]:
        return {key: OrderedDict(self._core.items(slot)) for key, slot in self._ranks.items()}

    @property
    def owners(self) -> dict[int, int]:
        return self._core.table_dict(0)

    @property
    def first_child(self) -> dict[int, int]:
        return self._core.fan_out()[0]

    @property
    def branching(self) -> set[int]:
        return self._core.fan_out()[1]

    @property
    def lost(self) -> dict[int, int]:
        return self._core.table_dict(1)

    @property
    def lost_before(self) -> dict[int, int]:
        return self._core.table_dict(2)

    @property
    def lost_cap(self) -> int:
        return self._core.lost_cap

    @lost_cap.setter
    def lost_cap(self, cap: int) -> None:
        self._core.lost_cap = cap

    # ----- the index ----------------------------------------------------------------------------
    def set_capacity(self, key: str, blocks: int | None) -> None:
        self.capacity[key] = blocks or self.default_capacity
        self._trim(key)

    def holders(self, digest: int) -> set[str]:
        return set(self._named(self._core.holders(digest)))

    def match(self, digests: list[int], keys: list[str] | None = None) -> dict[str, int]:
        return self.lookup(digests, keys)[0]

    def shared_blocks(self, digests: list[int]) -> int:
        return self.lookup(digests, ())[1]

    def lookup(self, digests: list[int], keys=None) -> tuple[dict[str, int], int]:
        if self.clock() >= self._expires_at:
            self._expire()
        if keys is None:
            slots = None
        else:
            bits = self._bits
            slots = [bits[key] for key in keys if key in bits]
        return self._core.lookup(_listed(digests), self._keys, slots)

    def insert(self, key: str, digests: list[int]) -> None:
        now = self.clock()
        latest = self._latest.get(key)
        if latest is not None and now - latest[1] < RENEW_AFTER_S and latest[0] == digests:
            return
        digests = _listed(digests)
        self._expires_at = min(self._expires_at, now + self.ttl_s)
        slot = self._ranks.get(key)
        if slot is None:
            slot = self._ranks[key] = self._bit(key)
        self._latest[key] = (list(digests), now)
        capacity = self.capacity.get(key, self.default_capacity)
        if self._core.insert(slot, digests, now, capacity, self.clock() - self.ttl_s):
            self._latest.pop(key, None)  # blocks left: the latest chain may be one of them

    def remove(self, key: str, digests: list[int]) -> int:
        slot = self._ranks.get(key)
        if slot is None:
            return 0
        self._latest.pop(key, None)
        return self._core.remove(slot, _listed(digests))

    def replace(self, key: str, digests: list[int]) -> None:
        self._latest.pop(key, None)
        slot = self._ranks.get(key)
        if slot is None:
            slot = self._ranks[key] = self._bit(key)
        now = self.clock()
        self._expires_at = min(self._expires_at, now + self.ttl_s)
        self._core.replace(slot, _listed(digests), now)
        self._trim(key)

    def remove_rank(self, key: str) -> None:
        self._latest.pop(key, None)
        slot = self._ranks.pop(key, None)
        if slot is not None:
            self._core.remove_rank(slot)
        self.capacity.pop(key, None)

    def _expire(self) -> None:
        oldest = float("inf")
        for key, slot in list(self._ranks.items()):
            self._trim(key)
            first = self._core.oldest(slot)
            if first is not None:
                oldest = min(oldest, first)
        self._expires_at = oldest + self.ttl_s

    def _trim(self, key: str) -> None:
        slot = self._bits.get(key)
        if slot is None:
            return
        capacity = self.capacity.get(key, self.default_capacity)
        if self._core.trim(slot, capacity, self.clock() - self.ttl_s):
            self._latest.pop(key, None)  # blocks left: the latest chain may be one of them

    def evicted_run(self, key: str, digests: list[int], start: int) -> int:
        slot = self._bits.get(key)
        if slot is None:
            return 0
        return self._core.evicted_run(slot, _listed(digests), start)

    def size(self, key: str) -> int:
        slot = self._bits.get(key)
        return 0 if slot is None else self._core.size(slot)

    def room(self, key: str) -> int:
        return self.capacity.get(key, self.default_capacity) - self.size(key)


PrefixIndex = NativePrefixIndex if core_module() is not None else PurePrefixIndex


def main() -> int:
    """``python -m apps.routing.decision.index``: build the native core now (``make serve`` and
    ``make test`` do, so a router does not spend its start compiling); says which index routers
    use."""
    logging.basicConfig(level=logging.WARNING)
    if core_module() is None:
        print(f"prefix index: the pure one ({_core.get('error')})")
    else:
        print("prefix index: native core built")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
