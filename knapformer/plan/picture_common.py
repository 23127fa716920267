"""What both plan pictures share (:mod:`knapformer.plan.picture`, per rank, and
:mod:`knapformer.plan.picture_bands`, in bands of ranks): the time axis (seconds when the plan
carries its links or a cost model in seconds, else cost units), each group member's share of
a sequence's cost, figure widths and labels. matplotlib is imported only when drawing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from knapformer.plan.seqindex import DST, LEN, group_arrays
from knapformer.plan.validate import PlanForm

__all__ = [
    "DPI",
    "PER_RANK_MAX",
    "TimeAxis",
    "figure_width",
    "member_shares",
    "plt_agg",
    "seq_label",
    "stats_line",
    "time_axis",
]

PER_RANK_MAX = 64
"""Most ranks drawn one bar each; larger plans are drawn in bands."""
_MAX_WIDTH_IN = 14.8
"""Widest plot area (inches; the keys beside it add 3.2): 18 in at 110 dpi is 1,980 px."""
DPI = 110


def figure_width(num_bars: int) -> float:
    """Figure width in inches for ``num_bars`` bars and the keys beside them (at most 18)."""
    return min(max(6.0, 0.22 * num_bars + 2), _MAX_WIDTH_IN) + 3.2


@dataclass(frozen=True)
class TimeAxis:
    """How plan times are drawn: ``factor`` × a plan time is the height, ``label`` the y-label,
    ``unit`` what the numbers are in ("s", "ms", "µs", "cost units" or "" for token shares)."""

    factor: float
    unit: str
    label: str

    @property
    def in_seconds(self) -> bool:
        return self.unit in ("s", "ms", "µs")


def time_axis(plan: PlanForm) -> TimeAxis:
    """Seconds of all the model's layers when the plan carries a link (``units_per_second``)
    or its cost model is in seconds (profile meta ``units``), else the cost model's units."""
    model = plan.cost_model
    if model is None:  # an old plan file without its model: token shares
        return TimeAxis(1.0, "", "predicted time")
    link = getattr(plan, "link", None)
    if link is not None:
        per_second = float(link.units_per_second)
    elif str(model.meta.get("units", "")).startswith("seconds"):
        per_second = 1.0
    else:
        return TimeAxis(1.0, "cost units", "predicted time (cost units)")
    to_seconds = model.num_layers / per_second
    top = plan.makespan * to_seconds
    unit, scale = ("s", 1.0) if top >= 1 else ("ms", 1e-3) if top >= 1e-3 else ("µs", 1e-6)
    layers = f"{model.num_layers} layers" if model.num_layers > 1 else "per layer"
    return TimeAxis(to_seconds / scale, unit, f"predicted time ({unit}, {layers})")


def member_shares(plan: PlanForm) -> tuple[np.ndarray, ...]:
    """Every member of every sequence's group: (rank, sequence id, cost, at home, group size),
    arrays in sequence order then member order. Cost is the member's chunk's linear cost + 1/k
    of the attention + the per-sequence cost (tokens held without a cost model)."""
    model = plan.cost_model
    index = plan.index
    S = plan.num_ranks
    sizes, mat = group_arrays(plan.groups)
    k_seq = sizes[plan.seq_group]
    rows = mat[plan.seq_group]  # (n, max k) member ranks, -1 padded
    gid, pos = np.nonzero(rows >= 0)  # sequence order, then member order
    rank = rows[gid, pos]
    # tokens each (sequence, member) holds: chunk rows keyed by sequence * S + destination
    key = plan.chunk_gid * S + plan.chunks[:, DST]
    keys, inv = np.unique(key, return_inverse=True)
    held_by_key = np.bincount(inv.reshape(-1), weights=plan.chunks[:, LEN], minlength=keys.size)
    want = gid * S + rank
    held = np.zeros(gid.size)
    if keys.size:  # members holding no token of a short sequence have no chunk row
        at = np.minimum(np.searchsorted(keys, want), keys.size - 1)
        hit = keys[at] == want
        held[hit] = held_by_key[at[hit]]
    k = k_seq[gid]
    if model is not None:
        L = index.lengths.astype(np.float64)[gid]
        cost = model.lin(held) + model.quad(L) / k + model.per_seq_coef
    else:
        cost = held.astype(np.float64)
    return rank, gid, np.asarray(cost, dtype=np.float64), rank == index.src_rank[gid], k


def plt_agg():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def stats_line(plan: PlanForm) -> str:
    st = plan.stats()
    return (
        f"{plan.solver}: {plan.num_ranks} ranks, {len(plan.seq_group)} sequences, imbalance "
        f"{st['imbalance_before']:.3f} -> {st['imbalance_after']:.3f}, makespan/bound {st['gap_to_bound']:.4f}"
    )


def seq_label(plan: PlanForm, g: int, *, span: bool = False) -> str:
    """``seq g: L tok, rank r -> where`` (where: its rank, or its group's size and ring; with
    ``span``, the lowest and highest member too)."""
    index = plan.index
    b = int(plan.seq_group[g])
    members = plan.groups[b]
    k = len(members)
    ring = getattr(plan, "rings", None)
    if k == 1:
        where = f"rank {members[0]}"
    else:
        where = f"{k} ranks" + (f", ring {int(ring[b])}" if ring is not None and int(ring[b]) > 1 else "")
        if span:
            lo, hi = min(members), max(members)
            where += f" ({lo}-{hi})" if hi - lo + 1 == k else f" (in {lo}-{hi})"
    return f"seq {g}: {int(index.lengths[g])} tok, rank {int(index.src_rank[g])} -> {where}"
