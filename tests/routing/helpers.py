"""Hand-built fleets for the router's unit tests: no database, no processes."""

from __future__ import annotations

from apps.routing.decision.fleet import Target, WorkerView
from apps.routing.decision.load import RankLoad


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def worker_view(
    worker_id: int = 1,
    *,
    url: str | None = None,
    model: str = "tiny",
    dp_size: int = 2,
    dp_aware: bool = True,
    block_size: int | None = 16,
    tokenizer_path: str | None = None,
    capacity_blocks: int | None = 64,
    **extra,
) -> WorkerView:
    return WorkerView(
        worker_id=worker_id,
        url=url or f"http://w{worker_id}",
        api_key="",
        model=model,
        model_aliases={model},
        dp_size=dp_size,
        dp_aware=dp_aware,
        block_size=block_size,
        tokenizer_path=tokenizer_path,
        capacity_blocks=capacity_blocks,
        **extra,
    )


def targets(n: int, worker_id: int = 1, clock: Clock | None = None) -> list[Target]:
    view = worker_view(worker_id, dp_size=n)
    clock = clock or Clock()
    return [Target(view, rank, load=RankLoad(clock=clock)) for rank in range(n)]


def use_clock(targets_: list[Target], clock: Clock) -> None:
    """Give targets built by a Fleet fresh loads on ``clock`` (before any request)."""
    for target in targets_:
        target.load = RankLoad(clock=clock)
