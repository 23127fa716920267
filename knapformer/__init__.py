"""knapformer: balance variable-length DiT training across GPUs.

Main API: :class:`WorkloadModel` (cost of a sequence), :class:`BalancerConfig` (every
balancer setting, validated), :func:`parse_layout` (bag specs and ``auto``),
:func:`plan_sequences` / :class:`Plan` (pure planning), :class:`SequenceBalancer` (routing
and Ulysses attention over torch.distributed) and :class:`LocalExecutor` (the same contract
in one process) — the last two imported lazily, so that planning never imports torch — and
the errors the balancer raises on every rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from knapformer.config import BalancerConfig
from knapformer.errors import (
    BalancerConfigError,
    BalancerInputError,
    DivergentCallError,
    InvalidPlanError,
    PeerLostError,
    PlanMismatchError,
)
from knapformer.layout import AutoLayout, BagLayout, parse_layout
from knapformer.plan import SOLVERS, Plan, PlanProblem, plan_sequences
from knapformer.workload import WorkloadModel

if TYPE_CHECKING:  # for type checkers and the API reference; at run time imported on first use
    from knapformer.distributed.balancer import SequenceBalancer
    from knapformer.executor import LocalExecutor

__all__ = [
    "SOLVERS",
    "AutoLayout",
    "BagLayout",
    "BalancerConfig",
    "BalancerConfigError",
    "BalancerInputError",
    "DivergentCallError",
    "InvalidPlanError",
    "PeerLostError",
    "PlanMismatchError",
    "Plan",
    "PlanProblem",
    "LocalExecutor",
    "SequenceBalancer",
    "WorkloadModel",
    "parse_layout",
    "plan_sequences",
]
__version__ = "0.2.0"
"""This release (``knapformer --version``); public API changes are in CHANGELOG.md."""


def __getattr__(name: str) -> Any:
    # torch is only needed for execution; keep `import knapformer` light.
    if name == "SequenceBalancer":
        from knapformer.distributed.balancer import SequenceBalancer

        return SequenceBalancer
    if name == "LocalExecutor":
        from knapformer.executor import LocalExecutor

        return LocalExecutor
    raise AttributeError(f"module 'knapformer' has no attribute {name!r}")
