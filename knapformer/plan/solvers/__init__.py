"""Solver registry: one name -> one function ``(problem, *, time_budget_s=None) -> Plan``.

Adding a solver: write ``plan/solvers/<name>.py`` with a function of that signature that
returns a new :class:`~knapformer.plan.plan.Plan` (build it with ``build_plan`` so chunking is
shared), mutate nothing, break ties explicitly (stable sorts), and add one ``SolverInfo`` line
below declaring what it promises. The contract tests in ``tests/test_solvers.py`` and
``tests/test_plan_properties.py`` read those flags.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from knapformer.plan.plan import Plan
from knapformer.plan.problem import PlanProblem
from knapformer.plan.solvers.exact import solve_exact
from knapformer.plan.solvers.lpt import HEAP_ITEMS, solve_lpt
from knapformer.plan.solvers.moldable import solve_moldable
from knapformer.plan.solvers.paper import solve_paper

__all__ = ["DEFAULT_SOLVER", "SOLVERS", "SolverInfo", "default_solver", "get_solver"]

SolverFn = Callable[..., Plan]


@dataclass(frozen=True)
class SolverInfo:
    """A solver and what it promises (the contract tests read every flag)."""

    name: str
    fn: SolverFn
    optimal: bool = False
    """Proves the optimum of the fluid makespan (small instances only)."""
    never_worse_than_paper_up_to: int = 0
    """Its makespan is <= the paper rule's on every input with at most this many sequences
    (0 = no such promise; ``math.inf`` = always)."""
    locality_aware: bool = False
    """Among (near-)equal plans, prefers the one moving fewer tokens off their source rank."""
    memory_aware: bool = False
    """Searches within ``max_tokens_per_rank``: it returns a plan whenever it finds one under
    the cap (solvers without the flag plan first and raise if the cap is broken)."""
    deterministic: bool = True
    """Identical input gives an identical plan, in any process (every rank plans on its own)."""
    takes_time_budget: bool = False
    """Honours ``time_budget_s``; solvers without the flag refuse one instead of ignoring it."""
    scales: bool = True
    """Fast enough for thousands of ranks."""
    moldable: bool = False
    """Plans layout ``auto`` (chooses every sequence's group); the others plan bag layouts."""

    def __call__(self, problem: PlanProblem, *, time_budget_s: float | None = None) -> Plan:
        if problem.auto != self.moldable:
            kind = "layout 'auto'" if self.moldable else "bag layouts"
            raise ValueError(
                f"solver {self.name!r} plans {kind}, not {problem.layout.spec()!r}; "
                f"use {'moldable' if problem.auto else DEFAULT_SOLVER!r} (the default for this layout)"
            )
        if time_budget_s is not None:
            if not self.takes_time_budget:
                raise ValueError(
                    f"solver {self.name!r} takes no time budget (it is bounded by iteration counts so that "
                    f"every rank computes the same plan); drop time_budget_s"
                )
            if isinstance(time_budget_s, bool) or not (
                isinstance(time_budget_s, (int, float)) and math.isfinite(time_budget_s) and time_budget_s > 0
            ):
                raise ValueError(f"time_budget_s must be a finite number of seconds > 0, got {time_budget_s!r}")
        return self.fn(problem, time_budget_s=time_budget_s)


SOLVERS: dict[str, SolverInfo] = {
    "lpt": SolverInfo(
        "lpt", solve_lpt, never_worse_than_paper_up_to=HEAP_ITEMS, locality_aware=True, memory_aware=True
    ),
    "paper": SolverInfo("paper", solve_paper),
    "exact": SolverInfo("exact", solve_exact, optimal=True, memory_aware=True, takes_time_budget=True, scales=False),
    "moldable": SolverInfo(
        "moldable", solve_moldable, locality_aware=True, memory_aware=True, takes_time_budget=True, moldable=True
    ),
}
DEFAULT_SOLVER = "lpt"
"""The default for bag layouts; layout ``auto`` defaults to ``moldable``."""


def default_solver(layout) -> str:
    """The solver a layout gets when none is named."""
    from knapformer.layout import AutoLayout, parse_layout

    return "moldable" if isinstance(parse_layout(layout), AutoLayout) else DEFAULT_SOLVER


def get_solver(name: str) -> SolverInfo:
    """Look a solver up by name; the error lists the known ones."""
    if not isinstance(name, str):
        raise ValueError(f"solver must be a name, got {type(name).__name__}")
    try:
        return SOLVERS[name]
    except KeyError:
        raise ValueError(f"unknown solver {name!r}; choose one of {sorted(SOLVERS)}") from None
