"""knapformer: balance variable-length DiT training across GPUs.

Main API: :class:`WorkloadModel` (cost of a sequence), :class:`BalancerConfig` (every
balancer setting, validated), :func:`parse_layout` (bag specs),
:func:`plan_sequences` / :class:`Plan` (pure planning), and :class:`SequenceBalancer`
(routing and Ulysses attention over torch.distributed; imported lazily so that planning
never imports torch).
"""

from __future__ import annotations

from typing import Any

from knapformer.config import BalancerConfig
from knapformer.layout import BagLayout, parse_layout
from knapformer.plan import SOLVERS, Plan, PlanProblem, plan_sequences
from knapformer.workload import WorkloadModel

__all__ = [
    "SOLVERS",
    "BagLayout",
    "BalancerConfig",
    "Plan",
    "PlanProblem",
    "SequenceBalancer",
    "WorkloadModel",
    "parse_layout",
    "plan_sequences",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # torch is only needed for execution; keep `import knapformer` light.
    if name == "SequenceBalancer":
        from knapformer.distributed.balancer import SequenceBalancer

        return SequenceBalancer
    raise AttributeError(f"module 'knapformer' has no attribute {name!r}")
