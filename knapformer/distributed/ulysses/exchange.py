"""Ulysses exchanges around attention, for groups of any size that may overlap (GQA/MQA too).

Before attention every member of a k-rank group needs all L tokens of the group's sequences
for its h/k query heads (and its kv heads); after attention each member's output heads go
back to the tokens' owners. One exchange per direction (:mod:`..exchange`: point-to-point with
the members of this rank's groups, nobody else) moves every group's rows at once: it is 1-D
with counts in elements, because rows of different degrees (h/k heads) and of q, k, v (fewer
kv heads under GQA) have different widths. A rank in no multi-rank group exchanges nothing.

============================  ==============================  =================================
function                      input                           output
============================  ==============================  =================================
pre_attn_batches              q (R, h, D), k/v (R, h_kv, ·)   per degree: (A_k, h/k, ·) tensors
post_attn_batches             per degree: (A_k, h/k, Dv)      (R, h, Dv)
============================  ==============================  =================================

Sequences a rank runs alone (its single-rank group, the first ``local_tokens`` routed rows)
never enter the exchange: they are attention batch "degree 1" as views of the inputs.

Copies per direction: one pass packs the send buffer (strided copies of (peer, group) slots,
:class:`_Pack`), one gather puts the received rows in attention order (:class:`_GatherRows`);
post attention scatters the outputs into the send buffer (:class:`_ScatterRows`) and copies
the received slots into place (:class:`_Unpack`). Each ``Function``'s backward is the other
direction's copy, and the gradient of an all-to-all is the opposite all-to-all. A rank whose
multi-rank rows form one group (every bag layout) skips both custom copies: its slots are one
(k, rows, width) block, packed by one strided ``cat`` and unpacked by one ``reshape`` that
autograd differentiates (wrapped in custom Functions, this path measured 3–10% slower per call
than the bag-only executor), and a gather that uses every received row is a permutation whose
backward is a gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from knapformer.distributed.ops import move, permute_rows
from knapformer.distributed.spec import GroupEntry, RouteSpec
from knapformer.distributed.ulysses.layout import UlyssesLayout, heads_error, ulysses_layout

__all__ = ["AttnBatch", "UlyssesCall", "check_heads", "post_attn_batches", "pre_attn_batches"]


@dataclass
class AttnBatch:
    """One varlen attention call: sequences of one degree with this rank's heads of them."""

    degree: int
    q: torch.Tensor  # (A, hq, D)
    k: torch.Tensor  # (A, hkv, D)
    v: torch.Tensor  # (A, hkv, Dv)
    cu_seqlens: torch.Tensor  # (n + 1,) int32
    max_len: int
    ring: GroupEntry | None = None
    """A ring batch: its entry (sub-group, ring peers, every sub-group's blocks). q, k, v are
    then this rank's heads of its own block of each sequence; attention is not complete until
    the other blocks' K/V have passed (:mod:`knapformer.distributed.ring`) or been gathered
    (:mod:`knapformer.distributed.kv_gather`)."""
    cu_seqlens_k: torch.Tensor | None = None
    """Key bounds when they differ from the query bounds ``cu_seqlens`` (a gathered ring
    batch: k, v then hold each segment's keys); None: the same."""
    max_len_k: int | None = None


def check_heads(h: int, h_kv: int, spec: RouteSpec) -> str:
    """Why these head counts cannot run the plan ("" if they can); the same on every rank."""
    return heads_error(spec.used_groups, h, h_kv, spec.used_rings)


def _slot(buf: torch.Tensor, off: int, n: int, width: int) -> torch.Tensor:
    return buf[off : off + n * width].view(n, width)


class _Pack(torch.autograd.Function):
    """q, k, v rows (R_m, ·, ·) -> the flat pre-attention send buffer, by copy segments; backward
    copies the gradient segments back (adding where a kv head was sent to several members)."""

    @staticmethod
    def forward(ctx, layout: UlyssesLayout, lo: int, replicated: bool, q, k, v):  # type: ignore[override]
        ctx.layout, ctx.lo, ctx.replicated = layout, lo, replicated
        ctx.shapes = [t.shape for t in (q, k, v)]
        tensors = (q, k, v)
        buf = q.new_empty(layout.pre_peers.num_send)
        for t, r0, r1, h0, h1, off, width, f in layout.pre_segments:  # PackSegment fields
            src = tensors[t][r0 - lo : r1 - lo, h0:h1]
            dst = _slot(buf, off, r1 - r0, width)[:, f : f + src.shape[1] * src.shape[2]]
            dst.view(src.shape).copy_(src)
        return buf

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        layout, lo = ctx.layout, ctx.lo
        grads = [
            grad.new_zeros(s) if (i > 0 and ctx.replicated) else grad.new_empty(s) for i, s in enumerate(ctx.shapes)
        ]
        for t, r0, r1, h0, h1, off, width, f in layout.pre_segments:
            dst = grads[t][r0 - lo : r1 - lo, h0:h1]
            src = _slot(grad, off, r1 - r0, width)[:, f : f + dst.shape[1] * dst.shape[2]].view(dst.shape)
            if t > 0 and ctx.replicated:
                dst.add_(src)
            else:
                dst.copy_(src)
        return None, None, None, *grads


