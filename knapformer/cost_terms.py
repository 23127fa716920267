"""The terms of the compute cost, named once: what each counts, and which coefficient prices it.

A rank's compute time is ``Σ_term coefficient · feature``: the planner prices a plan's
per-rank features with it (``RankFeatures.cost``), the online fit (``plan.online``) and the
offline calibrator (``workload_fit``) solve for the coefficients from measured times, and the
lower bounds use the same model. Each of them reads the terms from :data:`COST_TERMS`, in this
order, instead of knowing that index 1 is attention — so a new term is one line here, one
field of :class:`~knapformer.plan.plan.RankFeatures` and the coefficient it names.

Legend: L the lengths of the sequences one rank runs whole (a timed batch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from knapformer.workload import WorkloadModel

__all__ = ["COST_TERMS", "CostTerm", "batch_features", "coefficients", "with_coefficients"]


@dataclass(frozen=True)
class CostTerm:
    """One term of the per-layer compute cost."""

    name: str
    """The feature's name (a field of ``RankFeatures``)."""
    coef: str
    """The ``WorkloadModel`` property that prices one unit of the feature."""
    field: str
    """The ``WorkloadModel`` field a fitted value is written to."""
    of_batch: Callable[[np.ndarray], float]
    """The feature of one rank running the sequences ``L`` whole (calibration batches)."""
    grows: bool
    """The feature grows with a sequence's length (a fit with none of these is degenerate)."""
    doc: str


COST_TERMS: tuple[CostTerm, ...] = (
    CostTerm("tokens", "linear_coef", "linear", lambda L: float(L.sum()), True, "tokens held (token-wise matmuls)"),
    CostTerm("attn", "quad_coef", "quadratic", lambda L: float((L * L).sum()), True, "Σ L²/k of its groups' sequences"),
    CostTerm("seqs", "per_seq_coef", "per_seq", lambda L: float(L.size), False, "sequences run (per-call costs)"),
)


def coefficients(model: WorkloadModel) -> np.ndarray:
    """(terms,) the model's coefficient of each term, in :data:`COST_TERMS` order."""
    return np.asarray([getattr(model, t.coef) for t in COST_TERMS], dtype=np.float64)


def with_coefficients(model: WorkloadModel, values, **changes) -> WorkloadModel:
    """``model`` with each term's coefficient set to ``values`` (in :data:`COST_TERMS` order),
    as explicit overrides that replace the paper form (and the cross-attention term, which a
    fitted coefficient already contains); ``changes`` are further fields to replace."""
    fields = {t.field: float(v) for t, v in zip(COST_TERMS, values, strict=True)}
    return dataclasses.replace(model, **fields, context_len=0, cross=None, gamma=1.0, **changes)


def batch_features(seq_lens) -> np.ndarray:
    """(terms,) the features of one rank running ``seq_lens`` whole."""
    L = np.asarray(seq_lens, dtype=np.float64)
    return np.asarray([t.of_batch(L) for t in COST_TERMS])
