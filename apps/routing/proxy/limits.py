"""What one request may cost the router, whatever it carries: the limits on its body and on its
prompt, taken from what the fleet can take.

- The body: no larger than the largest body some worker takes. A worker that reports its own
  limit (our engine's ``max_request_body_bytes``) is held to it; one that reports only its
  ``max_model_len`` takes ``max_model_len x BYTES_PER_TOKEN + BODY_OVERHEAD_BYTES`` (a prompt the
  model can take needs no more: 64 bytes a token covers JSON-escaped non-Latin text, ~12 bytes a
  token, five times over); one that reports neither, ``BODY_CAP_BYTES`` (vLLM's and SGLang's
  servers set no limit; 16 MiB is LiteLLM's and most proxies' order of size). A
  ``Content-Length`` past it is answered 413 before the body is read.
- The prompt: tokenizing stops as soon as the prompt is known to hold more tokens than the
  longest ``max_model_len`` of the workers that serve its model (engine.tokenize_cache
  ``encode_text``'s ``limit``), and the request is answered 400 in the engine's words: no worker
  could take it. The router's CPU for it is bounded by that length, not by the prompt. Where some
  candidate's ``max_model_len`` is not known, nothing is refused here, and tokenizing stops at
  request_shape's ``ROUTING_TOKEN_CAP`` all the same: past it the request is routed on its text.
- Large bodies at once: each body of ``LARGE_BODY_BYTES`` or more holds its declared size
  against ``LARGE_BODIES_BUDGET_BYTES`` (this process's, from before it is read until the request
  ends); one that would go past is answered 503 with ``Retry-After``, without being read.
"""

from __future__ import annotations

from apps.routing.decision.fleet import WorkerView

BODY_CAP_BYTES = 16 * 2**20
BYTES_PER_TOKEN = 64
BODY_OVERHEAD_BYTES = 2**20  # messages' JSON, tools, sampling fields
LARGE_BODY_BYTES = 2**20
LARGE_BODIES_BUDGET_BYTES = 64 * 2**20


def worker_body_limit(worker: WorkerView) -> int:
    """The largest request body ``worker`` is taken to accept."""
    limit = BODY_CAP_BYTES
    if worker.max_model_len:
        limit = worker.max_model_len * BYTES_PER_TOKEN + BODY_OVERHEAD_BYTES
    if worker.max_body_bytes:
        limit = min(limit, worker.max_body_bytes)
    return limit


def body_limit(workers) -> int:
    """The largest body any of ``workers`` (``WorkerView``s) accepts; ``BODY_CAP_BYTES`` when
    there are none yet."""
    return max((worker_body_limit(w) for w in workers), default=BODY_CAP_BYTES)


def prompt_limit(targets) -> int | None:
    """The longest ``max_model_len`` of the workers behind ``targets``: a prompt of more tokens
    fits none of them. None when some worker's is not known (or there are none)."""
    lengths = [t.worker.max_model_len for t in targets]
    if not lengths or None in lengths:
        return None
    return max(lengths)


class LargeBodies:
    """The bytes of large request bodies this process holds at once, within a budget."""

    def __init__(self, budget: int = LARGE_BODIES_BUDGET_BYTES, large: int = LARGE_BODY_BYTES):
        self.budget, self.large, self.held = budget, large, 0

    def take(self, size: int | None) -> int:
        """Hold ``size`` bytes (a declared ``Content-Length``) and return what to give back;
        0 for a small or undeclared body (a chunked body is bounded by the body limit alone).
        ``OverflowError`` when the budget cannot hold it now."""
        if not size or size < self.large:
            return 0
        if self.held + size > self.budget:
            raise OverflowError(
                f"{self.held} bytes of large request bodies are being served; "
                f"{size} more would pass this router's {self.budget} (retry shortly)"
            )
        self.held += size
        return size

    def give_back(self, size: int) -> None:
        self.held -= size
