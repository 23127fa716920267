"""Differentiable token exchanges over a balancing group, driven by a :class:`RouteSpec`.

Each public function pairs with a private autograd ``Function`` doing exactly one
``all_to_all_single`` per dtype; its backward is the opposite exchange of gradients. The
Ulysses exchanges around attention live in :mod:`.ulysses`.

Shapes (T local tokens, R routed tokens, n sequences):

=================  ===========================  ===========================  ==================
function           input                        output                       backward exchange
=================  ===========================  ===========================  ==================
route              (T, *F) any dtype            (R, *F) same dtype           reverse route
reverse_route      (R, *F)                      (T, *F)                      route
gather_sequences   (n_local, *F)                (n_group, *F)                all-reduce, own rows
=================  ===========================  ===========================  ==================

Several tensors routed together share one collective per dtype: they are flattened to
(T, f_i), concatenated along features, exchanged, and split — no dtype is promoted (bf16
stays bf16, int64 never passes through a float), bool travels as uint8. Row permutations
(route's send order, and on receipt the routed order when a rank is in several groups) are
applied once to the packed buffer by :func:`permute_rows`, whose backward is a gather too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

import knapformer.distributed.lifetime as lifetime
import knapformer.distributed.trace as trace
from knapformer.distributed.spec import RouteSpec

__all__ = ["all_to_all", "exchange", "gather_sequences", "permute_rows", "reverse_route", "route"]


class _AllToAll(torch.autograd.Function):
    """One ``all_to_all_single`` along dim 0; backward sends gradients the opposite way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group, name: str) -> torch.Tensor:  # type: ignore[override]
        ctx.splits = (send, recv, group, name)
        with trace.span(f"{trace.EXCHANGE}.{name}"):
            return _exchange(x, send, recv, group, phase=name)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        send, recv, group, name = ctx.splits
        with trace.span(f"{trace.EXCHANGE}.{name}.backward"):
            return _exchange(grad, recv, send, group, phase=f"{name} backward"), None, None, None, None


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], group, phase: str = "all_to_all") -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(recv), *x.shape[1:]))
    lifetime.collective(
        lambda: dist.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send, group=group),
        (out, x),
        phase,
        group,
    )
    return out


def exchange(x: torch.Tensor, send: list[int], recv: list[int], group, phase: str = "all_to_all") -> torch.Tensor:
    """One uneven ``all_to_all_single`` along dim 0, not differentiable: for the autograd
    functions of other modules that pair it with their own backward."""
    return _exchange(x, send, recv, group, phase=phase)


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group=None, name: str = "all_to_all") -> torch.Tensor:
    """Differentiable uneven all-to-all along dim 0 (splits in rows, indexed by group rank);
    ``name`` labels its profiler range (``knapformer.exchange.<name>``)."""
    if x.dtype == torch.bool:
        return _AllToAll.apply(x.view(torch.uint8), send, recv, group, name).view(torch.bool)
    return _AllToAll.apply(x, send, recv, group, name)


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
    name: str = "all_to_all",
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
        moved = rows_after(all_to_all(packed, send, recv, group, name))
        pieces = [moved] if len(sent) == 1 else torch.split(moved, widths, dim=1)
        for i, piece in zip(idx, pieces):
            out[i] = after(piece, tensors[i])
    return out  # type: ignore[return-value]


def route(tensors: Sequence[torch.Tensor], spec: RouteSpec, group=None) -> list[torch.Tensor]:
    """Local order -> routed order for each tensor (T, *F) -> (R, *F)."""
    if not spec.routes:  # every sequence whole at home: the routed order is the local order
        return list(tensors)
    idx = spec.indices_on(tensors[0].device)
    after = _identity
    if spec.recv_index is not None:  # a rank in several groups: received by source, routed by group
        after = lambda p: permute_rows(p, idx["recv_index"], idx["recv_inverse"])  # noqa: E731
    return _packed_exchange(
        tensors,
        spec.send_splits,
        spec.recv_splits,
        group,
        rows_before=lambda p: permute_rows(p, idx["send_index"], idx["send_inverse"]),
        rows_after=after,
        name="route",
    )


def reverse_route(tensors: Sequence[torch.Tensor], spec: RouteSpec, group=None) -> list[torch.Tensor]:
    """Routed order -> local order for each tensor (R, *F) -> (T, *F); inverse of :func:`route`."""
    if not spec.routes:
        return list(tensors)
    idx = spec.indices_on(tensors[0].device)
    before = _identity
    if spec.recv_index is not None:
        before = lambda p: permute_rows(p, idx["recv_inverse"], idx["recv_index"])  # noqa: E731
    return _packed_exchange(
        tensors,
        spec.recv_splits,
        spec.send_splits,
        group,
        rows_before=before,
        rows_after=lambda p: permute_rows(p, idx["send_inverse"], idx["send_index"]),
        name="reverse_route",
    )


class _GatherRows(torch.autograd.Function):
    """Every rank's rows (n_r, w) -> all of them in rank order: one even all-gather of rows
    padded to the longest rank (a ring on NCCL: no connection between every pair of ranks, and
    one copy of the rows per rank instead of S); backward: the gradient all-reduced (summed over
    every rank's use of the rows), this rank's rows of it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, counts: list[int], rank: int, group) -> torch.Tensor:  # type: ignore[override]
        ctx.counts, ctx.rank, ctx.group = counts, rank, group
        width = max(max(counts), 1)
        padded = x.new_zeros((width, x.shape[1]))
        padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in counts]
        with trace.span(f"{trace.EXCHANGE}.gather_sequences"):
            lifetime.collective(
                lambda: dist.all_gather(parts, padded, group=group), (padded, *parts), "gather_sequences", group
            )
        return torch.cat([p[:n] for p, n in zip(parts, counts)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        grad = grad.contiguous().clone()
        with trace.span(f"{trace.EXCHANGE}.gather_sequences.backward"):
            lifetime.collective(
                lambda: dist.all_reduce(grad, group=ctx.group), (grad,), "gather_sequences backward", ctx.group
            )
        start = sum(ctx.counts[: ctx.rank])
        return grad[start : start + ctx.counts[ctx.rank]], None, None, None


def gather_sequences(tensors: Sequence[torch.Tensor], counts: list[int], rank: int, group=None) -> list[torch.Tensor]:
    """Per-sequence rows (n_rank, *F) from every rank -> (sum(counts), *F) in group order,
    one all-gather per dtype (tensors of one dtype travel together, flattened to rows);
    differentiable (backward: the gradients summed over the ranks that used each row)."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    for idx in by_dtype.values():
        flat = [_rows_by_features(tensors[i]) for i in idx]
        widths = [f.shape[1] for f in flat]
        packed = flat[0].contiguous() if len(flat) == 1 else torch.cat(flat, dim=1)
        as_bytes = packed.dtype == torch.bool
        moved = _GatherRows.apply(packed.view(torch.uint8) if as_bytes else packed, list(counts), rank, group)
        moved = moved.view(torch.bool) if as_bytes else moved
        for i, piece in zip(idx, torch.split(moved, widths, dim=1)):
            t = tensors[i]
            out[i] = piece.unflatten(1, t.shape[1:]) if t.dim() > 1 else piece.reshape(-1)
    return out  # type: ignore[return-value]
