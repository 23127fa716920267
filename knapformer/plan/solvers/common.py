"""Helpers every solver shares: stamping the planning time, the memory-cap test."""

from __future__ import annotations

import time

import numpy as np

from knapformer.plan.plan import Plan

__all__ = ["fits_cap", "stamp"]


def stamp(plan: Plan, t0: float) -> Plan:
    """Record the wall time since ``t0`` (``time.perf_counter``; solver + chunking) on the plan."""
    object.__setattr__(plan, "plan_seconds", time.perf_counter() - t0)
    return plan


def fits_cap(tokens: np.ndarray, bag_size: np.ndarray, cap: int | None) -> np.ndarray:
    """Whether a bag holding ``tokens`` keeps every rank at or under ``cap`` tokens
    (chunking spreads a bag's tokens so rank counts differ by at most one)."""
    if cap is None:
        return np.ones(np.shape(tokens), dtype=bool)
    return -(-tokens // bag_size) <= cap
