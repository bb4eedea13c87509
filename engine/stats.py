"""Prefix-cache statistics per engine, logged in ATOM's format."""

from __future__ import annotations

import logging
from dataclasses import dataclass


@dataclass
class CacheCounter:
    requests: int = 0
    cached_tokens: int = 0
    total_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.total_tokens if self.total_tokens else 0.0

    def line(self, label: str) -> str:
        return (
            f"[Cache Stats {label:<8}] Reqs: {self.requests}, Cached/Total tokens: "
            f"{self.cached_tokens}/{self.total_tokens}, Hit rate: {self.hit_rate * 100:.2f}%"
        )


class CacheStats:
    """Counts each request once, when it is first admitted: its prompt tokens and how many of
    them came from the prefix cache. Every ``interval`` requests it logs the interval's and the
    cumulative totals."""

    def __init__(self, logger: logging.Logger | logging.LoggerAdapter, interval: int = 100):
        self.logger = logger
        self.interval = interval
        self.total = CacheCounter()
        self.window = CacheCounter()

    def record(self, prompt_tokens: int, cached_tokens: int) -> None:
        for counter in (self.total, self.window):
            counter.requests += 1
            counter.cached_tokens += cached_tokens
            counter.total_tokens += prompt_tokens
        if self.interval and self.window.requests >= self.interval:
            self.logger.info(self.window.line("Interval"))
            self.logger.info(self.total.line(""))
            self.window = CacheCounter()
