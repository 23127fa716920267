"""The moldable lower bound: a makespan no plan with groups of given sizes can beat.

Kept apart from :mod:`~knapformer.plan.problem` (which owns the input and calls this for
``PlanProblem.lower_bound``): the bound is the one piece of the planner whose correctness is
a proof obligation — every solver's plan must stay at or above it — so it lives in one small
module with its argument in its docstrings. It reads the problem through the attributes it
names (:class:`BoundInput`) and imports nothing of the planner but the exchange pricing.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from knapformer.plan.cost import LinkModel, jitter_factor
from knapformer.plan.member_comm import member_comm_lower, split_total_lower
from knapformer.workload import WorkloadModel

__all__ = ["BoundInput", "moldable_lower_bound", "moldable_lower_bounds", "size_costs"]


class BoundInput(Protocol):
    """What the bound reads of a :class:`~knapformer.plan.problem.PlanProblem`."""

    @property
    def num_seqs(self) -> int: ...
    @property
    def lengths(self) -> np.ndarray: ...
    @property
    def work(self) -> np.ndarray: ...
    @property
    def speed(self) -> np.ndarray: ...

    model: WorkloadModel
    link: LinkModel | None
    kv_gather: bool

    def ring_of(self, k: int) -> int: ...


def moldable_lower_bound(problem: BoundInput, degrees, *, jitter: bool = True) -> float:
    """A makespan no plan with groups of the given sizes can beat (size 1 is always counted);
    ``jitter=False`` leaves the sync jitter out (a lower figure; :func:`size_costs`).
    :func:`moldable_lower_bounds` gives both in one pass."""
    return moldable_lower_bounds(problem, degrees)[0 if jitter else 1]


def moldable_lower_bounds(problem: BoundInput, degrees) -> tuple[float, float]:
    """(the bound, the bound without sync jitter) of :func:`moldable_lower_bound`, sharing the
    pricing (the exchanges dominate its cost).

    Per sequence and size k, its busiest member's cost and its members' total work, both
    with the least communication a k-group must pay (:func:`~knapformer.plan.member_comm.member_comm_lower`).
    A makespan T is reachable only if every sequence has a size whose busiest member fits in
    T and the least total work over such sizes, summed, fits in what the ranks do in T (the
    allotment bound of moldable scheduling); the bound is the least such T (bisection, rounded
    down). Only T at or above the fluid level (total work over all speed) are in question, so:

    - a sequence that fits whole under it is done cheapest by one rank: priced at no size;
    - one that fits at a size up to a node under it is priced exactly at those sizes; beyond a
      node (hundreds of sizes on thousands of ranks) it counts the least total of any of them,
      fitting or not (a smaller total only lowers the bound), so no bisection step visits them;
    - the others are priced exactly at every size.

    The bound then costs O(n) for long-tailed inputs with thousands of ranks."""
    if problem.num_seqs == 0:
        return 0.0, 0.0
    L = problem.lengths
    link = problem.link
    fastest = float(problem.speed.max())
    capacity = float(problem.speed.sum())
    work = problem.work
    fluid = float(work.sum() / capacity)
    long = np.flatnonzero(work / fastest > fluid)
    if long.size == 0:
        return fluid, fluid
    sizes = sorted(set(int(k) for k in degrees) | {1})
    node = link.gpus_per_node if link is not None else max(sizes)
    narrow = [k for k in sizes if k <= node]
    wide = [k for k in sizes if k > node]
    # every figure depends on the length alone: priced once per distinct length, counted as
    # many times as it occurs (images come in a few sizes: 16k 4k² images on 4,096 ranks)
    Lu, count = np.unique(L[long], return_counts=True)
    parts_n = _size_parts(problem, narrow, Lu, fastest)
    # (chosen on the lower, jitter-free figures: a relaxation for both bounds)
    wide_sel = (_combine(parts_n, False)[0].min(axis=0) > fluid) & (len(narrow) < len(sizes))
    wide_cols = np.flatnonzero(wide_sel)
    parts_w = _size_parts(problem, wide, Lu[wide_cols], fastest)
    rest_cols = np.flatnonzero(~wide_sel) if wide and not wide_sel.all() else None
    parts_b = _size_parts(problem, wide, Lu[rest_cols], 1.0) if rest_cols is not None else None
    rest = float(work.sum() - work[long].sum())  # the others at one rank each, their cheapest
    out = []
    for jit in (True, False):
        per_n, total_n = _combine(parts_n, jit)
        per_w, total_w = _combine(parts_w, jit)
        beyond = np.full(Lu.size, np.inf)
        if parts_b is not None:
            beyond[rest_cols] = _combine(parts_b, jit)[1].min(axis=0)
        out.append(_bisect(per_n, total_n, per_w, total_w, wide_cols, beyond, count, rest, fluid, capacity))
    return out[0], out[1]


def _bisect(
    per_n, total_n, per_w, total_w, wide_cols, beyond, count, rest: float, fluid: float, capacity: float
) -> float:
    """The least reachable makespan (:func:`moldable_lower_bounds`), bisected; columns are
    distinct lengths, ``count`` sequences each."""

    def reachable(t: float) -> bool:
        least = np.minimum(np.where(per_n <= t, total_n, np.inf).min(axis=0), beyond)
        if wide_cols.size:
            least[wide_cols] = np.minimum(least[wide_cols], np.where(per_w <= t, total_w, np.inf).min(axis=0))
        return rest + float(least @ count) <= capacity * t

    best = per_n.min(axis=0)
    if wide_cols.size:
        best[wide_cols] = np.minimum(best[wide_cols], per_w.min(axis=0))
    lo = max(fluid, float(best.max()))
    if reachable(lo):
        return lo
    hi = float(per_n[0].max())  # every long sequence whole: all the work, at most capacity × hi
    for _ in range(40):  # lo is never reachable, hi always
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if not reachable(mid) else (lo, mid)
    return lo


def size_costs(
    problem: BoundInput, sizes, L: np.ndarray, fastest: float, *, jitter: bool = True, exposed: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """(busiest member's time, members' total work), each (len(sizes), len(L)), with the least
    communication of each size; every size in one broadcast.

    A member's time is its compute over its speed plus its exchanges (which no speed
    shortens), so: time ≥ chunk / fastest + comm; and Σ speed·time ≥ all compute + slowest
    speed × all comm — the total counts communication at the slowest speed (ranks slower than
    1 otherwise made it no bound). Every member of a k-rank group (k ≥ 2) waits at its
    exchanges: the cost model charges all its compute ``1 + sync_jitter · jitter_factor(k')``
    times for the largest group k' ≥ k it is in, so the compute here counts at least the
    k-group's factor (``jitter=False``: 1, a lower figure). The total also counts what the
    members pay together beyond that: the exchanges' local copies and the route a split
    sequence needs (:func:`~knapformer.plan.member_comm.split_total_lower`).

    Caveat, rings: the ring exchanges are priced per sequence, as the planner prices them
    (:func:`~knapformer.plan.member_comm.member_comm_lower`: what its own attention does not hide at
    its own ring size). A rank holding several ring sequences, or a plan whose largest ring is
    longer (more of each round hidden), can expose less than that sum, so on such steps the
    figure is the cost model's ring-priced bound rather than a proof; fuzzing
    (``tests/test_planner_scale.py``) found no plan below it. Leaving the ring part out (a
    proof) was tried: the planner aims at multiples of the bound, so its picks moved too
    (giant mix, 256 ranks: 1.076 → 1.104 of that weaker bound on two of three steps).
    ``exposed=False`` leaves the ring exchanges out: a proof (the uniform layouts' pruning
    uses it for ring sizes: a 16-rank uniform ring plan came 2% under the ring-priced figure)."""
    Lu, inv = np.unique(L, return_inverse=True)  # priced once per distinct length
    per, total = _combine(_size_parts(problem, sizes, Lu, fastest, exposed=exposed), jitter)
    return per[:, inv], total[:, inv]


def _size_parts(problem: BoundInput, sizes, L: np.ndarray, fastest: float, *, exposed: bool = True):
    """(compute of the busiest member / fastest, its least exchanges, all members' compute, all
    members' exchanges × slowest speed, the k-group's sync wait factor): :func:`size_costs`'s
    terms, each (len(sizes), len(L)) or broadcastable."""
    model, link = problem.model, problem.link
    shape = (len(sizes), L.size)
    if not sizes:
        z = np.zeros(shape)
        return z, z, z, z, 1.0
    k = np.asarray(sizes, dtype=np.int64)[:, None]
    comm, extra, wait = 0.0, 0.0, 1.0
    if link is not None:
        ring = np.asarray([problem.ring_of(int(v)) for v in sizes], dtype=np.int64)[:, None]
        # a group wider than a node crosses nodes, and the cost model prices all of a crossing
        # group's Ulysses exchange at the slower link (a 40-rank Ulysses group of Wan-14B's 40
        # heads was priced at the faster one: 5.5% under its cost)
        cross = k > link.gpus_per_node
        comm = member_comm_lower(
            L[None, :], k, model, link, cross=cross, ring=ring, gather=problem.kv_gather, exposed=exposed
        )
        extra = split_total_lower(L[None, :], k, model, link, ring=ring)
        wait = 1.0 + link.sync_jitter * jitter_factor(k)  # every member of a k-group waits this
    chunk = model.chunk_cost(-(-L // k), L, k) / fastest
    work = model.cost(L) + (k - 1) * model.per_seq_coef
    return chunk, comm, work, (k * comm + extra) * float(problem.speed.min()), wait


def _combine(parts, jitter: bool) -> tuple[np.ndarray, np.ndarray]:
    chunk, comm, work, all_comm, wait = parts
    w = wait if jitter else 1.0
    shape = np.broadcast_shapes(np.shape(chunk), np.shape(comm), np.shape(work))
    return np.broadcast_to(chunk * w + comm, shape), np.broadcast_to(work * w + all_comm, shape)
