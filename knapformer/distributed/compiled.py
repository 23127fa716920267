"""The balancer under ``torch.compile``: its attention kinds and its routed positions as opaque
custom operators (see :mod:`knapformer.executor.opaque` for why and how).

- ``balanced``: :meth:`SequenceBalancer.attention`'s eager code (agreement, pre exchange,
  kernels, post exchange) inside ``knapformer::attend``;
- ``balanced_cross``: :meth:`SequenceBalancer.cross_attention`'s, given the context's tensors;
- ``knapformer::routed_positions``: this step's (sequence id, position) of each routed token,
  shaped like the routed tokens a caller passes, so the compiled graph never holds the plan.

Everything else the balancer does once per step (``plan``, ``route``, ``reverse_route``,
``gather_sequences``, ``route_context``) runs eagerly at a graph break (:func:`eager_only`).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import TypeVar

import torch

from knapformer.executor.opaque import lookup, register_kind

__all__ = ["eager_only", "routed_positions"]

F = TypeVar("F", bound=Callable)


def eager_only(fn: F) -> F:
    """``torch.compiler.disable(fn)``, without importing ``torch._dynamo`` when knapformer is
    imported: that import costs ~1.2 s of every process's start (every rank of every job),
    and nothing can be compiling before something else has imported it. The wrapper carries
    the marks dynamo reads from a disabled function (a call to it from a compiled region is a
    graph break, as with ``torch.compiler.disable``); once ``torch._dynamo`` is loaded, each
    call runs through ``torch._dynamo.disable(fn)`` (frames inside are never compiled)."""
    disabled = None

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        nonlocal disabled
        if "torch._dynamo" not in sys.modules:
            return fn(*args, **kwargs)
        if disabled is None:
            disabled = torch._dynamo.disable(fn)
        return disabled(*args, **kwargs)

    wrapper._torchdynamo_disable = True  # type: ignore[attr-defined]
    wrapper._torchdynamo_disable_msg = None  # type: ignore[attr-defined]
    wrapper._torchdynamo_disable_recursive = True  # type: ignore[attr-defined]
    wrapper._torchdynamo_orig_callable = fn  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]


def _balanced(bal, q, k, v, extra, causal, backend):
    return bal._attention_eager(q, k, v, causal)


def _balanced_cross(bal, q, k, v, extra, causal, backend):
    from knapformer.distributed.cross import cross_attention_tensors

    return cross_attention_tensors(bal, q, k, v, extra)


register_kind("balanced", _balanced)
register_kind("balanced_cross", _balanced_cross)


@torch.library.custom_op("knapformer::routed_positions", mutates_args=())
def _routed_positions(like: torch.Tensor, owner: int) -> tuple[torch.Tensor, torch.Tensor]:
    seq_id, pos = lookup(owner)._positions_eager(like.device)
    return seq_id.clone(), pos.clone()


@_routed_positions.register_fake
def _(like, owner):
    n = like.shape[0]
    return like.new_empty((n,), dtype=torch.int64), like.new_empty((n,), dtype=torch.int64)


def routed_positions(like: torch.Tensor, owner: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The routed tokens' (sequence id, position), one per row of ``like``."""
    return torch.ops.knapformer.routed_positions(like, owner)
