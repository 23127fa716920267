"""Exact solver: a mixed-integer program solved by HiGHS (``scipy.optimize.milp``).

Minimises the fluid makespan ``M`` with binary ``x[s, b]``::

    min M  s.t.  Σ_b x[s,b] = 1,   Σ_s work_s·x[s,b] ≤ capacity_b·M,   Σ_s len_s·x[s,b] ≤ cap·|b|

Exponential in the worst case: for benchmarks and tests on small instances only. scipy is an
optional dependency, imported here (``ImportError`` without it). Raises ``TimeoutError`` when
optimality is not proven within ``time_budget_s`` (default 60 s) and ``ValueError`` when the
memory cap is infeasible.
"""

from __future__ import annotations

import time

import numpy as np

from knapformer.plan.plan import Plan, build_plan
from knapformer.plan.problem import PlanProblem
from knapformer.plan.solvers.common import stamp

__all__ = ["solve_exact"]


def solve_exact(problem: PlanProblem, *, time_budget_s: float | None = None) -> Plan:
    """Optimal assignment for the fluid makespan (requires scipy)."""
    t0 = time.perf_counter()
    try:
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import coo_matrix
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("the 'exact' solver needs scipy: pip install scipy") from exc
    problem.check_capacity()
    n, B = problem.num_seqs, len(problem.bags)
    if n == 0:
        return stamp(build_plan(problem, np.zeros(0, dtype=np.int64), solver="exact"), t0)
    nv = n * B + 1  # x[s, b] at s*B + b, then M
    scale = float(problem.work.max())
    w = problem.work / scale
    rows, cols, vals = [], [], []
    for s in range(n):  # assignment rows
        rows += [s] * B
        cols += list(range(s * B, s * B + B))
        vals += [1.0] * B
    for b in range(B):  # load rows: Σ w x - kap M <= 0
        r = n + b
        rows += [r] * n + [r]
        cols += [s * B + b for s in range(n)] + [nv - 1]
        vals += w.tolist() + [-float(problem.bag_capacity[b])]
    nrows = n + B
    lo = [1.0] * n + [-np.inf] * B
    hi = [1.0] * n + [0.0] * B
    if problem.max_tokens_per_rank is not None:
        for b in range(B):
            r = nrows + b
            rows += [r] * n
            cols += [s * B + b for s in range(n)]
            vals += problem.lengths.astype(float).tolist()
            lo.append(-np.inf)
            hi.append(float(problem.max_tokens_per_rank * problem.bag_size[b]))
        nrows += B
    A = coo_matrix((vals, (rows, cols)), shape=(nrows, nv)).tocsr()
    c = np.zeros(nv)
    c[-1] = 1.0
    integrality = np.ones(nv)
    integrality[-1] = 0
    ub = np.ones(nv)
    ub[-1] = np.inf
    res = milp(
        c,
        constraints=LinearConstraint(A, lo, hi),
        integrality=integrality,
        bounds=Bounds(np.zeros(nv), ub),
        options={"time_limit": float(time_budget_s or 60.0), "mip_rel_gap": 0.0},
    )
    if res.status == 2:  # scipy.optimize.milp: the problem is infeasible
        raise ValueError(
            f"max_tokens_per_rank={problem.max_tokens_per_rank} is infeasible (proven by the exact solver)"
        )
    if res.status != 0 or res.x is None:
        raise TimeoutError(
            f"exact solver did not prove optimality within {float(time_budget_s or 60.0):g} s ({res.message}); "
            "give it a larger time_budget_s or use the default solver"
        )
    x = res.x[:-1].reshape(n, B)
    seq_bag = np.argmax(x, axis=1).astype(np.int64)
    return stamp(build_plan(problem, seq_bag, solver="exact"), t0)
