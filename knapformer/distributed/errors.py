"""Errors the balancer raises on *every* rank of a group (never on one rank while the others
wait in a collective)."""

from __future__ import annotations

__all__ = ["BalancerConfigError", "BalancerInputError", "PlanMismatchError"]


class BalancerInputError(ValueError):
    """Bad input on some rank (lengths, a tensor's rows, dtype or shape, a plan), raised on
    every rank of the group with the ranks and the problem named."""


class BalancerConfigError(BalancerInputError):
    """Ranks built their balancers with different settings (layout, solver, cost model, cap,
    rank speeds, ...): detected at construction, before any group is created."""


class PlanMismatchError(BalancerInputError):
    """Ranks hold different plans for the same step (``use_plan`` with different plans, or a
    planner whose float arithmetic differs between machines): detected before data moves."""
