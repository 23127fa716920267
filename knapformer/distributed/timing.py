"""Timing each rank's own work in a step: from the first ``route`` to the end of its backward,
*without* the time spent waiting for other ranks inside knapformer's exchanges.

Why without the waits: a rank that waits in an exchange for a slower peer is not slow itself.
A clock around the whole region measures the slowest peer on every rank (every rank looks
equally slow), so an online fit could never correct a wrong cost model and speed estimation
would random-walk. So the region is cut into *segments* at every knapformer collective
(:func:`pause` before it blocks, :func:`resume` after; ``lifetime.collective``/``wait`` call
them) and only the segments count.

Modes (``BalancerConfig.timer``):

- ``cpu``: thread CPU time of the calling thread (waiting in a gloo collective costs none);
  the default for CPU tensors;
- ``wall``: wall clock, segments only — what a CUDA stream's events measure, on CPU: a gloo
  collective blocks the host the way a CUDA stream waits for NCCL (tests use it);
- ``cuda``: a pair of CUDA events per segment on the current stream (an event recorded after
  an exchange completes when the exchange has); read one step later without a device
  synchronisation (a step whose events are not complete by then gives NaN); the default for
  CUDA tensors.

The end is stamped by an identity autograd function on route's inputs, whose backward runs when
the backward pass reaches them — the last thing of the step; without a backward (inference)
the first ``reverse_route`` ends the region. A step whose end was never stamped (route inputs
that need no gradient, under a backward) measures NaN.

The ``cpu`` and ``wall`` modes read their clock through one seam, ``StepTimer(clock=...)``:
:func:`knapformer.testing.use_clock` gives a balancer's timer a simulated clock, so that tests
drive the closed loop with computed seconds and their verdicts never depend on machine load.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

import torch

from knapformer.config import TIMER_MODES as MODES

__all__ = ["MODES", "StepTimer", "pause", "resume"]

_ACTIVE: list[StepTimer] = []
"""The timers whose steps are in progress, one per balancer that is timing a step: what
:func:`pause`/:func:`resume` stamp. Every one of them, because a rank that waits in any
balancer's exchange does no work of its own for any of them (two balancers in one process —
two models, or a model and its EMA teacher — each keep their own timer)."""


def pause() -> None:
    """A knapformer collective is about to block: close the running timers' segments."""
    for timer in _ACTIVE:
        timer.pause()


def resume() -> None:
    """The collective returned: open a new segment in each running timer."""
    for timer in _ACTIVE:
        timer.resume()


def _cuda_event():
    return torch.cuda.Event(enable_timing=True)


class StepTimer:
    """One rank's own-work timer for a step (module docstring). ``mode``: one of :data:`MODES`;
    ``clock``: seconds now, read instead of the mode's own clock in the ``cpu`` and ``wall``
    modes (a simulated clock in tests; CUDA events are never replaced)."""

    def __init__(self, mode: str = "auto", clock: Callable[[], float] | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"timer mode must be one of {MODES}, got {mode!r}")
        if clock is not None and not callable(clock):
            raise TypeError(f"clock must be a callable returning seconds, got {type(clock).__name__}")
        self.mode = mode
        self._clock = clock
        self.kind: str | None = None
        """The resolved mode (``cpu``, ``wall`` or ``cuda``), set by the first :meth:`start`."""
        self.running = False
        self._segments: list = []  # closed segments: seconds, or (start, end) CUDA events
        self._open = None  # the open segment's start (a time, or an event)
        self._stopped = None  # closed segments at the last stop (None: never stopped)
        self._pending: collections.deque = collections.deque()  # CUDA: stopped steps, read a step late

    @property
    def lag(self) -> int:
        """Steps between a step's end and its seconds being read (1 for CUDA events)."""
        return 1 if self.kind == "cuda" else 0

    def _now(self):
        if self.kind == "cuda":
            e = _cuda_event()
            e.record()
            return e
        if self._clock is not None:
            return self._clock()
        return time.thread_time() if self.kind == "cpu" else time.perf_counter()

    def start(self, device: torch.device) -> None:
        """Open the step's region (a second call in the same step does nothing)."""
        if self.running:
            return
        if self.kind is None:
            auto = "cuda" if device.type == "cuda" else "cpu"
            self.kind = auto if self.mode == "auto" else self.mode
        self.running = True
        self._segments, self._stopped = [], None
        self._open = self._now()
        if self not in _ACTIVE:
            _ACTIVE.append(self)

    def pause(self) -> None:
        if self.running and self._open is not None:
            self._segments.append((self._open, self._now()))
            self._open = None

    def resume(self) -> None:
        if self.running and self._open is None:
            self._open = self._now()

    def stop(self) -> None:
        """Stamp the end (again, if called again: the last stamp counts)."""
        if not self.running:
            return
        self.pause()
        self._stopped = len(self._segments)
        self.resume()  # what follows counts only if a later stop stamps it

    def _close(self) -> list | None:
        """End the step: its counted segments (None if its end was never stamped)."""
        segments = self._segments[: self._stopped] if self._stopped is not None else None
        self._segments, self._open, self._stopped = [], None, None
        self.running = False
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        return segments

    def seconds(self) -> float:
        """The measured seconds of the step ``lag`` steps back (NaN if its end was never
        stamped, or — CUDA — its events are not complete: no device synchronisation); ends the
        current step's region."""
        if self.kind != "cuda":
            segments = self._close() if self.running else None
            return float("nan") if segments is None else float(sum(b - a for a, b in segments))
        if self.running:
            self._pending.append(self._close())
        if len(self._pending) <= self.lag:
            return float("nan")
        return _cuda_seconds(self._pending.popleft(), False)

    def drain(self) -> list[float]:
        """Seconds of every step still waiting to be read (CUDA: synchronises with their last
        event; :meth:`SequenceBalancer.flush`)."""
        out = []
        if self.running:
            self._pending.append(self._close())
        while self._pending:
            out.append(_cuda_seconds(self._pending.popleft(), True))
        return out

    def mark(self, tensors):
        """``tensors`` unchanged, with the end of the region stamped by their backward."""
        if not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors):
            return tensors
        return _StopOnBackward.apply(self, *tensors)


def _cuda_seconds(segments, wait: bool) -> float:
    if not segments:
        return float("nan")
    last = segments[-1][1]
    if not last.query():
        if not wait:
            return float("nan")
        last.synchronize()
    return sum(a.elapsed_time(b) for a, b in segments) / 1e3


class _StopOnBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, timer: StepTimer, *tensors):  # type: ignore[override]
        ctx.timer = timer
        out = tuple(t.view_as(t) for t in tensors)
        return out if len(out) > 1 else out[0]

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        ctx.timer.stop()
        return None, *grads
