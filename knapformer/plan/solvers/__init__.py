"""Solver registry: one name -> one function ``(problem, *, time_budget_s=None) -> Plan``.

Adding a solver: write ``plan/solvers/<name>.py`` with a function of that signature that
returns a new :class:`~knapformer.plan.plan.Plan` (build it with ``build_plan`` so chunking is
shared), mutate nothing, break ties explicitly (stable sorts), and add one ``SolverInfo`` line
below declaring what it promises. The contract test in ``tests/test_solvers.py`` picks it up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from knapformer.plan.plan import Plan
from knapformer.plan.problem import PlanProblem
from knapformer.plan.solvers.exact import solve_exact
from knapformer.plan.solvers.lpt import solve_lpt
from knapformer.plan.solvers.paper import solve_paper

__all__ = ["SolverInfo", "SOLVERS", "DEFAULT_SOLVER", "get_solver"]

SolverFn = Callable[..., Plan]


@dataclass(frozen=True)
class SolverInfo:
    """A solver and what it promises (tests read these flags)."""

    name: str
    fn: SolverFn
    optimal: bool = False
    """Proves the optimum of the fluid makespan (small instances only)."""
    never_worse_than_paper: bool = False
    """Its makespan is <= the paper rule's on every input."""
    locality_aware: bool = False
    """Prefers plans that keep tokens on their source rank."""
    memory_aware: bool = False
    """Respects ``max_tokens_per_rank`` while searching (others only check afterwards)."""
    deterministic: bool = True
    """Identical input gives an identical plan (every rank plans on its own)."""
    scales: bool = True
    """Fast enough for thousands of ranks."""

    def __call__(self, problem: PlanProblem, *, time_budget_s: float | None = None) -> Plan:
        return self.fn(problem, time_budget_s=time_budget_s)


SOLVERS: dict[str, SolverInfo] = {
    "lpt": SolverInfo("lpt", solve_lpt, never_worse_than_paper=True, locality_aware=True, memory_aware=True),
    "paper": SolverInfo("paper", solve_paper),
    "exact": SolverInfo("exact", solve_exact, optimal=True, memory_aware=True, scales=False),
}
DEFAULT_SOLVER = "lpt"


def get_solver(name: str) -> SolverInfo:
    """Look a solver up by name; the error lists the known ones."""
    try:
        return SOLVERS[name]
    except KeyError:
        raise ValueError(f"unknown solver {name!r}; choose one of {sorted(SOLVERS)}") from None
