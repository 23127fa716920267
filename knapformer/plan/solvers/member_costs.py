"""Per-member costs of each sequence at each allowed degree (the moldable planner's picks).

A sequence of length L on a k-rank group costs each member ``lin(L/k) + quad(L)/k + per_seq``,
scaled for the wait at synchronised exchanges, plus its share of the exchanges
(:func:`~knapformer.plan.member_comm.member_comm_estimate`). Only the pairs a pick can use are priced
(:class:`MemberCosts`), every degree in one broadcast.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from knapformer.plan.cost import jitter_factor
from knapformer.plan.member_comm import member_comm_estimate
from knapformer.plan.problem import PlanProblem

__all__ = ["MemberCosts", "balanced_target", "member_costs", "member_rows"]


@dataclass(frozen=True)
class MemberCosts:
    """Per-member cost of each sequence at each allowed degree, in cost units, priced only where
    a pick can use it. Degrees ascend from 1; a sequence whose whole cost (degree 1) is at most
    ``floor`` fits whole under every target the planner tries (picks take the smallest degree
    that fits), so it is priced at degree 1 only; one that fits under ``floor_wide`` at some
    degree up to a node never reaches the degrees beyond (hundreds of them on thousands of
    ranks). Long-tailed steps have a handful of such sequences: pricing is O(n) plus
    O(|D| × long ones) instead of O(|D| × n)."""

    D: tuple[int, ...]
    work: np.ndarray
    """(n,) cost of each whole sequence (degree 1)."""
    cols: np.ndarray
    """(m,) sequences priced at the degrees up to a node (``narrow`` of them)."""
    near: np.ndarray
    """(narrow, m) their per-member costs there."""
    wide_cols: np.ndarray
    """(w,) sequences priced at every degree (a subset of ``cols``)."""
    wide: np.ndarray
    """(|D|, w) their per-member costs."""

    @property
    def narrow(self) -> int:
        return self.near.shape[0]

    def picks(self, target: float, allow: np.ndarray | None = None, *, least_total: bool = False) -> np.ndarray:
        """(n,) each sequence's degree (index into D) for a target makespan: the smallest allowed
        whose per-member cost fits under it (``least_total``: of those, the one whose members'
        total k × cost is least, ties the smallest), else the cheapest allowed priced one."""
        allow = np.ones(len(self.D), dtype=bool) if allow is None else allow
        out = np.zeros(self.work.size, dtype=np.int64)
        D = np.asarray(self.D, dtype=np.float64) if least_total else None
        out[self.cols] = _fit(self.near, target, allow[: self.narrow], None if D is None else D[: self.narrow])
        out[self.wide_cols] = _fit(self.wide, target, allow, D)
        return out

    def member(self, pick: np.ndarray) -> np.ndarray:
        """(n,) per-member cost of each sequence at its pick."""
        out = self.work.copy()
        # (a wide pick indexes past ``near``: clamped here, overwritten from ``wide`` below)
        out[self.cols] = self.near[np.minimum(pick[self.cols], self.narrow - 1), np.arange(self.cols.size)]
        out[self.wide_cols] = self.wide[pick[self.wide_cols], np.arange(self.wide_cols.size)]
        return out

    def all_fit(self, target: float) -> bool:
        """Every sequence has a degree whose per-member cost fits under ``target``."""
        bad = np.zeros(self.work.size, dtype=bool)
        bad[self.cols] = ~(self.near <= target).any(axis=0)
        bad[self.wide_cols] = ~(self.wide <= target).any(axis=0)
        return not bad.any()


def _fit(cost: np.ndarray, target: float, allow: np.ndarray, D: np.ndarray | None) -> np.ndarray:
    """Per column, the smallest allowed degree fitting under ``target`` (with ``D``: the one
    whose members' total k × cost is least, ties the smallest), else the cheapest allowed.
    The total grows with k except where k crosses nodes as one Ulysses group (all of its
    exchange on the slower link): Wan's 40 heads allow Ulysses over 40 ranks, which costs its
    members 5.5% more in total than a ring of 6 × 8 on 48."""
    masked = np.where(allow[:, None], cost, np.inf)
    fits = masked <= target
    first = fits.argmax(axis=0) if D is None else np.where(fits, masked * D[:, None], np.inf).argmin(axis=0)
    return np.where(fits.any(axis=0), first, masked.argmin(axis=0))


def member_rows(problem: PlanProblem, degrees, L: np.ndarray) -> np.ndarray:
    """(len(degrees), len(L)) per-member cost at each degree, every degree in one broadcast."""
    model, link = problem.model, problem.link
    if not len(degrees):
        return np.zeros((0, L.size))
    k = np.asarray(degrees, dtype=np.int64)[:, None]
    c = np.asarray(model.chunk_cost(-(-L[None, :] // k), L[None, :], k), dtype=np.float64)
    if link is not None:
        ring = np.asarray([problem.ring_of(int(v)) for v in degrees], dtype=np.int64)[:, None]
        c = c * (1.0 + link.sync_jitter * jitter_factor(k))
        cross = k > link.gpus_per_node
        c = c + member_comm_estimate(L[None, :], k, model, link, cross=cross, ring=ring, gather=problem.kv_gather)
    return np.broadcast_to(c, (k.shape[0], L.size)).astype(np.float64)


def _rows(problem: PlanProblem, degrees, L: np.ndarray) -> np.ndarray:
    """:func:`member_rows`, priced once per distinct length (images come in a few sizes)."""
    Lu, inv = np.unique(L, return_inverse=True)
    return member_rows(problem, degrees, Lu)[:, inv] if Lu.size < L.size else member_rows(problem, degrees, L)


def member_costs(problem: PlanProblem, floor: float = 0.0, floor_wide: float | None = None) -> MemberCosts:
    """The sequences' per-member costs (:class:`MemberCosts`) for targets of at least ``floor``
    (every degree) and ``floor_wide`` (degrees beyond a node; default ``floor``)."""
    D = problem.degrees
    L = problem.lengths
    work = np.asarray(problem.work, dtype=np.float64)
    node = problem.link.gpus_per_node if problem.link is not None else problem.num_ranks
    narrow = sum(1 for k in D if k <= node)
    cols = np.flatnonzero(work > floor)
    near = _rows(problem, D[:narrow], L[cols])
    fw = floor if floor_wide is None else floor_wide
    if narrow < len(D):
        sel = ~(near <= fw).any(axis=0)
        wide_cols = cols[sel]
        wide = np.concatenate([near[:, sel], _rows(problem, D[narrow:], L[wide_cols])])
    else:
        wide_cols, wide = np.zeros(0, dtype=np.int64), np.zeros((len(D), 0))
    return MemberCosts(D=D, work=work, cols=cols, near=near, wide_cols=wide_cols, wide=wide)


def balanced_target(problem: PlanProblem, costs: MemberCosts, lo: float, hi: float) -> float:
    """The least target T in [lo, hi] at which every sequence's degree (:meth:`MemberCosts.picks`)
    keeps the members' total work within what the ranks do in T (bisection; at most ``hi``)."""
    D = np.asarray(costs.D, dtype=np.float64)
    capacity = float(problem.speed.sum())

    def fits(t: float) -> bool:
        pick = costs.picks(t)
        return float((costs.member(pick) * D[pick]).sum()) <= capacity * t

    if fits(lo):
        return lo
    for _ in range(24):
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi
