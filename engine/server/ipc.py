"""Typed messages between the front process and its DP rank processes.

They travel pickled over one-way ``multiprocessing`` pipes that the front creates per rank, so
nothing is named on the filesystem and two engines on one host cannot collide.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.llm_engine import RequestOutput
from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class PullKV:
    """Where a decode rank fetches a prompt's blocks (engine/kv_transfer.py): the prefill rank's
    listener, the request id its blocks are held under, and how many full blocks it holds."""

    host: str
    port: int
    request_id: str  # the key the blocks are held under (SGLang's protocol: the room's)
    num_blocks: int | None  # None: not said (SGLang's protocol); the prompt's full blocks
    wait_s: float = 0.0  # how long the prefill may still take (SGLang's: legs run at once)


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    hold_key: str | None = None  # a prefill for a remote decode: hold its blocks under this
    pull: PullKV | None = None  # a decode of a remote prefill: pull its blocks first
    cached_tokens: int | None = None  # what to report as cached (a decode: its prefill's)


@dataclass(frozen=True)
class Embed:
    """Embed each of ``inputs`` (token ids): the model's last hidden state at the last token,
    L2-normalized (``ModelRunner.embed``). Answered by one ``Embedded``."""

    request_id: str
    inputs: list[list[int]]


@dataclass(frozen=True)
class Embedded:
    request_id: str
    vectors: list[list[float]] | None
    error: str | None = None  # the rank cannot embed (a simulated engine): a 400


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class ReleaseHeld:
    """A prefill's held blocks given up (its decode leg will not come: the router says so through
    the bootstrap listener): released now, unless a pull has them."""

    key: str


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class RankReady:
    rank: int
    num_kv_blocks: int
    max_model_len: int
    pid: int
    kv_port: int | None = None  # a prefill rank's KV listener (engine/kv_transfer.py)


@dataclass(frozen=True)
class RankStats:
    """A snapshot of one rank's scheduler and KV pool."""

    rank: int
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_cached: int
    kv_blocks_total: int
    num_preemptions: int
    prefix_cache_requests: int
    prefix_cache_prompt_tokens: int
    prefix_cache_cached_tokens: int
    # prefill/decode disaggregation (engine/kv_transfer.py)
    kv_held_requests: int = 0  # prefills whose blocks wait for a decode rank to pull them
    kv_blocks_sent: int = 0
    kv_bytes_sent: int = 0
    kv_blocks_pulled: int = 0
    kv_bytes_pulled: int = 0
    kv_pull_seconds: float = 0.0  # the decode side's time pulling, summed


@dataclass(frozen=True)
class Outputs:
    """Everything one engine step produced, plus requests the rank refused or lost."""

    rank: int
    outputs: list[RequestOutput]
    # request_id -> message (a request it could not accept: 400) or (message, HTTP status)
    errors: dict[str, str | tuple[str, int]]
    stats: RankStats | None = None
    # the block manager's KV events since the last message, in order:
    # ("stored" | "removed", digests)
    kv_events: list[tuple[str, list[int]]] | None = None
