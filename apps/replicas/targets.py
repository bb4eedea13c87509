"""How a routing target is named, with no Django in the way: the routing decision imports it, and
so do the replicas' models."""

from __future__ import annotations


def target_key(url: str, rank: int | None) -> str:
    """How a routing target is named everywhere (metrics, the index, the dashboard, headers):
    ``url@rank`` for a DP rank, the bare URL for a worker routed as one target (``url`` as
    recorded: services.normalize_url strips its trailing slash)."""
    return url if rank is None else f"{url}@{rank}"
