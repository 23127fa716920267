"""Simulated time for timing tests: a clock that moves only when the test moves it.

Why: a test that times real work passes or fails with the machine's load (a busy CI runner, a
laptop compiling beside it). The balancer's timer reads its clock through one seam
(``StepTimer(clock=...)``); :func:`use_clock` gives a balancer a :class:`SimulatedClock`, and
the test advances it by the seconds the rank's work *would* take — computed from its plan, with
whatever slow rank or noise the test wants. Everything else runs as in training: the segments
between exchanges, the seconds riding on the next plan's gather, the online fit, the speed
estimate. The verdict depends on the computed seconds only.

:func:`blocking_exchanges` adds what a collective does to the clock of a rank that arrives
early: it leaves when the last rank arrives (a gloo collective blocks the host; a CUDA stream
waits for NCCL the same way). Within it, every knapformer exchange moves each rank's clock to
the latest arrival time of all ranks (a MAX all-reduce of the arrival times beside the
exchange), so a test sees exactly what timing the whole region would measure — the slowest
peer on every rank — and what pausing the timer at exchanges removes.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.distributed as dist

import knapformer.distributed.timing as timing
from knapformer.distributed.timing import StepTimer

__all__ = ["SimulatedClock", "blocking_exchanges", "use_clock"]


class SimulatedClock:
    """Seconds that pass only when told: :meth:`advance` for this rank's own work (and, under
    :func:`blocking_exchanges`, waits at exchanges). Call it to read the time."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = float(start)

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Let ``seconds`` (finite, >= 0) of this rank's work pass."""
        seconds = float(seconds)
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"a clock advances by a finite number of seconds >= 0, got {seconds!r}")
        self.now += seconds


def use_clock(balancer, clock: SimulatedClock) -> None:
    """Time ``balancer``'s steps on ``clock`` from now on (its ``timer`` mode's own clock is
    not read). The balancer must time its steps (``measure=True`` or ``recalibrate=True``) with
    a host timer (``timer`` ``auto`` on CPU tensors, ``cpu`` or ``wall``)."""
    loop = balancer._loop
    if loop.timer is None:
        raise ValueError("this balancer does not time its steps: build it with measure=True (or recalibrate=True)")
    mode = balancer.config.timer
    if mode == "cuda":
        raise ValueError("timer='cuda' reads CUDA events, not a clock: use 'auto' (CPU tensors), 'cpu' or 'wall'")
    loop.timer = StepTimer(mode, clock=clock)


@contextlib.contextmanager
def blocking_exchanges(clock: SimulatedClock, *, pause_timer: bool = True, group=None) -> Iterator[None]:
    """Within the block, every knapformer exchange blocks ``clock`` the way a collective blocks
    its caller: each rank leaves it at the latest arrival time over ``group`` (default: the
    whole world; every rank of it must make the same exchanges, as a balancer over the whole
    world does). ``pause_timer=False`` leaves the timer running through exchanges — what
    timing the whole region measured, the behaviour :mod:`~knapformer.distributed.timing`
    replaced. Costs a one-value all-reduce per exchange: for tests only."""
    real_pause, real_resume = timing.pause, timing.resume
    arrivals: list[float] = []

    def pause() -> None:
        arrivals.append(clock.now)
        if pause_timer:
            real_pause()

    def resume() -> None:
        latest = torch.tensor([arrivals.pop()], dtype=torch.float64)
        dist.all_reduce(latest, op=dist.ReduceOp.MAX, group=group)
        clock.now = max(clock.now, float(latest))
        if pause_timer:
            real_resume()

    timing.pause, timing.resume = pause, resume
    try:
        yield
    finally:
        timing.pause, timing.resume = real_pause, real_resume
