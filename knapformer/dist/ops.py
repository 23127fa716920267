"""Differentiable exchanges over a balancing group, driven by a :class:`RouteSpec`.

Each public function pairs with a private autograd ``Function`` doing exactly one
``all_to_all_single``; its backward is the opposite exchange of gradients.

Shapes (T local tokens, R routed, A attention tokens, h heads, k bag size, D head dim):

=================  ===========================  ===========================  ==================
function           input                        output                       backward exchange
=================  ===========================  ===========================  ==================
route              (T, *F) any dtype            (R, *F) same dtype           reverse route
reverse_route      (R, *F)                      (T, *F)                      route
pre_attn (each)    (R, h, D)                    (A, h/k, D)                  post_attn
post_attn          (A, h/k, D)                  (R, h, D)                    pre_attn
=================  ===========================  ===========================  ==================

Several tensors routed together share one collective per dtype: they are flattened to
(T, f_i), concatenated along features, exchanged, and split — no dtype is promoted (bf16
stays bf16, int64 never passes through a float), bool travels as uint8.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from knapformer.dist.spec import RouteSpec

__all__ = ["all_to_all", "route", "reverse_route", "pre_attn", "post_attn", "check_heads", "gather_sequences"]


class _AllToAll(torch.autograd.Function):
    """One ``all_to_all_single`` along dim 0; backward sends gradients the opposite way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:  # type: ignore[override]
        ctx.splits = (send, recv, group)
        return _exchange(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        send, recv, group = ctx.splits
        return _exchange(grad, recv, send, group), None, None, None


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group=None) -> torch.Tensor:
    """Differentiable uneven all-to-all along dim 0 (splits in rows, indexed by group rank)."""
    if x.dtype == torch.bool:
        return _AllToAll.apply(x.view(torch.uint8), send, recv, group).view(torch.bool)
    return _AllToAll.apply(x, send, recv, group)


def _packed_exchange(
    tensors: Sequence[torch.Tensor], send: list[int], recv: list[int], group, before, after
) -> list[torch.Tensor]:
    """Exchange several (N, *F_i) tensors with one collective per dtype.
    ``before`` reorders rows before sending, ``after`` after receiving."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    for idx in by_dtype.values():
        sent = [before(tensors[i]) for i in idx]
        shapes = [tuple(s.shape[1:]) for s in sent]
        widths = [math.prod(shp) for shp in shapes]
        flat = [s.reshape(s.shape[0], w) for s, w in zip(sent, widths)]
        packed = flat[0] if len(flat) == 1 else torch.cat(flat, dim=1)
        moved = all_to_all(packed, send, recv, group)
        pieces = [moved] if len(flat) == 1 else torch.split(moved, widths, dim=1)
        for i, piece, shp in zip(idx, pieces, shapes):
            out[i] = after(piece.reshape(moved.shape[0], *shp))
    return out  # type: ignore[return-value]


def route(tensors: Sequence[torch.Tensor], spec: RouteSpec, group=None) -> list[torch.Tensor]:
    """Local order -> routed order for each tensor (T, *F) -> (R, *F)."""
    idx = spec.indices_on(tensors[0].device)
    return _packed_exchange(
        tensors, spec.send_splits, spec.recv_splits, group,
        before=lambda t: t.index_select(0, idx["send_index"]), after=lambda t: t,
    )


def reverse_route(tensors: Sequence[torch.Tensor], spec: RouteSpec, group=None) -> list[torch.Tensor]:
    """Routed order -> local order for each tensor (R, *F) -> (T, *F); inverse of :func:`route`."""
    idx = spec.indices_on(tensors[0].device)
    return _packed_exchange(
        tensors, spec.recv_splits, spec.send_splits, group,
        before=lambda t: t, after=lambda t: t.index_select(0, idx["send_inverse"]),
    )


def gather_sequences(tensors: Sequence[torch.Tensor], counts: list[int], rank: int, group=None) -> list[torch.Tensor]:
    """Per-sequence rows (n_rank, *F) from every rank -> (sum(counts), *F) in group order.
    One all-to-all that sends this rank's rows to every rank; backward sums the gradients
    each copy received (an all-gather whose backward works on gloo too)."""
    S = len(counts)
    return _packed_exchange(
        tensors, [counts[rank]] * S, list(counts), group,
        before=lambda t: t.repeat(S, *([1] * (t.dim() - 1))), after=lambda t: t,
    )


def check_heads(num_heads: int, spec: RouteSpec) -> None:
    """Every bag size must divide the head count; checked from the plan, identically on every
    rank, so all ranks raise together instead of hanging in a collective."""
    bad = [k for k in spec.all_bag_sizes if num_heads % k]
    if bad:
        raise ValueError(
            f"{num_heads} attention heads cannot be split evenly over bag size {bad[0]} "
            f"(bag sizes in this plan: {list(spec.all_bag_sizes)})"
        )


def pre_attn(tensors: Sequence[torch.Tensor], spec: RouteSpec, group=None) -> list[torch.Tensor]:
    """(R, h, D) chunks × all heads -> (A, h/k, D) whole sequences × this rank's heads."""
    h = tensors[0].shape[1]
    check_heads(h, spec)
    if not spec.any_multi_rank_bag:
        return list(tensors)
    k = spec.bag_size
    idx = spec.indices_on(tensors[0].device)

    def before(t: torch.Tensor) -> torch.Tensor:  # (R, h, D) -> (k*R, h/k, D) grouped by member
        R, _, D = t.shape
        t = t.reshape(R, k, h // k, D)
        if not spec.heads_in_order:
            t = t.index_select(1, idx["head_order"])
        return t.transpose(0, 1).reshape(k * R, h // k, D)

    return _packed_exchange(
        tensors, spec.attn_send_splits, spec.attn_recv_splits, group,
        before=before, after=lambda t: t.index_select(0, idx["attn_index"]),
    )


def post_attn(tensors: Sequence[torch.Tensor], spec: RouteSpec, group=None) -> list[torch.Tensor]:
    """(A, h/k, D) -> (R, h, D); inverse of :func:`pre_attn`."""
    if not spec.any_multi_rank_bag:
        return list(tensors)
    k = spec.bag_size
    idx = spec.indices_on(tensors[0].device)

    def after(t: torch.Tensor) -> torch.Tensor:  # (k*R, h/k, D) by member -> (R, h, D)
        _, hk, D = t.shape
        R = spec.num_routed
        t = t.reshape(k, R, hk, D)
        if not spec.heads_in_order:
            t = t.index_select(0, idx["head_inverse"])
        return t.transpose(0, 1).reshape(R, k * hk, D)

    return _packed_exchange(
        tensors, spec.attn_recv_splits, spec.attn_send_splits, group,
        before=lambda t: t.index_select(0, idx["attn_inverse"]), after=after,
    )
