"""vLLM's KV events, read into the router's own digests (the precise mode for vLLM workers).

vLLM publishes each DP rank's cache changes on a ZMQ PUB socket of its own (base port + rank):
messages of three frames ``[topic, seq (8 bytes big-endian, per rank), msgpack payload]``, the
payload ``[ts, events, data_parallel_rank]``. Events are maps with a ``"type"`` (vLLM 0.11+; fields
at their default may be left out) or, from older vLLM and SGLang, positional arrays
``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, ...]``; both are read
(``../shared/vllm-cpu.md``).

vLLM's block hashes are its own (sha256 over pickled tuples, or xxhash, seeded per process). The
router never tries to reproduce them: from each ``BlockStored``'s ``token_ids`` it computes its own
chained digests (engine/digests.py), following ``parent_block_hash`` through a per-rank map
engine hash -> digest, which also resolves ``BlockRemoved``. So the index speaks one language
whatever the engine hashes with, and a block size the router did not expect is caught (the events
carry theirs) instead of silently matching nothing.

``RankDecoder`` is the pure part (one per target); ``follow`` reads one rank's socket into it and
hands the translated batches to the KV-event feed (apps/routing/feeds/kv_events.py), which applies
them with the same semantics as our own engine's events.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import msgspec

from engine.digests import block_digest, namespace

logger = logging.getLogger(__name__)

_decoder = msgspec.msgpack.Decoder()
POSITIONAL = {  # field order of the array form, after the type name
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
    ),
    "BlockRemoved": ("block_hashes",),
    "AllBlocksCleared": (),
}
MISMATCH_AFTER_BLOCKS = 16  # stored blocks of which none was ever routed: the digests differ
RECENT_ROUTED = 65_536  # routed digests remembered per rank for that check
CLOCK_SLACK_S = 1.0  # vLLM's batch stamps vs this host's clock


@dataclass
class Translated:
    """One message in the feed's terms: ``events`` as ``[("stored"|"removed", digests)]``;
    ``cleared``: the rank's cache is empty now (before the events); ``gap``: messages were lost
    before this one, so the rank's set is not known exactly any more."""

    events: list[tuple[str, list[int]]] = field(default_factory=list)
    cleared: bool = False
    gap: bool = False


def chain_namespace(first_extra, lora_name) -> int | None:
    """The router's parent for a chain's first block (engine/digests.py ``namespace``) from what
    vLLM says of it: its ``extra_keys`` entry holds, untagged and in order, the LoRA name (when
    ``lora_name`` is set), multimodal ``(id, offset)`` pairs, the ``cache_salt`` and prompt
    embedding digests (bytes); the salt is the first string after the LoRA name. The router keys
    a request's salt and adapter the same way (request_shape.tenant_namespace), so a salted or
    adapted vLLM block is that tenant's, never another's."""
    keys = list(first_extra or ())
    if lora_name and keys and keys[0] == lora_name:
        keys = keys[1:]
    salt = next((k for k in keys if isinstance(k, str) and k), None)
    return namespace(salt, lora_name or None)


