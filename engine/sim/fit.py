"""Fit the step-time model's coefficients to measured steps, by least squares.

The measuring is ``python -m engine.fit_step_time``: it drives the real engine, so it lives
above ``engine.llm_engine``; this module only does the arithmetic, on ``engine.sim.step_time``'s
shapes, and like the rest of ``engine.sim`` never imports the engine (which imports
``engine.sim.runner``).
"""

from __future__ import annotations

import numpy as np

from engine.sim.step_time import StepCost, StepShape

FEATURES = ("base_s", "per_prefill_token_s", "per_decode_seq_s", "per_context_token_s")
PAIRS = "per_prefill_pair_s"


def design(shapes: list[StepShape], with_pairs: bool) -> np.ndarray:
    rows = [[1.0, s.prefill_tokens, s.decode_seqs, s.context_tokens] for s in shapes]
    if with_pairs:
        for row, s in zip(rows, shapes, strict=True):
            row.append(s.prefill_pairs)
    return np.asarray(rows, dtype=float)


def fit_cost(shapes: list[StepShape], seconds: list[float], with_pairs: bool = True) -> StepCost:
    """Least-squares coefficients, none negative: a term whose coefficient comes out below zero
    (noise on a term this engine barely pays) is dropped and the rest refitted."""
    names = FEATURES + ((PAIRS,) if with_pairs else ())
    x, y = design(shapes, with_pairs), np.asarray(seconds, dtype=float)
    keep = list(range(len(names)))
    while True:
        coef, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
        negative = [k for k, c in zip(keep, coef, strict=True) if c < 0]
        if not negative:
            break
        keep.remove(negative[0])
    values = dict.fromkeys(names, 0.0)
    values.update({names[k]: float(c) for k, c in zip(keep, coef, strict=True)})
    return StepCost(**values)


def fit_error(cost: StepCost, shapes: list[StepShape], seconds: list[float]) -> dict[str, float]:
    """RMS and mean relative error of ``cost`` on the samples, and R^2."""
    y = np.asarray(seconds)
    pred = np.asarray([cost.seconds(s) for s in shapes])
    resid = pred - y
    total = float(((y - y.mean()) ** 2).sum())
    return {
        "rms_ms": float(np.sqrt((resid**2).mean()) * 1e3),
        "mean_rel_pct": float((np.abs(resid) / y).mean() * 100),
        "max_rel_pct": float((np.abs(resid) / y).max() * 100),
        "r2": 1.0 - float((resid**2).sum()) / total if total else 1.0,
    }
