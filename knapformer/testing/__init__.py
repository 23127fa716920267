"""Test helpers shipped with the package: a multi-process spawner and single-process references.

Main API: :func:`run_distributed`, :func:`reference_attention`, :func:`reference_cross_attention`;
for timing tests that hold on any machine load, :class:`SimulatedClock`, :func:`use_clock` and
:func:`blocking_exchanges` (:mod:`knapformer.testing.clock`).
"""

from knapformer.testing.clock import SimulatedClock, blocking_exchanges, use_clock
from knapformer.testing.dist import free_port, keep_freed_memory, pin_to_core, process_context, run_distributed
from knapformer.testing.reference import reference_attention, reference_cross_attention

__all__ = [
    "SimulatedClock",
    "blocking_exchanges",
    "free_port",
    "keep_freed_memory",
    "pin_to_core",
    "process_context",
    "reference_attention",
    "reference_cross_attention",
    "run_distributed",
    "use_clock",
]