def _by_member(t: torch.Tensor, k: int, order: torch.Tensor | None) -> torch.Tensor:
    """(n, h, D) -> (k, n, h/k·D): a view by member (head group), in ascending peer rank order
    (``order``: member position of each peer; None when they coincide)."""
    n, h, d = t.shape
    x = t.reshape(n, k, (h // k) * d)
    if order is not None:
        x = x.index_select(1, order)
    return x.transpose(0, 1)


def _from_members(x: torch.Tensor, inverse: torch.Tensor | None, shape) -> torch.Tensor:
    """Inverse of :func:`_by_member` (``inverse``: the inverse permutation of its ``order``):
    (k, n, w) blocks in peer order -> (n, h, D) (one copy)."""
    x = x.transpose(0, 1)
    if inverse is not None:
        x = x.index_select(1, inverse)
    return x.reshape(shape)


class _Unpack(torch.autograd.Function):
    """Flat post-attention receive buffer -> outputs (R_m, h, Dv) of the multi-rank rows."""

    @staticmethod
    def forward(ctx, layout: UlyssesLayout, lo: int, shape, buf):  # type: ignore[override]
        ctx.layout, ctx.lo, ctx.n = layout, lo, buf.shape[0]
        out = buf.new_empty(shape)
        dv = shape[2]
        for off, width, r0, r1, h0, h1 in layout.post_segments:  # UnpackSegment fields
            out[r0 - lo : r1 - lo, h0:h1].copy_(_slot(buf, off, r1 - r0, width).view(r1 - r0, h1 - h0, dv))
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        layout, lo = ctx.layout, ctx.lo
        g = grad.new_empty(ctx.n)
        dv = grad.shape[2]
        for off, width, r0, r1, h0, h1 in layout.post_segments:
            _slot(g, off, r1 - r0, width).view(r1 - r0, h1 - h0, dv).copy_(grad[r0 - lo : r1 - lo, h0:h1])
        return None, None, None, g


class _GatherRows(torch.autograd.Function):
    """Rows of a buffer (N, g) -> one tensor per index list; the lists together use every row
    once, so the backward scatters into an uninitialised buffer."""

    @staticmethod
    def forward(ctx, n: int, *args):  # type: ignore[override]
        buf, indices = args[0], args[1:]
        ctx.save_for_backward(*indices)
        ctx.n = n
        return tuple(buf.index_select(0, i) for i in indices)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        indices = ctx.saved_tensors
        g = grads[0].new_empty((ctx.n, grads[0].shape[1]))
        for i, gi in zip(indices, grads):
            g.index_copy_(0, i, gi)
        return None, g, *([None] * len(indices))


class _ScatterRows(torch.autograd.Function):
    """Tensors (n_k, g) -> rows ``indices[k]`` of a buffer (N, g) that they fill exactly."""

    @staticmethod
    def forward(ctx, n: int, num: int, *args):  # type: ignore[override]
        xs, indices = args[:num], args[num:]
        ctx.save_for_backward(*indices)
        out = xs[0].new_empty((n, xs[0].shape[1]))
        for x, i in zip(xs, indices):
            out.index_copy_(0, i, x)
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        indices = ctx.saved_tensors
        return None, None, *(grad.index_select(0, i) for i in indices), *([None] * len(indices))


@dataclass
class UlyssesCall:
    """What :func:`pre_attn_batches` hands to :func:`post_attn_batches` for one layer."""

    batches: list[AttnBatch]
    heads: tuple[int, int, int, int]
    """(h, h_kv, D, Dv) of this layer."""
    anchor: torch.Tensor | None
    """An empty tensor that hangs off the pre-attention exchange in the autograd graph (None
    when this rank is in no multi-rank group): a rank with nothing to send back still runs the
    backward exchanges its peers are in through it. Not a view: holding the receive buffer itself would keep a
    whole layer's q, k, v alive until post attention."""
    pairs: list | None = None
    """The custom-kernel form's pair indices, once computed (:mod:`.pairs`)."""
    dtype: torch.dtype = torch.float32
    """The dtype of v (and of the attention output)."""
    kv_token: torch.Tensor | None = None
    """After a K/V gather (``pre_attn`` under a ring plan): the empty token of its exchange,
    joined to the kernel's output so that every rank runs the gather's backward."""
    skip: frozenset = frozenset()
    """Peers left out of this call's exchanges (their call differed: :meth:`StepChecks.peer_check
    <knapformer.distributed.checks.StepChecks.peer_check>`); their rows are zeros."""


def pre_attn_batches(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: RouteSpec, group=None, skip: frozenset = frozenset()
) -> UlyssesCall:
    """Routed q (R, h, D), k (R, h_kv, D), v (R, h_kv, Dv) -> the attention batches of this rank:
    its single-rank sequences (views, no copy), then one batch per multi-rank degree. ``skip``:
    peers left out of the exchanges (their rows are zeros)."""
    heads = (q.shape[1], k.shape[1], q.shape[2], v.shape[2])
    h, h_kv, d, dv = heads
    lay = ulysses_layout(spec, h, h_kv, d, dv) if spec.has_ulysses else None  # checks the heads on first use
    idx = spec.indices_on(q.device)
    if not spec.has_ulysses:  # this rank is in no multi-rank group: every row is run alone, no exchange
        local = AttnBatch(1, q, k, v, idx["local_cu_seqlens"], max(spec.local_seq_lens, default=0))
        return UlyssesCall([local], heads, None, dtype=v.dtype)
    n1, R = spec.local_tokens, q.shape[0]
    batches = []
    if n1 == 0:
        qm, km, vm = q, k, v
    else:
        (q1, qm), (k1, km), (v1, vm) = (torch.split(t, [n1, R - n1]) for t in (q, k, v))
    if spec.local_seq_lens:
        batches.append(AttnBatch(1, q1, k1, v1, idx["local_cu_seqlens"], max(spec.local_seq_lens)))
    if lay.one_group is not None:  # one (k, rows, width) block (every bag layout): one strided cat
        order = lay.member_order_on(q.device)
        index = None if order is None else order[0]
        send = torch.cat([_by_member(t, lay.one_group[0], index) for t in (qm, km, vm)], dim=-1).view(-1)
    else:
        send = _Pack.apply(lay, n1, lay.replicated, qm, km, vm)
    recv = move(send, lay.pre_peers.without(skip), group, "pre_attn")
    if lay.degrees:
        idx = lay.indices_on(q.device)
        rows = recv.view(-1, lay.pre_rows)
        if idx.gather_inverse is not None:  # a permutation of every received row
            parts = (permute_rows(rows, idx.gathers[0], idx.gather_inverse),)
        else:
            parts = _GatherRows.apply(rows.shape[0], rows, *idx.gathers)
        kinds = zip(lay.degrees, lay.ring_entries, lay.widths, parts, idx.cu_seqlens, lay.max_len)
        for deg, ring, (hq, hkv, w), part, cu, mx in kinds:
            # one split (its backward is one cat of dq, dk, dv; slices would each zero-fill a copy)
            qs, ks, vs = torch.split(part.view(-1, w), [hq * d, hkv * d, hkv * dv], dim=1)
            qs, ks, vs = qs.unflatten(1, (hq, d)), ks.unflatten(1, (hkv, d)), vs.unflatten(1, (hkv, dv))
            batches.append(AttnBatch(deg, qs, ks, vs, cu, mx, spec.entries[ring] if ring >= 0 else None))
    return UlyssesCall(batches, heads, recv[:0].clone(), dtype=v.dtype, skip=skip)


def post_attn_batches(call: UlyssesCall, outs: list[torch.Tensor], spec: RouteSpec, group=None) -> torch.Tensor:
    """Outputs of ``call.batches`` (each (A_k, h/k, Dv)) -> (R, h, Dv) in routed order."""
    if call.anchor is None:
        return outs[0]
    h, h_kv, d, dv = call.heads
    lay = ulysses_layout(spec, h, h_kv, d, dv)
    local = [o for b, o in zip(call.batches, outs) if b.degree == 1]
    multi = [o for b, o in zip(call.batches, outs) if b.degree > 1]
    if len(multi) == 1:  # one degree: the scatter is a permutation, applied as a gather
        idx = lay.indices_on(multi[0].device)
        send = permute_rows(multi[0].reshape(-1, lay.post_rows), idx.scatter_inverse, idx.scatters[0]).reshape(-1)
    elif multi:
        idx = lay.indices_on(multi[0].device)
        xs = [o.reshape(-1, lay.post_rows) for o in multi]
        send = _ScatterRows.apply(lay.post_peers.num_send // lay.post_rows, len(xs), *xs, *idx.scatters).reshape(-1)
    else:
        # nothing to send back; the empty buffer still hangs off the pre exchange so that this
        # rank joins both backward exchanges the other ranks are in
        send = call.anchor.to(outs[0].dtype) if outs else call.anchor
    recv = move(send, lay.post_peers.without(call.skip), group, "post_attn")
    n1 = spec.local_tokens
    shape = (spec.num_routed - n1, h, dv)
    if lay.one_group is not None:  # plain views and one copy; autograd needs no custom step
        order = lay.member_order_on(recv.device)
        inverse = None if order is None else order[1]
        out_m = _from_members(recv.view(lay.one_group[0], shape[0], -1), inverse, shape)
    else:
        out_m = _Unpack.apply(lay, n1, shape, recv)
    return torch.cat([local[0], out_m]) if local else out_m
