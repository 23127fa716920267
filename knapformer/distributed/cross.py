"""Context and cross-attention on a balancer: each sequence's context where its queries are.

``route_context`` sends each local sequence's context rows (e.g. its embedded text) to every
rank of the group that holds queries of that sequence, once per step (the exchange itself is
planned by :func:`~knapformer.distributed.context.build_context_route`); every layer's
``cross_attention`` then runs locally — each rank computes all heads for the queries it holds,
no exchange. A bad shape on one rank in ``cross_attention`` is deferred to the next agreement
(zeros meanwhile), since no collective follows it that could carry the error.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

import knapformer.distributed.ops as ops
from knapformer.attention.bounds import host_bounds, to_device
from knapformer.distributed.agree import gather_ints
from knapformer.distributed.context import build_context_route
from knapformer.executor.protocol import (
    RoutedContext,
    context_problem,
    cross_attend,
    cross_attend_tensors,
    cross_problem,
    routed_context,
)


class _Balancer(Protocol):
    """What these calls use of :class:`~knapformer.distributed.balancer.SequenceBalancer`
    (named here, not imported: the balancer imports this module)."""

    group: Any
    group_rank: int
    config: Any
    _checks: Any

    def _require_spec(self) -> tuple[Any, Any]: ...


__all__ = ["cross_attention", "cross_attention_tensors", "route_context"]


def route_context(bal: _Balancer, context: torch.Tensor, lens: Sequence[int]) -> RoutedContext:
    """See :meth:`SequenceBalancer.route_context`."""
    plan, spec = bal._require_spec()
    n_local = len(plan.seq_lens[bal.group_rank])
    error = context_problem(context, lens, n_local)
    if error:
        bal._checks.agree("route_context", error)
    (context,) = bal._checks.tensors("route_context", (context,), context.shape[0], names=("context",))
    # every sequence's context length, gathered on the host (the control group: no device sync)
    all_lens = gather_ints(bal._checks.control, [int(n) for n in lens], plan.index.counts.tolist(), "route_context")
    route = build_context_route(plan, bal.group_rank, all_lens)
    rows = context.index_select(0, to_device(torch.from_numpy(route.send_rows), context.device))
    if route.moves:
        rows = ops.all_to_all(rows, route.send_splits, route.recv_splits, bal.group, "route_context")
    return routed_context(rows, route.seq_ids, route.lens, spec.routed_seq_id)


def cross_attention(
    bal: _Balancer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: RoutedContext
) -> torch.Tensor:
    """See :meth:`SequenceBalancer.cross_attention`."""
    _, spec = bal._require_spec()
    error = cross_problem(q, k, v, context, spec.num_routed)
    if error and all(isinstance(t, torch.Tensor) and t.dim() == 3 for t in (q, v)):
        bal._checks.defer(f"cross_attention on rank {bal.group_rank}: {error}")
        return q.new_zeros((q.shape[0], q.shape[1], v.shape[2])) + 0 * q.sum()
    if error:
        raise ValueError(f"cross_attention: {error}")
    return cross_attend(q, k, v, context, bal.config.attn_backend)


def cross_attention_tensors(bal: _Balancer, q, k, v, tensors: list[torch.Tensor]) -> torch.Tensor:
    """:func:`cross_attention` given the context's tensors (``context_tensors``): what the
    compiled path runs inside its opaque operator."""
    _, spec = bal._require_spec()
    cu_q, cu_k = host_bounds(tensors[0]), host_bounds(tensors[1])
    error = ""
    if q.shape[0] != spec.num_routed or q.shape[0] != cu_q[-1]:
        error = f"q has {q.shape[0]} rows; routed tokens: {spec.num_routed}"
    elif k.shape[0] != cu_k[-1] or v.shape[0] != k.shape[0]:
        error = f"k/v have {k.shape[0]}/{v.shape[0]} rows; the routed context has {cu_k[-1]}"
    if error:
        bal._checks.defer(f"cross_attention on rank {bal.group_rank}: {error}")
        return q.new_zeros((q.shape[0], q.shape[1], v.shape[2])) + 0 * q.sum()
    return cross_attend_tensors(q, k, v, tensors, bal.config.attn_backend)
