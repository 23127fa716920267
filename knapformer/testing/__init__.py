"""Test helpers shipped with the package: a multi-process spawner and single-process references.

Main API: :func:`run_distributed`, :func:`reference_attention`, :func:`reference_cross_attention`;
a family's exactness measures, :func:`relative_error` and :func:`gradient_error`;
for timing tests that hold on any machine load, :class:`SimulatedClock`, :func:`use_clock` and
:func:`blocking_exchanges` (:mod:`knapformer.testing.clock`).
"""

from knapformer.testing.clock import SimulatedClock, blocking_exchanges, use_clock
from knapformer.testing.dist import free_port, keep_freed_memory, pin_to_core, process_context, run_distributed
from knapformer.testing.exactness import gradient_error, relative_error
from knapformer.testing.reference import reference_attention, reference_cross_attention

__all__ = [
    "SimulatedClock",
    "blocking_exchanges",
    "free_port",
    "gradient_error",
    "keep_freed_memory",
    "pin_to_core",
    "process_context",
    "reference_attention",
    "reference_cross_attention",
    "relative_error",
    "run_distributed",
    "use_clock",
]
