"""Typed messages between the front process and its DP rank processes.

They travel pickled over one-way ``multiprocessing`` pipes that the front creates per rank, so
nothing is named on the filesystem and two engines on one host cannot collide.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.llm_engine import RequestOutput
from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class RankReady:
    rank: int
    num_kv_blocks: int
    max_model_len: int
    pid: int


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


@dataclass(frozen=True)
class Outputs:
    """Everything one engine step produced, plus requests the rank refused or lost."""

    rank: int
    outputs: list[RequestOutput]
    errors: dict[str, str]  # request_id -> message (e.g. a request it could not accept)
    stats: RankStats | None = None
    # the block manager's KV events since the last message, in order:
    # ("stored" | "removed", digests)
    kv_events: list[tuple[str, list[int]]] | None = None
