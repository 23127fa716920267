"""The errors knapformer raises on purpose (torch-free, so ``import knapformer`` exports them).

The balancer's errors are raised on *every* rank of a group (never on one rank while the
others wait in a collective); planning errors are plain values of the pure layers.
"""

from __future__ import annotations

from knapformer.plan.validate import InvalidPlanError

__all__ = [
    "BalancerConfigError",
    "BalancerInputError",
    "DivergentCallError",
    "InvalidPlanError",
    "PeerLostError",
    "PlanMismatchError",
]


class BalancerInputError(ValueError):
    """Bad input on some rank (lengths, a tensor's rows, dtype or shape, a plan), raised on
    every rank of the group with the ranks and the problem named."""


class BalancerConfigError(BalancerInputError):
    """Ranks built their balancers with different settings (layout, solver, cost model, cap,
    rank speeds, ...): detected at construction, before any group is created."""


class PlanMismatchError(BalancerInputError):
    """Ranks hold different plans for the same step (``use_plan`` with different plans, or a
    planner whose float arithmetic differs between machines): detected before data moves."""


class DivergentCallError(BalancerInputError):
    """Ranks reached different exchanges (a layer skipped on some ranks, a data-dependent
    branch, a different number of ``plan`` calls): detected before data moves, with every
    rank's call named."""


class PeerLostError(RuntimeError):
    """A knapformer exchange could not complete: a rank of the balancing group died (its
    process is gone) or did not answer within ``BalancerConfig.collective_timeout_s``. Raised
    on every surviving rank that waits on it, naming the phase (``plan``, ``route``, a layer's
    ``pre_attn`` …) and, when they run on this host, the ranks whose processes are gone. The
    job cannot go on with this group: exit, and let the launcher restart it (``torchrun
    --max-restarts``) from the last checkpoint."""