class RankDecoder:
    """One vLLM rank's events -> the router's digests, with the engine-hash map and the checks."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.digest_of: dict = {}  # engine block hash -> our digest
        self.last_seq: int | None = None
        self.unresolved = 0  # stored blocks whose parent was never seen (after a gap, or a start)
        self.mismatch: str | None = None  # why the events cannot match the router's digests
        self.stored_blocks = 0
        self.routed_hits = 0  # stored digests the router had routed there: the languages agree
        self.recent_routed: OrderedDict[int, None] = OrderedDict()  # bounded, newest last
        self.routed_blocks = 0
        self.first_routed_at: float | None = None  # wall clock, as vLLM stamps its batches
        self.batch_ts: float | None = None  # the stamp of the message being decoded
        self.restarts = 0  # how often the sequence started over (a new vLLM process)
        self.checked_blocks = 0  # stored since the router first routed here

    def routed(self, digests: list[int]) -> None:
        """The router sent a request with these block digests to this rank."""
        if self.first_routed_at is None:
            self.first_routed_at = time.time()
        self.routed_blocks += len(digests)
        recent = self.recent_routed
        for digest in digests:
            recent[digest] = None
            recent.move_to_end(digest)
        while len(recent) > RECENT_ROUTED:
            recent.popitem(last=False)

    def decode(self, seq: int, payload: bytes) -> Translated:
        out = Translated(gap=self.last_seq is not None and seq > self.last_seq + 1)
        if self.last_seq is not None and seq <= self.last_seq:
            # the sequence started over: a new publisher, so a new vLLM process, its cache empty
            self.digest_of.clear()
            out.cleared = True
            self.restarts += 1
        self.last_seq = seq
        message = _decoder.decode(payload)
        stamp = message[0] if isinstance(message, list) and message else None
        self.batch_ts = stamp if isinstance(stamp, int | float) else None
        events = message[1] if isinstance(message, list) and len(message) >= 2 else []
        stored: list[int] = []
        for event in events:
            kind, fields = _event_fields(event)
            if kind == "BlockStored":
                stored += self._stored(fields)
            elif kind == "BlockRemoved":
                if stored:  # keep the order: what was stored before this removal goes first
                    out.events.append(("stored", stored))
                    stored = []
                gone = [
                    self.digest_of.pop(h)
                    for h in fields.get("block_hashes") or ()
                    if h in self.digest_of
                ]
                if gone:
                    out.events.append(("removed", gone))
            elif kind == "AllBlocksCleared":
                out.events, stored = [], []
                self.digest_of.clear()
                out.cleared = True
        if stored:
            out.events.append(("stored", stored))
        return out

    def _stored(self, fields: dict) -> list[int]:
        hashes = fields.get("block_hashes") or []
        tokens = fields.get("token_ids") or []
        size = fields.get("block_size") or self.block_size
        if size != self.block_size:
            self.mismatch = (
                f"vLLM stores blocks of {size} tokens; the router digests blocks of "
                f"{self.block_size} (set the worker's block_size)"
            )
            return []
        parent_hash = fields.get("parent_block_hash")
        parent = None
        if parent_hash is None:  # a chain's first block: its tenant's namespace, if any
            extra = fields.get("extra_keys") or ()
            parent = chain_namespace(extra[0] if extra else None, fields.get("lora_name"))
        else:
            parent = self.digest_of.get(parent_hash)
            if parent is None:  # a chain we joined midway: its digests cannot be computed
                self.unresolved += len(hashes)
                return []
        digests = []
        for i, engine_hash in enumerate(hashes):
            block = tokens[i * size : (i + 1) * size]
            if len(block) < size:
                break
            parent = block_digest(parent, block)
            self.digest_of[engine_hash] = parent
            digests.append(parent)
        self.stored_blocks += len(digests)
        return digests

    def check_language(self, stored: list[int]) -> None:
        """Called with the digests just stored: once the router has sent many blocks here and
        none of the many the engine stored is one of them, the router's tokenizer or chat
        template is not the engine's (the anchors' silent-0 % failure): say so. (Blocks other
        clients sent vLLM directly never match; they do not count against it, nor do blocks
        stored before the router first routed here: a replay brings the rank's history.)"""
        if self.first_routed_at is None or (
            self.batch_ts is not None and self.batch_ts < self.first_routed_at - CLOCK_SLACK_S
        ):
            return
        self.checked_blocks += len(stored)
        self.routed_hits += sum(1 for d in stored if d in self.recent_routed)
        if (
            self.routed_hits == 0
            and self.checked_blocks >= MISMATCH_AFTER_BLOCKS
            and self.routed_blocks >= MISMATCH_AFTER_BLOCKS
            and not self.mismatch
        ):
            self.mismatch = (
                f"{self.checked_blocks} blocks stored and none matches what the router sent: "
                "its tokenizer or chat template differs from the engine's (tokenizer_path)"
            )


def _event_fields(event) -> tuple[str | None, dict]:
    if isinstance(event, dict):
        return event.get("type"), event
    if isinstance(event, list) and event and isinstance(event[0], str):
        names = POSITIONAL.get(event[0], ())
        return event[0], dict(zip(names, event[1:], strict=False))
    return None, {}


async def follow(endpoint: str, on_message, *, topic: bytes = b"", replay: str | None = None):
    """Read one rank's publisher until cancelled; ``on_message(seq, payload)`` per message, in
    sequence order. ZMQ reconnects by itself; a reader that hears nothing keeps waiting (vLLM is
    silent while idle), and the caller's reconcile loop replaces it when the worker changes.

    With the rank's ``replay`` socket, what was missed is fetched before a message is handed on:
    at the first message (everything the publisher still buffers: the rank's state, not just what
    happens from now on), after a gap, and after the sequence started over (vLLM restarted and its
    first messages went out before ZMQ had reconnected). Without one, the decoder counts the gap."""
    import zmq
    import zmq.asyncio

    context = zmq.asyncio.Context.instance()  # the replay's
    # the feed's socket is a plain one, read when the loop sees its descriptor ready: one rank's
    # message a request, and pyzmq's asyncio socket spends ~70 us of the loop's CPU on each
    # (a future, its flags), a non-blocking read ~45 us
    socket = zmq.Context.instance().socket(zmq.SUB)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SUBSCRIBE, topic)
    socket.connect(endpoint)
    logger.info("following vLLM's KV events at %s", endpoint)
    last: int | None = None

    def deliver(seq: int, payload: bytes) -> None:
        try:
            on_message(seq, payload)
        except (msgspec.DecodeError, ValueError, TypeError) as exc:
            logger.warning("undecodable KV-event message from %s: %r", endpoint, exc)

    loop = asyncio.get_running_loop()
    readable = asyncio.Event()
    descriptor = socket.getsockopt(zmq.FD)
    loop.add_reader(descriptor, readable.set)
    try:
        while True:
            try:
                frames = socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                # ZMQ's descriptor signals edges: wait only when its events say nothing is left
                readable.clear()
                if not socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    await readable.wait()
                continue
            if len(frames) != 3:
                continue
            seq = int.from_bytes(frames[1], "big", signed=True)
            missed_from = 0 if last is None or seq <= last else last + 1
            if replay and seq > missed_from:
                for old_seq, payload in await fetch_replay(context, replay, missed_from, seq):
                    deliver(old_seq, payload)
            deliver(seq, frames[2])
            last = seq
    except asyncio.CancelledError:
        raise
    finally:
        loop.remove_reader(descriptor)
        socket.close(linger=0)


REPLAY_TIMEOUT_S = 2.0


async def fetch_replay(context, endpoint: str, start: int, stop: int) -> list[tuple[int, bytes]]:
    """The messages ``start <= seq < stop`` a vLLM rank still buffers, from its ROUTER replay
    socket: ask with the start seq (8 bytes, big-endian); it answers ``(topic, seq, payload)``
    per message, then seq -1. What does not arrive within ``REPLAY_TIMEOUT_S`` stays missed."""
    import zmq

    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(endpoint)
    found: list[tuple[int, bytes]] = []
    try:
        await socket.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
        while await socket.poll(REPLAY_TIMEOUT_S * 1000):
            frames = await socket.recv_multipart()
            if len(frames) != 4:
                continue
            seq = int.from_bytes(frames[2], "big", signed=True)
            if seq < 0:
                return found
            if start <= seq < stop:
                found.append((seq, frames[3]))
        logger.warning("replay from %s did not finish within %.0f s", endpoint, REPLAY_TIMEOUT_S)
        return found
    finally:
        socket.close(linger=0)
