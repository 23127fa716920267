"""Fit the per-layer cost ``a·L + b·L² + c`` (per sequence) to measured batch times.

A timed batch of packed sequences with lengths L_i costs ``a·ΣL_i + b·ΣL_i² + c·n + d`` —
per token, per token², per sequence, and once per call (``d``: launch and bookkeeping cost
of a block call, paid once per rank per layer whatever the plan, so the planner ignores it).
The planner's additivity assumption is that the first three terms add up over sequences;
the calibrator measures it. The fit is least squares
on *relative* error (each row divided by its measured time) so that short sequences count as
much as long ones; coefficients are kept non-negative by refitting without any that come out
negative. The paper-style fit (single sequences, no intercept, absolute error) is here too,
for comparison. Pure numpy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from knapformer.cost_terms import batch_features

__all__ = ["Timing", "Fit", "check_lengths", "fit_cost", "fit_paper_style", "nonneg_lstsq"]


@dataclass(frozen=True)
class Timing:
    """One measured batch: the packed sequence lengths and the seconds it took."""

    seq_lens: tuple[int, ...]
    seconds: float


@dataclass(frozen=True)
class Fit:
    """Coefficients of ``a·L + b·L² + c`` per sequence plus ``d`` per call (seconds)."""

    a: float
    b: float
    c: float
    d: float = 0.0

    def predict(self, seq_lens: Sequence[int]) -> float:
        L = np.asarray(seq_lens, dtype=np.float64)
        return float(self.a * L.sum() + self.b * (L * L).sum() + self.c * L.size + self.d)

    def errors(self, timings: Sequence[Timing]) -> dict[str, float]:
        """R², median and max |relative error| over ``timings``."""
        meas = np.asarray([t.seconds for t in timings])
        pred = np.asarray([self.predict(t.seq_lens) for t in timings])
        rel = np.abs(pred - meas) / meas
        ss_tot = float(((meas - meas.mean()) ** 2).sum())
        r2 = 1.0 - float(((pred - meas) ** 2).sum()) / ss_tot if ss_tot > 0 else 1.0
        return {"r2": r2, "median_abs_rel": float(np.median(rel)), "max_abs_rel": float(rel.max())}


def check_lengths(lengths: object, name: str = "lengths") -> list[int]:
    """Non-empty list of positive ints, or a ValueError naming the bad entry."""
    if not isinstance(lengths, (list, tuple)) or not lengths:
        raise ValueError(f"{name} must be a non-empty list of positive integers")
    for i, v in enumerate(lengths):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
            raise ValueError(f"{name}[{i}] = {v!r} is not a positive integer")
    return [int(v) for v in lengths]


def _design(timings: Sequence[Timing]) -> np.ndarray:
    """One row per timing: the cost terms' features (``COST_TERMS`` order), then 1 (per call)."""
    return np.asarray([[*batch_features(t.seq_lens), 1.0] for t in timings])


def nonneg_lstsq(X: np.ndarray, y: np.ndarray, active: Sequence[int]) -> np.ndarray:
    """Least squares ``X·c ≈ y`` with ``c ≥ 0`` over the ``active`` columns (the others 0):
    solve, drop the columns that came out negative, solve again (the active-set shortcut every
    fit here uses: the offline calibrator and the online recalibration)."""
    coef = np.zeros(X.shape[1])
    active = list(active)
    while active:
        sol, *_ = np.linalg.lstsq(X[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            return coef
        active = [j for j, v in zip(active, sol) if v >= 0]
    return coef


def fit_cost(timings: Sequence[Timing], *, intercept: bool = True) -> Fit:
    """Least squares on relative error; ``intercept`` fits the per-sequence cost c and the
    per-call cost d (they are told apart by batches holding several sequences)."""
    need = 4 if intercept else 2
    if len(timings) < need:
        raise ValueError(f"need at least {need} timings to fit, got {len(timings)}")
    if any(not (math.isfinite(t.seconds) and t.seconds > 0) for t in timings):
        raise ValueError("every timing must be a positive, finite number of seconds")
    X = _design(timings)
    y = np.asarray([t.seconds for t in timings])
    w = 1.0 / y
    coef = nonneg_lstsq(X * w[:, None], y * w, [0, 1, 2, 3] if intercept else [0, 1])
    return Fit(a=float(coef[0]), b=float(coef[1]), c=float(coef[2]), d=float(coef[3]))


def fit_paper_style(timings: Sequence[Timing]) -> Fit:
    """The paper's procedure: single-sequence timings, no intercept, absolute least squares."""
    single = [t for t in timings if len(t.seq_lens) == 1]
    if len(single) < 2:
        raise ValueError("the paper-style fit needs at least 2 single-sequence timings")
    X = _design(single)
    y = np.asarray([t.seconds for t in single])
    coef = nonneg_lstsq(X, y, [0, 1])
    return Fit(a=float(coef[0]), b=float(coef[1]), c=0.0)
