"""Per-request sampling parameters, validated at construction (bad input fails before it queues)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` means greedy. ``top_k == 0`` or ``-1`` disables top-k.
    ``stop`` strings are matched on the detokenized output and are not included in it.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # the tenant's prefix-cache key (vLLM's ``cache_salt``): its blocks chain on
    # ``digests.namespace(cache_salt)``, so only requests with the same salt share them
    cache_salt: str | None = None
    # the LoRA adapter to run with (a ``--lora-modules`` name, vLLM's ``lora_name``; None: the
    # base model); its blocks chain on ``digests.namespace(cache_salt, lora_name)`` too
    lora_name: str | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        if (
            isinstance(self.max_tokens, bool)
            or not isinstance(self.max_tokens, int)
            or self.max_tokens <= 0
        ):
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if (
            not isinstance(self.temperature, (int, float))
            or isinstance(self.temperature, bool)
            or self.temperature < 0
        ):
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if (
            not isinstance(self.top_p, (int, float))
            or isinstance(self.top_p, bool)
            or not 0 < self.top_p <= 1
        ):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= -1, got {self.top_k!r}")
        if self.cache_salt is not None and not (
            isinstance(self.cache_salt, str) and self.cache_salt
        ):
            raise ValueError(f"cache_salt must be a non-empty string, got {self.cache_salt!r}")
        if self.lora_name is not None and not (isinstance(self.lora_name, str) and self.lora_name):
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1
