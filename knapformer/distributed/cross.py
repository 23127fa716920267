"""Context and cross-attention on a balancer: each sequence's context where its queries are.

``route_context`` sends each local sequence's context rows (e.g. its embedded text) to every
rank of the group that holds queries of that sequence, once per step (the exchange itself is
planned by :func:`~knapformer.distributed.context.build_context_route`); every layer's
``cross_attention`` then runs locally — each rank computes all heads for the queries it holds,
no exchange. A bad shape on one rank in ``cross_attention`` is deferred to the next agreement
(zeros meanwhile), since no collective follows it that could carry the error. Both exchanges of
``route_context`` (the context lengths, then the rows) involve only the owners and holders of
the sequences.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch

import knapformer.distributed.ops as ops
from knapformer.attention.bounds import host_bounds, to_device
from knapformer.distributed.checks import SKIP
from knapformer.distributed.context import build_context_route
from knapformer.distributed.exchange import Peers, exchange
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
    _data_device: Any

    def _require_spec(self) -> tuple[Any, Any]: ...


__all__ = ["cross_attention", "cross_attention_tensors", "route_context"]


def route_context(bal: _Balancer, context: torch.Tensor, lens: Sequence[int]) -> RoutedContext:
    """See :meth:`SequenceBalancer.route_context`."""
    plan, spec = bal._require_spec()
    n_local = len(plan.seq_lens[bal.group_rank])
    error = context_problem(context, lens, n_local)
    rows = context.shape[0] if not error else -1
    sizes = _sizes_route(plan, spec)
    (context,), verdict, skip = bal._checks.once(
        "route_context", (context,), rows, error=error, names=("context",), peers=sizes[1].peers
    )
    if verdict == SKIP:  # no exchange on this rank (its error is deferred; its peers leave it out)
        device = context.device if isinstance(context, torch.Tensor) else bal._data_device
        width = context.shape[1:] if isinstance(context, torch.Tensor) and context.dim() > 1 else ()
        empty = np.zeros(0, dtype=np.int64)
        return routed_context(torch.zeros((0, *width), device=device), empty, empty, spec.routed_seq_id)
    return _route_context(bal, plan, spec, context, [int(n) for n in lens], skip)


def context_size_peers(plan, spec) -> frozenset[int]:
    """The ranks ``route_context`` exchanges with (owners and holders of this rank's sequences)."""
    return _sizes_route(plan, spec)[1].peers


def route_context_rows(bal: _Balancer, plan, spec, context: torch.Tensor, lens: list[int], skip) -> RoutedContext:
    """``route_context``'s exchanges for given rows and lengths (a played call's zeros)."""
    return _route_context(bal, plan, spec, context, lens, skip)


def _sizes_route(plan, spec):
    """Which (holder, sequence) pairs this rank sends and receives a context length for (one
    value per pair), cached on the spec."""
    key = "context sizes"
    if key not in spec.cache:
        ones = ops.sequence_rows_route(plan, spec.rank)
        spec.cache[key] = (ones, Peers.from_splits(ones.send_splits, ones.recv_splits, spec.rank))
    return spec.cache[key]


def _route_context(bal: _Balancer, plan, spec, context: torch.Tensor, lens: list[int], skip) -> RoutedContext:
    """The two exchanges of ``route_context``: each owner tells the holders of its sequences
    their context lengths (int64 on the host, the control group: no device synchronisation),
    then sends the rows. Peers in ``skip`` are left out (their sequences get no context rows)."""
    ones, peers = _sizes_route(plan, spec)
    first = int(plan.index.first[spec.rank])
    local = np.asarray(lens, dtype=np.int64)
    got = exchange(
        torch.from_numpy(local[ones.send_rows]), peers.without(skip), bal._checks.control, "route_context sizes"
    )
    ctx_lens = np.zeros(plan.index.num_seqs, dtype=np.int64)
    ctx_lens[first : first + local.size] = local
    ctx_lens[ones.seq_ids] = got.numpy()  # a left-out peer's sequences: 0 rows
    route = build_context_route(plan, bal.group_rank, ctx_lens)
    rows = context.index_select(0, to_device(torch.from_numpy(route.send_rows), context.device))
    moved = Peers.from_splits(route.send_splits, route.recv_splits, spec.rank).without(skip)
    rows = ops.move(rows, moved, bal.group, "route_context")
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
