"""A planner as a value: every setting a balancer plans with, callable on every rank's lengths.

``SequenceBalancer.plan`` gathers the lengths of the group and solves on every rank, on the
training loop's thread. A :class:`Planner` is the same solve without the gather: a frozen,
picklable snapshot of the balancer's planning settings (``SequenceBalancer.planner()``), so a
process that already knows every rank's lengths of a step — a DataLoader worker iterating the
token-budget sampler, which is a pure function of ``(seed, epoch)`` — makes the step's plan
ahead of it, off the main thread, and the balancer runs it (``use_plan``). The plan is the one
``plan`` would make from the same lengths (the solvers are deterministic in any process).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from knapformer.layout import AutoLayout, BagLayout
from knapformer.plan.cost import LinkModel
from knapformer.plan.plan import Plan
from knapformer.plan.problem import PlanProblem, SolverOptions
from knapformer.plan.solvers import default_solver, get_solver
from knapformer.workload import WorkloadModel

__all__ = ["Planner"]


@dataclass(frozen=True)
class Planner:
    """One balancing group's planning settings (what ``PlanProblem`` and the solver take but
    the lengths). Call it with every rank's lengths of a step: ``planner(lens) -> Plan``."""

    layout: BagLayout | AutoLayout | str
    cost: WorkloadModel
    solver: str | None = None
    max_tokens_per_rank: int | None = None
    rank_speed: tuple[float, ...] | None = None
    options: SolverOptions = field(default_factory=SolverOptions)
    link: LinkModel | None = None
    kv_gather: bool = False
    time_budget_s: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.cost, WorkloadModel):
            raise TypeError(f"Planner.cost must be a WorkloadModel, got {type(self.cost).__name__}")
        if self.solver is None:  # the layout's default, named once
            object.__setattr__(self, "solver", default_solver(self.layout))
        get_solver(self.solver)  # a known name

    @classmethod
    def from_config(cls, config, *, kv_gather: bool = False) -> Planner:
        """The planner of a ``BalancerConfig`` (its layout, cost model, solver and options, cap,
        rank speeds, links as given, time budget); ``kv_gather`` prices the ``pre_attn`` path."""
        return cls(
            layout=config.layout,
            cost=config.cost,
            solver=config.solver,
            max_tokens_per_rank=config.max_tokens_per_rank,
            rank_speed=config.rank_speed,
            options=config.solver_options,
            link=config.link,
            kv_gather=kv_gather,
            time_budget_s=config.time_budget_s,
        )

    def __call__(self, seq_lens: Sequence[Sequence[int]]) -> Plan:
        """The plan of one step: ``seq_lens[r]`` = rank r's sequence lengths (the group's order)."""
        problem = PlanProblem(
            seq_lens=seq_lens,
            layout=self.layout,
            model=self.cost,
            max_tokens_per_rank=self.max_tokens_per_rank,
            rank_speed=self.rank_speed,
            options=self.options,
            link=self.link,
            kv_gather=self.kv_gather,
        )
        return get_solver(self.solver)(problem, time_budget_s=self.time_budget_s)
