"""Planning: pure Python + numpy, no torch.distributed, no devices.

Main API: :func:`plan_sequences` (lengths per rank + layout + cost model -> :class:`Plan`),
:class:`Planner` (a balancer's planning settings as a picklable callable),
:class:`PlanProblem`, :class:`SolverOptions`, the solver registry :data:`SOLVERS`.
"""

from __future__ import annotations

from collections.abc import Sequence

from knapformer.layout import AutoLayout, BagLayout
from knapformer.plan.cost import LinkModel
from knapformer.plan.plan import (
    InvalidPlanError,
    Plan,
    RankFeatures,
    build_plan,
    chunk_table,
    plan_from_groups,
    rank_features,
)
from knapformer.plan.planner import Planner
from knapformer.plan.problem import PlanProblem, SolverOptions, validate_seq_lens
from knapformer.plan.seqindex import SeqIndex
from knapformer.plan.solvers import DEFAULT_SOLVER, SOLVERS, SolverInfo, default_solver, get_solver
from knapformer.workload import WorkloadModel

__all__ = [
    "DEFAULT_SOLVER",
    "SOLVERS",
    "InvalidPlanError",
    "Plan",
    "PlanProblem",
    "Planner",
    "RankFeatures",
    "SeqIndex",
    "SolverInfo",
    "SolverOptions",
    "build_plan",
    "chunk_table",
    "default_solver",
    "get_solver",
    "plan_from_groups",
    "plan_sequences",
    "rank_features",
    "validate_seq_lens",
]


def plan_sequences(
    seq_lens: Sequence[Sequence[int]],
    layout: str | BagLayout | AutoLayout,
    model: WorkloadModel,
    *,
    solver: str | None = None,
    max_tokens_per_rank: int | None = None,
    rank_speed: Sequence[float] | None = None,
    time_budget_s: float | None = None,
    options: SolverOptions | None = None,
    link: LinkModel | None = None,
    kv_gather: bool = False,
) -> Plan:
    """Plan one step for one balancing group. Deterministic for identical input.

    ``layout`` is a bag layout (``"g1n4+g2n2"``) or ``"auto"`` (each sequence's group chosen
    per step); ``solver`` defaults to ``lpt`` for bag layouts and ``moldable`` for ``auto``.
    ``time_budget_s`` is for solvers that declare ``takes_time_budget`` (others refuse it);
    ``options`` tunes the solvers' iteration counts and tie-breaking; ``link`` prices the
    Ulysses and route exchanges (``knapformer.plan.cost.LinkModel``); ``kv_gather`` plans for
    the ``pre_attn`` path (ring groups all-gather K/V: priced and counted in memory)."""
    info = get_solver(solver if solver is not None else default_solver(layout))
    problem = PlanProblem(
        seq_lens=seq_lens,
        layout=layout,
        model=model,
        max_tokens_per_rank=max_tokens_per_rank,
        rank_speed=rank_speed,
        options=options if options is not None else SolverOptions(),
        link=link,
        kv_gather=kv_gather,
    )
    return info(problem, time_budget_s=time_budget_s)
