"""A request's plain state inside one engine: tokens, blocks, progress. No torch here."""

from __future__ import annotations

import enum
import itertools

from engine.digests import block_digest, namespace
from engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One request. ``token_ids`` holds prompt then output; KV exists for the first
    ``num_computed_tokens`` of them, in the blocks listed by ``block_table``."""

    _ids = itertools.count()

    def __init__(
        self,
        token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        block_size: int = 16,
    ):
        self.seq_id = next(Sequence._ids)
        self.request_id = request_id if request_id is not None else str(self.seq_id)
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.params = params
        self.block_size = block_size
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first admission
        self.admitted = False  # True once first scheduled (stats count a request once)
        self.num_preemptions = 0
        self.prefill_chunks: list[tuple[float, float, int]] = []  # for traces (llm_engine.step)
        self.finish_reason: str | None = None
        self._digests: list[int] = []
        # the first block's parent: its tenant (salt) and adapter, whose KV is not the base model's
        self.namespace = namespace(params.cache_salt, params.lora_name)

    def __repr__(self):
        return (
            f"Sequence(id={self.seq_id}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, "
            f"blocks={self.block_table}, status={self.status.value})"
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def block_tokens(self, i: int) -> list[int]:
        return self.token_ids[i * self.block_size : (i + 1) * self.block_size]

    def digest(self, i: int) -> int:
        """Digest of full block ``i``, computed once and memoised (tokens never change once
        full)."""
        while len(self._digests) <= i:
            j = len(self._digests)
            parent = self._digests[j - 1] if j else self.namespace
            self._digests.append(block_digest(parent, self.block_tokens(j)))
        return self._digests[i]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
