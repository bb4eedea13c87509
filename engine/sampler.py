"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

import torch

from engine.sequence import Sequence


def _generator(seq: Sequence, default: torch.Generator) -> torch.Generator:
    """A seeded request draws from its own generator, so its output does not depend on what
    else shares the batch."""
    if seq.params.seed is None:
        return default
    gen = getattr(seq, "generator", None)
    if gen is None:
        gen = seq.generator = torch.Generator(device="cpu").manual_seed(seq.params.seed)
    return gen


def _filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # keep the token that crosses top_p
        drop = cum - torch.softmax(sorted_logits, dim=-1) >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def sample(logits: torch.Tensor, seqs: list[Sequence], default: torch.Generator) -> list[int]:
    """One token per row of ``logits`` ([n, vocab], float32) for the matching ``seqs``."""
    greedy = logits.argmax(dim=-1).tolist()
    out = []
    for i, seq in enumerate(seqs):
        p = seq.params
        if p.greedy:
            out.append(greedy[i])
            continue
        row = _filter(logits[i].cpu() / p.temperature, p.top_k, p.top_p)
        probs = torch.softmax(row, dim=-1)
        out.append(int(torch.multinomial(probs, 1, generator=_generator(seq, default)).item()))
    return out
