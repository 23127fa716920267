"""The bag layouts a user picks from, as candidates of the moldable planner.

``auto`` is never worse than a fixed layout of up to :data:`FIXED_ALL_UP_TO` ranks (it plans
them all); above, the menu (:func:`layout_menu`) is what the cluster search and a time budget
offer, and :func:`matched_layouts` picks the few whose bag shares match a step's degrees.
"""

from __future__ import annotations

import functools
import itertools

import numpy as np

from knapformer.plan.problem import PlanProblem
from knapformer.plan.solvers.member_costs import MemberCosts

__all__ = ["FIXED_ALL_UP_TO", "fits_nodes", "fixed_layouts", "layout_menu", "matched_layouts", "spec_terms"]

FIXED_ALL_UP_TO = 16
"""Up to this many ranks every fixed bag layout is a candidate; above, the uniform ones."""


def layout_menu(S: int, sizes) -> list[str]:
    """Uniform layouts, then mixed ones of two or three sizes sharing the ranks in equal shares
    and 3:1 / 1:3 (2:1:1 / 1:1:2): the menu a user picks from (the cluster search uses it too)."""
    specs = [f"g{k}n{S // k}" for k in sizes if S % k == 0]
    shares = {2: [(1, 1), (3, 1), (1, 3)], 3: [(1, 1, 1), (2, 1, 1), (1, 1, 2)]}
    for m in (2, 3):
        for combo in itertools.combinations(sizes, m):
            for share in shares[m]:
                total = sum(share)
                if S % total:
                    continue
                ranks = [S // total * s for s in share]
                if any(r % k for r, k in zip(ranks, combo)):
                    continue
                specs.append("+".join(f"g{k}n{r // k}" for k, r in zip(combo, ranks)))
    return list(dict.fromkeys(specs))


def fixed_layouts(problem: PlanProblem) -> list[str]:
    """Bag layouts of the allowed sizes that divide the group, the layouts a user picks from:
    all of them (uniform and mixed, sizes ascending over contiguous ranks) up to
    ``FIXED_ALL_UP_TO`` ranks, else the uniform ones. (Mixed layouts with other sizes, e.g.
    g3n1+g4n1 on 7 ranks, would multiply the candidates of a small group's step: measured
    5 -> 72 ms on 7 ranks with 24 heads.)"""
    S = problem.num_ranks
    D = [k for k in problem.degrees if S % k == 0]  # (sizes that do not divide S: α candidates only)
    uniform = [f"g{k}n{S // k}" for k in D]
    if S > FIXED_ALL_UP_TO:
        return uniform
    out = []
    for counts in itertools.product(*[range(S // k + 1) for k in D]):
        if sum(k * c for k, c in zip(D, counts)) == S:
            out.append("+".join(f"g{k}n{c}" for k, c in zip(D, counts) if c))
    return out


def matched_layouts(problem: PlanProblem, costs: MemberCosts, pick: np.ndarray, count: int) -> list[str]:
    """The ``count`` menu layouts (:func:`layout_menu`, bags inside nodes) whose share of ranks
    per bag size is nearest (L1) to the share of the work the picks give each degree. The
    moldable placement packs whole sequences around the split ones; on coarse mixes (the
    paper's joint image + video mix: 2–3 sequences per rank) that left ranks 0.90–1.09 of the
    bound where the matching bag layout planned by the default solver stays within 0.99–1.06."""
    S = problem.num_ranks
    D = np.asarray(costs.D, dtype=np.int64)
    degree = D[pick]
    work = costs.member(pick) * degree
    total = float(work.sum())
    if total <= 0:
        return []
    want = {int(k): float(work[degree == k].sum()) / total for k in np.unique(degree).tolist()}
    node = problem.link.gpus_per_node if problem.link is not None else S
    menu = [s for s in layout_menu(S, [int(k) for k in D if S % k == 0 and k <= node]) if fits_nodes(problem, s)]

    def distance(spec: str) -> float:
        share: dict[int, float] = {}
        for k, m in spec_terms(spec):
            share[k] = share.get(k, 0.0) + k * m / S
        return sum(abs(share.get(k, 0.0) - want.get(k, 0.0)) for k in set(share) | set(want))

    return sorted(menu, key=distance)[:count]  # stable: menu order breaks ties


def fits_nodes(problem: PlanProblem, spec: str) -> bool:
    """No bag of ``spec`` straddles a node (with a link model; bags are contiguous)."""
    return problem.link is None or _fits(problem.link.gpus_per_node, spec)


@functools.lru_cache(maxsize=4096)
def _fits(gpn: int, spec: str) -> bool:
    """:func:`fits_nodes` for ``gpn`` GPUs per node (cached: the planner asks of the same few
    layouts every step, and a 4,096-rank spec walks 4,096 bags)."""
    start = 0
    for k, n in spec_terms(spec):
        for _ in range(n):
            if start // gpn != (start + k - 1) // gpn:
                return False
            start += k
    return True


def spec_terms(spec: str):
    for term in spec.split("+"):
        g, n = term[1:].split("n")
        yield int(g), int(n)
