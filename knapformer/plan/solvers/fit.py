"""Finding *some* plan under a memory cap (bag form), before optimising one.

Under ``max_tokens_per_rank`` a bag of k ranks may hold at most ``cap·k`` tokens (chunking
spreads a bag's tokens so its ranks differ by at most one). Deciding whether any assignment
fits is bin packing, so earliest-finish insertion can miss feasible caps. The default solver
therefore also starts from these, which look only at tokens:

- :func:`home_fit`: every sequence stays in its source rank's bag (often the only plan that
  meets a cap equal to the largest rank's tokens);
- :func:`best_fit_decreasing`: sequences by decreasing length, each into the bag with the
  least room left that still fits it;
- :func:`exhaustive_fit`: for up to ``MAX_ITEMS`` sequences, a depth-first search over bags
  with room (interchangeable bags with equal room tried once), bounded by a node count so all
  ranks agree; it proves infeasibility when it finishes without a plan.
"""

from __future__ import annotations

import numpy as np

from knapformer.plan.problem import PlanProblem, sum_by

__all__ = ["MAX_ITEMS", "best_fit_decreasing", "exhaustive_fit", "home_fit"]

MAX_ITEMS = 40


def _room(problem: PlanProblem) -> np.ndarray:
    assert problem.max_tokens_per_rank is not None
    return problem.bag_size * int(problem.max_tokens_per_rank)


def home_fit(problem: PlanProblem) -> np.ndarray | None:
    """Every sequence in its home bag, if that meets the cap."""
    home = problem.bag_of_rank[problem.src_rank]
    tok = sum_by(home, problem.lengths, len(problem.bags))
    return home.astype(np.int64) if (tok <= _room(problem)).all() else None


def best_fit_decreasing(problem: PlanProblem) -> np.ndarray | None:
    """Longest first, into the fitting bag with the least room left (ties: lower bag id)."""
    room = _room(problem).astype(np.int64)
    seq_bag = np.zeros(problem.num_seqs, dtype=np.int64)
    for g in np.argsort(-problem.lengths, kind="stable").tolist():
        L = int(problem.lengths[g])
        fit = np.flatnonzero(room >= L)
        if fit.size == 0:
            return None
        b = int(fit[np.argmin(room[fit])])
        room[b] -= L
        seq_bag[g] = b
    return seq_bag


def exhaustive_fit(problem: PlanProblem, *, max_nodes: int = 20_000) -> tuple[np.ndarray | None, bool]:
    """(assignment or None, proven): depth-first search for any assignment under the cap;
    ``proven`` is True when the search finished (so None means no plan exists)."""
    n = problem.num_seqs
    if n > MAX_ITEMS:
        return None, False
    order = np.argsort(-problem.lengths, kind="stable")
    L = problem.lengths[order].tolist()
    room = _room(problem).tolist()
    cls = problem.bag_class[0].tolist()
    B = len(room)
    assign = [0] * n
    nodes = [0]
    suffix = np.concatenate([np.cumsum(L[::-1])[::-1], [0]]).tolist()

    def dfs(i: int) -> bool | None:
        if i == n:
            return True
        nodes[0] += 1
        if nodes[0] > max_nodes:
            return None
        if suffix[i] > sum(room):
            return False
        tried: set = set()
        for b in range(B):
            key = (cls[b], room[b])
            if room[b] < L[i] or key in tried:
                continue
            tried.add(key)
            room[b] -= L[i]
            assign[i] = b
            found = dfs(i + 1)
            room[b] += L[i]
            if found is None or found:
                return found
        return False

    found = dfs(0)
    if not found:
        return None, found is False
    out = np.empty(n, dtype=np.int64)
    out[order] = assign
    return out, True
