"""Attention as one opaque custom operator, so that ``torch.compile`` traces around it.

An executor's attention is data-dependent all the way down: the plan decides the exchange sizes,
every exchange first joins a cross-rank agreement, and the varlen kernels loop over
``cu_seqlens``. Traced by Dynamo that means graph breaks, guards on the plan, a recompile per
step, and with ``dynamic=True`` Dynamo walking into the numpy planning code. So under
``torch.compile`` every attention call becomes one ``torch.library`` custom operator,
``knapformer::attend``, whose output has the shape of its input (``(R, h, Dv)`` from q
``(R, h, D)`` and v ``(·, h_kv, Dv)``): its fake kernel needs no plan, its sizes are symbolic,
and a step with other lengths reuses the compiled graph. Inside, at run time, the eager code
runs as it always does (agreement, exchanges, kernels) with autograd enabled on its inputs; the
resulting autograd graph is kept under a key (a one-element tensor the operator also returns),
and the registered backward (``knapformer::attend_backward``, opaque too) runs that graph's
backward — exchanges included — and drops it. What is kept is the graph's *edge* (its last
node), not the output tensor, and the output is returned without a copy: a layer's attention
output lives once, for as long as the compiled graph needs it (keeping it and returning a clone
held two copies of every layer's output until the backward — about 11 GB at 32k tokens over
Flux's 57 blocks). A call traced without gradients (inference, or inputs that need none) keeps
nothing. The operator is tagged ``cudagraph_unsafe`` (it runs collectives and host-side
planning data): ``mode="reduce-overhead"`` then leaves CUDA graphs off for the graphs that
contain it and says why, instead of capturing a call it cannot replay.

*Kinds* of attention register a function here (:func:`register_kind`): ``local`` and ``cross``
for the one-process executor, ``balanced`` and ``balanced_cross`` for ``SequenceBalancer``.
Outside ``torch.compile`` none of this runs: executors call their eager code directly.
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from collections.abc import Callable

import torch

__all__ = ["attend", "lookup", "owner_handle", "register_kind"]

_KINDS: dict[str, Callable] = {}
_OWNERS: dict[int, weakref.ref] = {}
_GRAPHS: dict[int, tuple] = {}
_keys = itertools.count(1)
_lock = threading.Lock()
_log = logging.getLogger("knapformer")
_UNSAFE = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()
"""The operators' tags (the tag is missing from older torch releases)."""
_MAX_KEPT = 4096
"""Forward graphs kept at most (a training step's attention calls, with room to spare)."""


def register_kind(name: str, fn: Callable) -> None:
    """``fn(owner, q, k, v, extra, causal, backend) -> o``: the eager attention of one kind
    (``owner``: the object :func:`attend` was given, or None)."""
    _KINDS[name] = fn


def owner_handle(owner) -> int:
    """A stable int for ``owner`` (held weakly), made once per executor: the operator finds the
    executor by it at run time, and Dynamo specialises on it (a constant for that executor)."""
    if len(_OWNERS) > 1024:  # forget executors that are gone
        for h in [h for h, r in _OWNERS.items() if r() is None]:
            del _OWNERS[h]
    h = id(owner)
    _OWNERS[h] = weakref.ref(owner)
    return h


def _recording():
    """Autograd recording inside an operator's implementation: the dispatcher runs it below the
    autograd keys (they are excluded while it runs); the eager code needs them back."""
    keys = torch._C.DispatchKey
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in (keys.AutogradFunctionality, keys.AutogradOther, keys.AutogradNestedTensor, keys.AutogradCPU):
        exclude = exclude.remove(key)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


def lookup(handle: int):
    """The executor of :func:`owner_handle` ``handle`` (None if it is gone)."""
    ref = _OWNERS.get(handle)
    return ref() if ref is not None else None


@torch.library.custom_op("knapformer::attend", mutates_args=(), tags=_UNSAFE)
def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    extra: list[torch.Tensor],
    kind: str,
    owner: int,
    causal: bool,
    backend: str,
    keep: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    target = lookup(owner)
    if not keep:  # no gradient wanted (decided when the call was traced): no graph to keep
        with torch.no_grad():
            return _KINDS[kind](target, q, k, v, list(extra), causal, backend).clone(), torch.zeros(
                1, dtype=torch.int64
            )
    inputs = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in (q, k, v))
    with torch.enable_grad(), _recording():
        o = _KINDS[kind](target, *inputs, list(extra), causal, backend)
    key = next(_keys)
    edge = torch.autograd.graph.get_gradient_edge(o) if o.requires_grad else None
    handle = torch.tensor([key], dtype=torch.int64)
    with _lock:
        _GRAPHS[key] = (edge, inputs)
        if len(_GRAPHS) > _MAX_KEPT:  # forwards whose backward never came: drop the oldest
            _log.warning("knapformer::attend: %d forward graphs without a backward; dropping the oldest", len(_GRAPHS))
            for old in sorted(_GRAPHS)[: len(_GRAPHS) - _MAX_KEPT]:
                del _GRAPHS[old]
    # the graph lives as long as its key: a backward holds the key until it runs; a forward
    # whose key nobody keeps (activation checkpointing drops the first forward's saved tensors
    # and recomputes the call under a new key) frees its graph with it
    weakref.finalize(handle, _drop, key)
    return o.detach(), handle


def _drop(key: int) -> None:
    with _lock:
        _GRAPHS.pop(key, None)


@_attend.register_fake
def _(q, k, v, extra, kind, owner, causal, backend, keep):
    return q.new_empty((q.shape[0], q.shape[1], v.shape[2])), torch.empty(1, dtype=torch.int64)


@torch.library.custom_op("knapformer::attend_backward", mutates_args=(), tags=_UNSAFE)
def _attend_backward(
    grad: torch.Tensor, key: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with _lock:
        entry = _GRAPHS.pop(int(key.item()), None)
    if entry is None:
        raise RuntimeError("knapformer::attend_backward: the forward's graph is gone (a second backward?)")
    edge, inputs = entry
    if edge is None:  # the output did not depend on the inputs
        return tuple(torch.zeros_like(t) for t in (q, k, v))
    grads = torch.autograd.grad([edge], inputs, [grad], allow_unused=True)
    return tuple(torch.zeros_like(t) if g is None else g for g, t in zip(grads, (q, k, v)))


@_attend_backward.register_fake
def _(grad, key, q, k, v):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output):
    q, k, v, extra = inputs[:4]
    ctx.num_extra = len(extra)
    ctx.save_for_backward(output[1], q, k, v)


def _backward(ctx, grad_o, grad_key):
    key, q, k, v = ctx.saved_tensors
    dq, dk, dv = torch.ops.knapformer.attend_backward(grad_o.contiguous(), key, q, k, v)
    return dq, dk, dv, [None] * ctx.num_extra, None, None, None, None, None


_attend.register_autograd(_backward, setup_context=_setup)


def attend(kind: str, q, k, v, extra=(), *, owner: int = 0, causal: bool = False, backend: str = "auto"):
    """Attention of ``kind`` through the opaque operator (what executors call while compiling);
    ``owner``: the executor's :func:`owner_handle` (0: none), ``extra``: tensors the kind needs."""
    keep = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    return torch.ops.knapformer.attend(q, k, v, list(extra), kind, owner, causal, backend, keep)[0]
