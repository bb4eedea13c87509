"""How long one engine step takes, from what the scheduler put in it.

A step of a continuous-batching engine is one forward pass over a mixed batch: prefill chunks
(the uncached prompt tokens computed this step) and single-token decodes. Its time is modeled as

    t = base + a * prefill_tokens + b * decode_seqs + c * context_tokens + d * prefill_pairs

- ``base``: what every step pays whatever its size. On a GPU that is reading the weights once
  (decode is memory-bound) plus launch and sampling overhead; on our CPU it is Python and
  per-layer dispatch.
- ``a``, ``b``: the per-token matmul work of a prefill token and of a decode token.
- ``c``: reading the KV cache. Every scheduled sequence attends its whole context, cached prefix
  included, so a decode step's cost grows with the context lengths in the batch.
- ``d``: the quadratic part of prefill attention. A chunk of ``q`` tokens after ``s`` computed ones
  scores ``q*s + q*(q+1)/2`` query-key pairs. For Llama-3.1-8B that is 4 * 128 * 32 * 32 = 0.5 MFLOP
  per pair against 14 GFLOP per token for the matmuls, so it is invisible at 1k tokens but
  about as large as the linear part at 32k: long-context prefills (Mooncake-style traces) are
  wrong by 2x without it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import NamedTuple


class StepShape(NamedTuple):
    """The quantities of one step that its time depends on."""

    prefill_tokens: int  # tokens of prefill chunks computed this step (cache hits excluded)
    decode_seqs: int  # sequences decoding one token
    context_tokens: int  # sum over scheduled sequences of the context they attend
    prefill_pairs: int  # query-key pairs scored by the prefill chunks


def chunk_pairs(start: int, num_tokens: int) -> int:
    """Query-key pairs of causal attention for ``num_tokens`` queries after ``start`` keys."""
    return num_tokens * start + num_tokens * (num_tokens + 1) // 2


def shape_of(batch) -> StepShape:
    """The shape of a ``ScheduledBatch`` (engine.scheduler)."""
    prefill = decode = context = pairs = 0
    for item in batch.items:
        context += item.start + item.num_tokens
        if item.is_prefill:
            prefill += item.num_tokens
            pairs += chunk_pairs(item.start, item.num_tokens)
        else:
            decode += 1
    return StepShape(prefill, decode, context, pairs)


@dataclass(frozen=True)
class StepCost:
    """The coefficients of the step-time model, in seconds (per unit)."""

    base_s: float
    per_prefill_token_s: float
    per_decode_seq_s: float
    per_context_token_s: float
    per_prefill_pair_s: float = 0.0

    def seconds(self, shape: StepShape) -> float:
        """Modeled duration of a step of this shape (0 for an empty step)."""
        if not (shape.prefill_tokens or shape.decode_seqs):
            return 0.0
        return (
            self.base_s
            + self.per_prefill_token_s * shape.prefill_tokens
            + self.per_decode_seq_s * shape.decode_seqs
            + self.per_context_token_s * shape.context_tokens
            + self.per_prefill_pair_s * shape.prefill_pairs
        )

    def as_dict(self) -> dict[str, float]:
        return asdict(self)
