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
stays bf16, int64 never passes through a float), bool travels as uint8. Row permutations
(route's send order, Ulysses's attention order) are applied once to the packed buffer by
:func:`permute_rows`, whose backward is a gather too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from knapformer.distributed.spec import RouteSpec

__all__ = [
    "all_to_all",
    "attn_output_shape",
    "permute_rows",
    "route",
    "reverse_route",
    "pre_attn",
    "post_attn",
    "check_heads",
    "gather_sequences",
]


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


class _PermuteRows(torch.autograd.Function):
    """``x[index]`` for a full row permutation; backward gathers with the inverse permutation
    (autograd's ``index_select`` backward would zero-fill and scatter-add instead)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(inverse)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def permute_rows(x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """Differentiable ``x[index]`` where ``index`` is a permutation of all rows of ``x`` and
    ``inverse`` its inverse (both precomputed once per plan)."""
    return _PermuteRows.apply(x, index, inverse)


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def _rows_by_features(t: torch.Tensor) -> torch.Tensor:
    """(N, *F) -> (N, prod(F)) (also for N == 0)."""
    return t.reshape(t.shape[0], math.prod(t.shape[1:]))


def _packed_exchange(
    tensors: Sequence[torch.Tensor],
    send: list[int],
    recv: list[int],
    group,
    *,
    before=None,
    rows_before=_identity,
    rows_after=_identity,
    after=None,
) -> list[torch.Tensor]:
    """Exchange several tensors with one collective per dtype, copying each value as few times
    as possible (this runs twice per attention layer in multi-rank bags).

    ``before(t)`` gives a (possibly strided) view ``(..., w)`` whose leading dims flatten into
    the rows to send; the views of one dtype are concatenated along features (one copy), the
    packed rows are reordered by ``rows_before`` (a row permutation), exchanged, reordered by
    ``rows_after``, split, and ``after(piece, t)`` shapes each (rows, w) piece (views only)."""
    if before is None:
        before = _rows_by_features
    if after is None:
        after = lambda piece, t: piece.unflatten(1, t.shape[1:]) if t.dim() > 1 else piece.reshape(-1)  # noqa: E731
    out: list[torch.Tensor | None] = [None] * len(tensors)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    for idx in by_dtype.values():
        sent = [before(tensors[i]) for i in idx]
        widths = [s.shape[-1] for s in sent]
        packed = sent[0].contiguous() if len(sent) == 1 else torch.cat(sent, dim=-1)
        packed = rows_before(packed.reshape(math.prod(packed.shape[:-1]), sum(widths)))
        moved = rows_after(all_to_all(packed, send, recv, group))
        pieces = [moved] if len(sent) == 1 else torch.split(moved, widths, dim=1)
        for i, piece in zip(idx, pieces):
            out[i] = after(piece, tensors[i])
    return out  # type: ignore[return-value]


def route(tensors: Sequence[torch.Tensor], spec: RouteSpec, group=None) -> list[torch.Tensor]:
    """Local order -> routed order for each tensor (T, *F) -> (R, *F)."""
    idx = spec.indices_on(tensors[0].device)
    return _packed_exchange(
        tensors,
        spec.send_splits,
        spec.recv_splits,
        group,
        rows_before=lambda p: permute_rows(p, idx["send_index"], idx["send_inverse"]),
    )


def reverse_route(tensors: Sequence[torch.Tensor], spec: RouteSpec, group=None) -> list[torch.Tensor]:
    """Routed order -> local order for each tensor (R, *F) -> (T, *F); inverse of :func:`route`."""
    idx = spec.indices_on(tensors[0].device)
    return _packed_exchange(
        tensors,
        spec.recv_splits,
        spec.send_splits,
        group,
        rows_after=lambda p: permute_rows(p, idx["send_inverse"], idx["send_index"]),
    )


def gather_sequences(tensors: Sequence[torch.Tensor], counts: list[int], rank: int, group=None) -> list[torch.Tensor]:
    """Per-sequence rows (n_rank, *F) from every rank -> (sum(counts), *F) in group order.
    One all-to-all that sends this rank's rows to every rank; backward sums the gradients
    each copy received (an all-gather whose backward works on gloo too)."""
    S = len(counts)
    return _packed_exchange(
        tensors,
        [counts[rank]] * S,
        list(counts),
        group,
        before=lambda t: _rows_by_features(t).repeat(S, 1),
    )


def check_heads(num_heads: int, spec: RouteSpec) -> str:
    """Why ``num_heads`` cannot run this plan ("" if it can): every group size must divide the
    head count. Decided from the plan, identically on every rank."""
    bad = [k for k in spec.all_bag_sizes if num_heads % k]
    if bad:
        return (
            f"{num_heads} attention heads cannot be split evenly over bag size {bad[0]} "
            f"(bag sizes in this plan: {list(spec.all_bag_sizes)})"
        )
    return ""


def attn_output_shape(spec: RouteSpec, num_heads: int, head_dim: int) -> tuple[int, int, int]:
    """Shape :func:`post_attn` expects: attention tokens × this rank's heads × head dim."""
    return (spec.num_attn, num_heads // spec.bag_size, head_dim)


def pre_attn(tensors: Sequence[torch.Tensor], spec: RouteSpec, group=None) -> list[torch.Tensor]:
    """(R, h, D_i) chunks × all heads -> (A, h/k, D_i) whole sequences × this rank's heads.

    q, k and v travel packed: one copy groups them by destination member, one row permutation
    puts the received rows in attention order, and the outputs are strided views of that
    buffer (SDPA and flash-attn accept them)."""
    h = tensors[0].shape[1]
    error = check_heads(h, spec)
    if error:
        raise ValueError(error)
    if not spec.any_multi_rank_bag:
        return list(tensors)
    k = spec.bag_size
    idx = spec.indices_on(tensors[0].device)

    def before(t: torch.Tensor) -> torch.Tensor:  # (R, h, D) -> (k, R, h/k * D), a view by member
        R, _, D = t.shape
        t = t.reshape(R, k, (h // k) * D)
        if not spec.heads_in_order:
            t = t.index_select(1, idx["head_order"])
        return t.transpose(0, 1)

    return _packed_exchange(
        tensors,
        spec.attn_send_splits,
        spec.attn_recv_splits,
        group,
        before=before,
        rows_after=lambda p: permute_rows(p, idx["attn_index"], idx["attn_inverse"]),
        after=lambda piece, t: piece.unflatten(1, (h // k, t.shape[2])),
    )


def post_attn(tensors: Sequence[torch.Tensor], spec: RouteSpec, group=None) -> list[torch.Tensor]:
    """(A, h/k, D) -> (R, h, D); inverse of :func:`pre_attn`."""
    if not spec.any_multi_rank_bag:
        return list(tensors)
    k = spec.bag_size
    R = spec.num_routed
    idx = spec.indices_on(tensors[0].device)

    def after(piece: torch.Tensor, t: torch.Tensor) -> torch.Tensor:  # (k*R, h/k*D) by member -> (R, h, D)
        hk, D = t.shape[1], t.shape[2]
        piece = piece.reshape(k, R, hk * D)
        if not spec.heads_in_order:
            piece = piece.index_select(0, idx["head_inverse"])
        return piece.transpose(0, 1).reshape(R, k * hk, D)

    return _packed_exchange(
        tensors,
        spec.attn_recv_splits,
        spec.attn_send_splits,
        group,
        rows_before=lambda p: permute_rows(p, idx["attn_inverse"], idx["attn_index"]),
        after=after,
    )
