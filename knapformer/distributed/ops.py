"""Differentiable token exchanges over a balancing group, driven by a :class:`RouteSpec`.

Each public function moves rows with the one exchange primitive of
:mod:`~knapformer.distributed.exchange` (batched point-to-point with the peers that send or
receive something; a rank whose tokens stay home exchanges with nobody); the backward is the
opposite exchange of gradients. The Ulysses exchanges around attention live in
:mod:`.ulysses`.

Shapes (T local tokens, R routed tokens, n sequences):

=================  ===========================  ===========================  =========================
function           input                        output                       backward exchange
=================  ===========================  ===========================  =========================
route              (T, *F) any dtype            (R, *F) same dtype           reverse route
reverse_route      (R, *F)                      (T, *F)                      route
gather_sequences   (n_local, *F)                (n_group, *F)                each holder's rows back
                                                                             to the owner, summed
=================  ===========================  ===========================  =========================

Several tensors routed together share one exchange per dtype: they are flattened to (T, f_i),
concatenated along features, exchanged, and split — no dtype is promoted (bf16 stays bf16,
int64 never passes through a float), bool travels as uint8. Row permutations (route's send
order, and on receipt the routed order when a rank is in several groups) are applied once to
the packed buffer by :func:`permute_rows`, whose backward is a gather too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from knapformer.attention.bounds import to_device
from knapformer.distributed.exchange import Exchange, Peers
from knapformer.distributed.spec import RouteSpec

__all__ = [
    "gather_sequences",
    "move",
    "permute_rows",
    "reverse_route",
    "route",
    "sequence_rows_peers",
    "sequence_rows_route",
]


def move(x: torch.Tensor, peers: Peers, group, name: str, part: int = 0) -> torch.Tensor:
    """Differentiable exchange of the rows of ``x`` as ``peers`` says (bool as uint8);
    ``name`` labels its profiler range (``knapformer.exchange.<name>``) and its gloo tag,
    ``part`` tells apart the exchanges of one call's dtypes."""
    if x.dtype == torch.bool:
        return Exchange.apply(x.view(torch.uint8), peers, group, name, part).view(torch.bool)
    return Exchange.apply(x, peers, group, name, part)


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
    peers: Peers,
    group,
    *,
    before=None,
    rows_before=_identity,
    rows_after=_identity,
    after=None,
    name: str = "all_to_all",
) -> list[torch.Tensor]:
    """Exchange several tensors with one exchange per dtype, copying each value as few times
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
    for part, idx in enumerate(by_dtype.values()):
        sent = [before(tensors[i]) for i in idx]
        widths = [s.shape[-1] for s in sent]
        packed = sent[0].contiguous() if len(sent) == 1 else torch.cat(sent, dim=-1)
        packed = rows_before(packed.reshape(math.prod(packed.shape[:-1]), sum(widths)))
        moved = rows_after(move(packed, peers, group, name, part))
        pieces = [moved] if len(sent) == 1 else torch.split(moved, widths, dim=1)
        for i, piece in zip(idx, pieces):
            out[i] = after(piece, tensors[i])
    return out  # type: ignore[return-value]


def route(tensors: Sequence[torch.Tensor], spec: RouteSpec, group=None, skip=frozenset()) -> list[torch.Tensor]:
    """Local order -> routed order for each tensor (T, *F) -> (R, *F); ``skip``: peers left out
    (their rows are zeros)."""
    if not spec.routes:  # this rank's sequences whole at home: the routed order is the local order
        return list(tensors)
    idx = spec.indices_on(tensors[0].device)
    after = _identity
    if spec.recv_index is not None:  # a rank in several groups: received by source, routed by group
        after = lambda p: permute_rows(p, idx["recv_index"], idx["recv_inverse"])  # noqa: E731
    return _packed_exchange(
        tensors,
        spec.route_peers.without(skip),
        group,
        rows_before=lambda p: permute_rows(p, idx["send_index"], idx["send_inverse"]),
        rows_after=after,
        name="route",
    )


def reverse_route(tensors: Sequence[torch.Tensor], spec: RouteSpec, group=None, skip=frozenset()) -> list[torch.Tensor]:
    """Routed order -> local order for each tensor (R, *F) -> (T, *F); inverse of :func:`route`."""
    if not spec.routes:
        return list(tensors)
    idx = spec.indices_on(tensors[0].device)
    before = _identity
    if spec.recv_index is not None:
        before = lambda p: permute_rows(p, idx["recv_inverse"], idx["recv_index"])  # noqa: E731
    return _packed_exchange(
        tensors,
        spec.route_peers.reversed().without(skip),
        group,
        rows_before=before,
        rows_after=lambda p: permute_rows(p, idx["send_inverse"], idx["send_index"]),
        name="reverse_route",
    )


def sequence_rows_route(plan, rank: int):
    """Which per-sequence rows this rank sends and receives (:func:`gather_sequences`): the
    context route of one row per sequence — each owner sends a sequence's row to every rank
    that holds some of its tokens (built once per plan and cached on the spec)."""
    from knapformer.distributed.context import build_context_route

    return build_context_route(plan, rank, np.ones(plan.index.num_seqs, dtype=np.int64))


def sequence_rows_peers(spec: RouteSpec, plan) -> Peers:
    """:func:`gather_sequences`' exchange (cached on the spec)."""
    return _sequence_rows(spec, plan)[1]


