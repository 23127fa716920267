"""Planning: pure Python + numpy, no torch.distributed, no devices.

Main API: :func:`plan_sequences` (lengths per rank + layout + cost model -> :class:`Plan`),
:class:`PlanProblem`, the solver registry :data:`SOLVERS`.
"""

from __future__ import annotations

from collections.abc import Sequence

from knapformer.layout import BagLayout
from knapformer.plan.plan import Plan, build_plan, chunk_table
from knapformer.plan.problem import PlanProblem, validate_seq_lens
from knapformer.plan.solvers import DEFAULT_SOLVER, SOLVERS, SolverInfo, get_solver
from knapformer.workload import WorkloadModel

__all__ = [
    "DEFAULT_SOLVER",
    "SOLVERS",
    "Plan",
    "PlanProblem",
    "SolverInfo",
    "build_plan",
    "chunk_table",
    "get_solver",
    "plan_sequences",
    "validate_seq_lens",
]


def plan_sequences(
    seq_lens: Sequence[Sequence[int]],
    layout: str | BagLayout,
    model: WorkloadModel,
    *,
    solver: str = DEFAULT_SOLVER,
    max_tokens_per_rank: int | None = None,
    rank_speed: Sequence[float] | None = None,
    time_budget_s: float | None = None,
) -> Plan:
    """Plan one step for one balancing group. Deterministic for identical input."""
    info = get_solver(solver)
    problem = PlanProblem(
        seq_lens=seq_lens,
        layout=layout,
        model=model,
        max_tokens_per_rank=max_tokens_per_rank,
        rank_speed=None if rank_speed is None else tuple(rank_speed),
    )
    return info(problem, time_budget_s=time_budget_s)
