"""Collectives whose tensors outlive gloo's hold on them: the fix for the abort at exit.

Why a process that trained could abort at exit (``terminate called without an active
exception``, SIGABRT): a gloo worker thread marks a collective complete *before* it drops its
own reference to the work object, and with it to the work's tensors. Measured here: right after
``dist.all_reduce`` returns, the worker still holds the tensor in about 30% of calls, for up to
~150 µs. If Python drops its last reference in that window (a temporary), PyTorch keeps the
Python object alive, owned by the tensor; the worker then frees it — which needs the
interpreter lock. During normal running that is harmless; if the interpreter has begun to shut
down, the worker cannot take the lock, the thread is unwound from a ``noexcept`` destructor and
the process aborts. ``gc.collect()`` before ``destroy_process_group()`` only changes when the
last tensors die, not whether the worker still holds them.

The fix, for every collective knapformer issues (:func:`collective`): after the call, wait —
yielding the CPU, typically a few microseconds — until no tensor of the call is held by more
references than before it (``Tensor._use_count()``), i.e. until the worker has let go, before
the caller can drop them. Then no tensor of ours is ever freed by a gloo thread. (A tensor that
is still held after a second is kept alive in a list instead, and an ``atexit`` hook — which
runs while the lock can still be taken — waits for those before the interpreter shuts down.)
Collectives a user issues directly are theirs to keep alive: hold the tensors of your last
collectives until ``destroy_process_group`` (docs, troubleshooting), or call them through
:func:`collective`.
"""

from __future__ import annotations

import atexit
import logging
import time
from collections.abc import Callable, Sequence

import torch

__all__ = ["collective", "held", "settle"]

_log = logging.getLogger("knapformer")
_pending: list[tuple[torch.Tensor, int]] = []
_registered = False


def _released(t: torch.Tensor, baseline: int) -> bool:
    return t._use_count() <= baseline


def collective(fn: Callable[[], object], tensors: Sequence[torch.Tensor], *, patience: float = 1.0):
    """Run the blocking collective ``fn`` over ``tensors`` (its inputs and outputs) and return
    only once no worker holds them any more (or, after ``patience`` seconds, keep them alive
    until exit)."""
    global _registered
    if _pending:
        settle()
    baselines = [t._use_count() for t in tensors]
    out = fn()
    late = [(t, b) for t, b in zip(tensors, baselines) if not _released(t, b)]
    deadline = time.monotonic() + patience
    while late and time.monotonic() < deadline:
        time.sleep(0)  # let the worker run (and drop its reference)
        late = [(t, b) for t, b in late if not _released(t, b)]
    if late:
        _pending.extend(late)
        if not _registered:
            atexit.register(settle, wait=True)
            _registered = True
    return out


def held() -> int:
    """Tensors still held by a finished collective's worker (kept alive here)."""
    return len(_pending)


def settle(*, wait: bool = False, timeout: float = 10.0) -> int:
    """Drop the references whose tensors gloo has released; with ``wait``, wait (releasing the
    interpreter lock) until all are, up to ``timeout`` seconds. Returns how many remain."""
    deadline = time.monotonic() + timeout
    while True:
        _pending[:] = [(t, b) for t, b in _pending if not _released(t, b)]
        if not _pending or not wait:
            return len(_pending)
        if time.monotonic() > deadline:
            _log.warning("knapformer: %d collective buffers still held by gloo after %.0f s", len(_pending), timeout)
            return len(_pending)
        time.sleep(0.001)
