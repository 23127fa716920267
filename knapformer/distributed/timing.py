"""Timing each rank's balanced region of a step: from the first ``route`` to the end of its
backward (forward and backward of everything in between).

CPU tensors: thread CPU time of the calling thread (what the rank computes; waiting in a
collective costs none). CUDA tensors: two CUDA events on the current stream, read one step
later (when the next ``plan`` asks), so the hot path never waits for the device. The end is
stamped by an identity autograd function on route's inputs, whose backward runs when the
backward pass reaches them — the last thing of the step; without a backward (inference) the
first ``reverse_route`` ends the region.
"""

from __future__ import annotations

import time

import torch

__all__ = ["StepTimer"]


class StepTimer:
    """One rank's balanced-region timer (start at route, stop at route's backward)."""

    def __init__(self) -> None:
        self._start = self._end = None
        self._device: torch.device | None = None
        self.running = False

    def start(self, device: torch.device) -> None:
        if self.running:
            return
        self.running, self._device = True, device
        if device.type == "cuda":
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start, self._end = time.thread_time(), None

    def stop(self) -> None:
        """Stamp the end (again, if called again: the last stamp counts)."""
        if not self.running:
            return
        if self._device is not None and self._device.type == "cuda":
            self._end.record()
        else:
            self._end = time.thread_time()

    def seconds(self) -> float:
        """The measured seconds (NaN if the region never ended); resets the timer."""
        if not self.running or self._end is None:
            out = float("nan")
        elif self._device is not None and self._device.type == "cuda":
            self._end.synchronize()  # recorded a step ago: already done
            out = self._start.elapsed_time(self._end) / 1e3
        else:
            out = self._end - self._start
        self._start = self._end = None
        self.running = False
        return out

    def mark(self, tensors):
        """``tensors`` unchanged, with the end of the region stamped by their backward."""
        if not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors):
            return tensors
        return _StopOnBackward.apply(self, *tensors)


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
