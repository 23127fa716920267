"""``torch.profiler`` ranges of knapformer's phases, named in one place.

A profiled step (``torch.profiler.profile``, or a Kineto/Chrome trace) then shows where the
balancer's time goes: planning, each exchange (forward, and its backward), the local
attention, every ring round (forward and backward) — each as a range named
``knapformer.<phase>``. Ranges cost a few microseconds when no profiler runs.
"""

from __future__ import annotations

from torch.profiler import record_function

__all__ = ["ATTENTION", "EXCHANGE", "PLAN", "RANGES", "RING", "span"]

PLAN = "knapformer.plan"
"""Gathering the lengths, solving and building the route spec (``plan`` / ``use_plan``)."""
EXCHANGE = "knapformer.exchange"
"""One all-to-all, suffixed with what it moves: ``.route``, ``.reverse_route``,
``.pre_attn``, ``.post_attn``, ``.kv_gather`` (``pre_attn``'s K/V all-gather under a ring
plan), ``.gather_sequences``, ``.route_context`` — and ``.backward``
for the gradients' way back."""
ATTENTION = "knapformer.attention"
"""This rank's local attention of one layer (its varlen batches)."""
RING = "knapformer.ring"
"""Ring attention: ``.round.<j>`` per forward round, ``.backward.round.<j>`` per backward one."""

RANGES = (PLAN, EXCHANGE, ATTENTION, RING)
"""Every prefix knapformer names a range with."""


def span(name: str) -> record_function:
    """A profiler range (a context manager) named ``name``."""
    return record_function(name)
