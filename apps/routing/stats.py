"""Per-target routing statistics, kept in memory on the hot path and persisted periodically."""
from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class TargetStats:
    requests: int = 0  # dispatched
    prompt_tokens: int = 0
    predicted_tokens: int = 0  # prompt tokens the router's index expected the engine to have cached
    completed: int = 0
    errors: int = 0
    reported: int = 0  # completed requests whose engine reported usage
    cached_tokens: int = 0  # prompt tokens the engine reported as cached

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class RouterStats:
    def __init__(self):
        self.targets: dict[str, TargetStats] = {}
        self.retries = 0
        self.no_target = 0

    def _get(self, key: str) -> TargetStats:
        stats = self.targets.get(key)
        if stats is None:
            stats = self.targets[key] = TargetStats()
        return stats

    def dispatched(self, key: str, prompt_tokens: int, predicted_tokens: int) -> None:
        s = self._get(key)
        s.requests += 1
        s.prompt_tokens += prompt_tokens
        s.predicted_tokens += predicted_tokens

    def finished(self, key: str, *, ok: bool, cached_tokens: int | None) -> None:
        s = self._get(key)
        if not ok:
            s.errors += 1
            return
        s.completed += 1
        if isinstance(cached_tokens, int):
            s.reported += 1
            s.cached_tokens += cached_tokens

    def snapshot(self) -> dict[str, dict]:
        return {key: s.as_dict() for key, s in self.targets.items()}