def _sequence_rows(spec: RouteSpec, plan):
    key = "sequence_rows"
    if key not in spec.cache:
        route = sequence_rows_route(plan, spec.rank)
        first = int(plan.index.first[spec.rank])
        spec.cache[key] = (
            route,
            Peers.from_splits(route.send_splits, route.recv_splits, spec.rank),
            torch.from_numpy(route.send_rows),
            torch.from_numpy(route.seq_ids.astype(np.int64)),
            torch.arange(first, first + len(plan.seq_lens[spec.rank])),
            int(plan.index.num_seqs),
        )
    return spec.cache[key]


def gather_sequences(
    tensors: Sequence[torch.Tensor], spec: RouteSpec, plan, group=None, skip=frozenset()
) -> list[torch.Tensor]:
    """Per-sequence rows (n_local, *F) -> (n_group, *F) in group sequence-id order: this rank's
    own sequences' rows and those of every sequence it holds tokens of (the rows a routed token
    can index); the other rows are zero. One exchange per dtype, with the owners and holders
    only; differentiable (each holder's gradient goes back to the owner and adds up)."""
    route, peers, send_rows, recv_ids, own_ids, n = _sequence_rows(spec, plan)
    peers = peers.without(skip)
    out: list[torch.Tensor | None] = [None] * len(tensors)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    device = tensors[0].device
    send_rows, recv_ids, own_ids = (to_device(t, device) for t in (send_rows, recv_ids, own_ids))
    for part, idx in enumerate(by_dtype.values()):
        flat = [_rows_by_features(tensors[i]) for i in idx]
        widths = [f.shape[1] for f in flat]
        packed = flat[0] if len(flat) == 1 else torch.cat(flat, dim=1)
        as_bytes = packed.dtype == torch.bool
        rows = packed.view(torch.uint8) if as_bytes else packed
        got = move(rows.index_select(0, send_rows), peers, group, "gather_sequences", part)
        full = rows.new_zeros((n, rows.shape[1])).index_copy(0, own_ids, rows).index_copy(0, recv_ids, got)
        full = full.view(torch.bool) if as_bytes else full
        for i, piece in zip(idx, torch.split(full, widths, dim=1)):
            t = tensors[i]
            out[i] = piece.unflatten(1, t.shape[1:]) if t.dim() > 1 else piece.reshape(-1)
    return out  # type: ignore[return-value]
