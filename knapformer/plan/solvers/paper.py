"""The KnapFormer paper's rule, kept exactly as the baseline.

Per-rank capacity ``C = total work / ranks`` (with rank speeds: per unit of speed). Visit
sequences by decreasing work (ties: lower global id first). Candidate bags: capacity
``C·|bag| ≥ work`` and ``|bag| ≤ length``; if there are none, all bags of the largest size.
Pick the candidate with the lowest occupancy ``assigned / capacity`` (ties: lower bag index).

The rule knows nothing of memory caps: a plan that breaks ``max_tokens_per_rank`` raises.
Bags are kept in one heap per (size, capacity) class so a visit costs O(classes · log B)
instead of a scan over all bags.
"""

from __future__ import annotations

import heapq
import time

import numpy as np

from knapformer.plan.plan import Plan, build_plan
from knapformer.plan.problem import PlanProblem
from knapformer.plan.solvers.common import stamp

__all__ = ["solve_paper", "paper_assignment"]


def paper_assignment(problem: PlanProblem) -> np.ndarray:
    """(n,) bag of each sequence under the paper's rule."""
    n = problem.num_seqs
    seq_bag = np.zeros(n, dtype=np.int64)
    if n == 0:
        return seq_bag
    work, lengths = problem.work, problem.lengths
    per_speed = float(work.sum()) / float(problem.speed.sum())
    classes = problem.bag_classes
    heaps = [[(0.0, b) for b in ids] for _, _, ids in classes]
    sizes = np.array([k for k, _, _ in classes])
    caps = np.array([per_speed * c for _, c, _ in classes])
    largest = tuple(int(i) for i in np.flatnonzero(sizes == sizes.max()))
    order = np.argsort(-work, kind="stable")
    # eligibility is static (capacity and size vs the sequence), so compute it in one pass
    elig = (caps[None, :] >= work[order][:, None]) & (sizes[None, :] <= lengths[order][:, None])
    masks = elig @ (1 << np.arange(len(classes)))
    by_mask = {}  # eligibility bitmask -> eligible class ids (empty -> the largest bags)
    for m, first in zip(*np.unique(masks, return_index=True)):
        by_mask[int(m)] = tuple(int(i) for i in np.flatnonzero(elig[first])) or largest
    caps_l, work_l = caps.tolist(), work.tolist()
    for g, m in zip(order.tolist(), masks.tolist()):
        w = work_l[g]
        eligible = by_mask[m]
        if len(eligible) == 1:
            i = eligible[0]
        else:
            i = min(eligible, key=lambda i: (heaps[i][0][0] / caps_l[i] if caps_l[i] > 0 else 0.0, heaps[i][0][1]))
        assigned, b = heaps[i][0]
        heapq.heapreplace(heaps[i], (assigned + w, b))
        seq_bag[g] = b
    return seq_bag


def solve_paper(problem: PlanProblem, *, time_budget_s: float | None = None) -> Plan:
    """The paper's rule (one pass: it takes no time budget; the registry refuses one)."""
    t0 = time.perf_counter()
    seq_bag = paper_assignment(problem)
    plan = build_plan(problem, seq_bag, solver="paper")
    return stamp(plan, t0)
