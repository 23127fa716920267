"""The Ulysses exchange layout of one head configuration under a plan, derived once per plan.

For h query / h_kv kv heads of dims D (q, k) and Dv (v, out), every multi-rank group this
rank is in gives each member its head slice of every token of the group's sequences (pre
attention) and gives the outputs back (post attention). Exchanges are 1-D (splits in
elements), so entries of different degrees — and q, k, v of different widths under GQA —
share one ``all_to_all_single`` per direction. :func:`ulysses_layout` derives the split sizes,
the copy segments (:class:`PackSegment`, :class:`UnpackSegment`) and the gathers that put
received rows in attention order, and caches them on the route spec.

Attention order (degree k): the whole sequences of this rank's k-member entries, each
sequence's chunks in member order, with this member's h/k query heads (and its kv heads).

A ring group (k = u·r members as r sub-groups of u) is Ulysses inside each sub-group: a member
gets its h/u heads of its sub-group's *block* of each sequence (the sub-group's chunks, in
member order), and each ring entry is an attention batch of its own, which
:mod:`knapformer.distributed.ring` completes by passing K/V blocks around the ring.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import reduce
from typing import NamedTuple

import numpy as np
import torch

from knapformer.attention.bounds import to_device, upload
from knapformer.distributed.exchange import Peers
from knapformer.distributed.spec import ChunkInfo, RouteSpec, concat_ranges

__all__ = [
    "LayoutIndices",
    "PackSegment",
    "UlyssesLayout",
    "UnpackSegment",
    "heads_error",
    "member_heads",
    "ulysses_layout",
]


def member_heads(k: int, j: int, h: int, h_kv: int) -> tuple[slice, slice]:
    """Query and kv heads of member ``j`` of a ``k``-member group (h query, h_kv kv heads).

    Ulysses gives each member h/k query heads. When k divides h_kv each member gets h_kv/k kv
    heads (the ones its query heads attend with); when h_kv divides k (k > h_kv) a kv head
    serves k/h_kv members and each gets one copy of it."""
    hq = h // k
    if h_kv % k == 0:
        n = h_kv // k
        return slice(j * hq, (j + 1) * hq), slice(j * n, (j + 1) * n)
    c = j * h_kv // k
    return slice(j * hq, (j + 1) * hq), slice(c, c + 1)


def heads_error(groups, h: int, h_kv: int, rings=None) -> str:
    """Why these groups (tuples of ranks; ``rings[i]`` ring sub-groups each, default 1) cannot
    split h query / h_kv kv heads ("" if they can): names the first group that cannot. A group
    of k ranks with r sub-groups splits the heads u = k/r ways (the ring passes whole blocks)."""
    if h <= 0 or h_kv <= 0 or h % h_kv:
        return f"{h} query heads and {h_kv} kv heads: the query heads must be a multiple of the kv heads"
    rings = (1,) * len(groups) if rings is None else tuple(rings)
    sizes = sorted({len(g) for g in groups})
    for g, r in zip(groups, rings):
        k = len(g)
        u = k // r
        what = f"group {tuple(g)} of {k} ranks" if r == 1 else f"group {tuple(g)} of {k} ranks as a ring of {r} × {u}"
        hint = "" if r > 1 else "; a ring (Plan.ring) lets a group split fewer ways"
        if h % u:
            ways = "evenly" if r == 1 else f"{u} ways"
            return f"{what} cannot split {h} attention heads {ways} (group sizes in this plan: {sizes}){hint}"
        if h_kv % u and u % h_kv:
            return (
                f"{what} cannot share {h_kv} kv heads (h={h}) {u} ways: {u} must divide h_kv "
                f"(each member gets h_kv/{u}) or h_kv must divide {u} (kv heads replicated){hint}"
            )
    return ""


class PackSegment(NamedTuple):
    """One copy into the pre-attention send buffer: rows ``row_lo:row_hi`` (routed order) of
    q, k or v, heads ``head_lo:head_hi``, into the slot at element ``offset`` (rows of ``width``
    elements), starting at element ``feature`` of each row."""

    tensor: int
    """0 = q, 1 = k, 2 = v."""
    row_lo: int
    row_hi: int
    head_lo: int
    head_hi: int
    offset: int
    width: int
    feature: int


class UnpackSegment(NamedTuple):
    """One copy out of the post-attention receive buffer: the slot at element ``offset`` (rows
    of ``width`` elements) into rows ``row_lo:row_hi``, heads ``head_lo:head_hi`` of the output."""

    offset: int
    width: int
    row_lo: int
    row_hi: int
    head_lo: int
    head_hi: int


@dataclass(frozen=True)
class LayoutIndices:
    """A layout's index tensors on one device."""

    gathers: list[torch.Tensor]
    """Per batch: received rows (of ``pre_rows`` elements) in attention order."""
    gather_inverse: torch.Tensor | None
    """With one batch whose gather uses every received row (a permutation): its inverse, so
    that forward and backward are both gathers (cheaper than scattering into a new buffer)."""
    scatters: list[torch.Tensor]
    """Per batch: rows (of ``post_rows`` elements) of the post send buffer, in attention order."""
    scatter_inverse: torch.Tensor | None
    """With one batch (its scatter is then a permutation of every send row): its inverse."""
    cu_seqlens: list[torch.Tensor]
    """Per batch: int32 bounds of the attention batch's sequences."""


@dataclass(frozen=True, eq=False)
class UlyssesLayout:
    """How pre/post attention move one head configuration (h, h_kv, D, Dv) under a plan.

    Pre attention packs (peer, entry) slots by copy segments and gathers the received rows into
    per-degree attention tensors; post attention scatters the outputs into per-peer slots and
    unpacks the received slots by copy segments."""

    degrees: tuple[int, ...]
    """Per attention batch of this rank's multi-rank entries: the group size k (> 1). Batches:
    Ulysses-only entries by ascending degree, then one per ring entry."""
    rings: tuple[int, ...]
    """Per batch: ring sub-groups r (1: Ulysses alone)."""
    ring_entries: tuple[int, ...]
    """Per batch: the entry (index into the spec's entries) of a ring batch, -1 otherwise."""
    widths: tuple[tuple[int, int, int], ...]
    """Per batch: (query heads, kv heads, elements per token in the pre exchange) — of u = k/r."""
    pre_peers: Peers
    """The pre-attention exchange (elements to and from each peer of this rank's groups)."""
    pre_segments: tuple[PackSegment, ...]
    pre_rows: int
    """Granularity (elements) of the received buffer's gather (gcd of the slot widths)."""
    pre_gather: tuple[np.ndarray, ...]
    """Per batch: received rows (of ``pre_rows`` elements) in attention order."""
    post_peers: Peers
    """The post-attention exchange."""
    post_rows: int
    post_scatter: tuple[np.ndarray, ...]
    """Per batch: rows (of ``post_rows`` elements) of the send buffer, in attention order."""
    post_segments: tuple[UnpackSegment, ...]
    cu_seqlens: tuple[list[int], ...]
    max_len: tuple[int, ...]
    attn_tokens: tuple[int, ...]
    replicated: bool
    """Some kv head goes to several members (h_kv divides a group size): gradients add up."""
    one_group: tuple[int, tuple[int, ...]] | None
    """(k, member position of each peer in ascending rank order) when all of this rank's
    multi-rank rows (routed rows ``local_tokens:``) are one group whose members each get
    distinct kv heads (every bag layout): the slots are then one (k, rows, width) block, packed
    with one strided ``cat`` as the bag executor did."""
    _device_cache: dict = field(default_factory=dict, repr=False)

    def member_order_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``one_group``'s member positions and their inverse as index tensors on ``device``
        (cached), or None when the peers are the members in order (no reordering)."""
        k, order = self.one_group  # type: ignore[misc]
        if order == tuple(range(k)):
            return None
        key = ("order", str(device))
        if key not in self._device_cache:
            index = torch.tensor(order)
            self._device_cache[key] = (to_device(index, device), to_device(torch.argsort(index), device))
        return self._device_cache[key]

    def indices_on(self, device: torch.device) -> LayoutIndices:
        """The index tensors on ``device``, cached."""
        key = str(device)
        if key not in self._device_cache:
            gathers = [torch.from_numpy(a) for a in self.pre_gather]
            scatters = [torch.from_numpy(a) for a in self.post_scatter]
            full = (
                len(gathers) == 1 and self.pre_rows and gathers[0].numel() == self.pre_peers.num_recv // self.pre_rows
            )
            self._device_cache[key] = LayoutIndices(  # built on the host, uploaded without a sync
                gathers=[to_device(g, device) for g in gathers],
                gather_inverse=to_device(torch.argsort(gathers[0]), device) if full else None,
                scatters=[to_device(s, device) for s in scatters],
                scatter_inverse=to_device(torch.argsort(scatters[0]), device) if len(scatters) == 1 else None,
                cu_seqlens=[upload(c, device) for c in self.cu_seqlens],
            )
        return self._device_cache[key]


def ulysses_layout(spec: RouteSpec, h: int, h_kv: int, d: int, dv: int) -> UlyssesLayout:
    """The exchange layout for h query / h_kv kv heads of dims d (q, k) and dv (v, out),
    derived once per plan and head configuration (cached on ``spec``)."""
    key = ("ulysses", h, h_kv, d, dv)
    if key not in spec.cache:
        error = heads_error(spec.used_groups, h, h_kv, spec.used_rings)
        if error:
            raise ValueError(error)
        spec.cache[key] = _build(spec, h, h_kv, d, dv)
    return spec.cache[key]


def _kinds(multi) -> list[tuple[int, int, tuple[int, ...]]]:
    """Attention batches of the multi-rank entries: (degree, u, entry indices). Ulysses-only
    entries of one degree share a batch (ascending degree); each ring entry is its own batch
    (its blocks pass around its own ring), after them in entry order."""
    plain = sorted({e.degree for _, e in multi if e.ring == 1})
    kinds = [(k, k, tuple(i for i, e in multi if e.ring == 1 and e.degree == k)) for k in plain]
    return kinds + [(e.degree, e.u, (i,)) for i, e in multi if e.ring > 1]


def _build(spec: RouteSpec, h: int, h_kv: int, d: int, dv: int) -> UlyssesLayout:
    rank = spec.rank
    multi = [(i, e) for i, e in enumerate(spec.entries) if e.degree > 1]
    kinds = _kinds(multi)

    def widths(u: int) -> tuple[int, int, int]:
        hq = h // u
        hkv = h_kv // u if h_kv % u == 0 else 1
        return hq, hkv, hq * d + hkv * d + hkv * dv

    us = sorted({e.u for _, e in multi})
    W = {u: widths(u) for u in us}  # pre exchange: q | k | v heads of one member, per token
    Wo = {u: W[u][0] * dv for u in us}  # post exchange: that member's output heads, per token

    members = sorted({m for _, e in multi for m in e.sub})  # every peer of an exchange, ascending

    def slots(width: dict, tokens) -> tuple[list[tuple[int, int]], dict]:
        """Per peer (ascending): my entries whose sub-group contains it (entry order),
        ``tokens(peer, i, e)`` rows of ``width[u]`` each. Returns the peers' element counts
        and each slot's offset (O(members): never a loop over the whole group)."""
        parts, offset, off = [], {}, 0
        for peer in members:
            start = off
            for i, e in multi:
                if peer in e.sub:
                    offset[(peer, i)] = off
                    off += tokens(peer, i, e) * width[e.u]
            parts.append((peer, off - start))
        return parts, offset

    mine = lambda peer, i, e: e.hi - e.lo  # noqa: E731  (I send all my rows of an entry to each member)
    theirs = lambda peer, i, e: spec.peer_tokens[(peer, i)]  # noqa: E731
    Wi = {u: W[u][2] for u in us}
    pre_send, pre_send_off = slots(Wi, mine)
    pre_recv, pre_recv_off = slots(Wi, theirs)
    post_send, post_send_off = slots(Wo, theirs)
    post_recv, post_recv_off = slots(Wo, mine)
    pre_peers = Peers.from_parts(pre_send, pre_recv, rank)
    post_peers = Peers.from_parts(post_send, post_recv, rank)
    pre_segments, post_segments = [], []
    for (peer, i), off in pre_send_off.items():
        e = spec.entries[i]
        if e.hi == e.lo:
            continue
        hq, hkv, w = W[e.u]
        qh, kvh = member_heads(e.u, e.sub.index(peer), h, h_kv)
        pre_segments += [
            PackSegment(0, e.lo, e.hi, qh.start, qh.stop, off, w, 0),
            PackSegment(1, e.lo, e.hi, kvh.start, kvh.stop, off, w, hq * d),
            PackSegment(2, e.lo, e.hi, kvh.start, kvh.stop, off, w, hq * d + hkv * d),
        ]
    for (peer, i), off in post_recv_off.items():
        e = spec.entries[i]
        if e.hi > e.lo:
            qh, _ = member_heads(e.u, e.sub.index(peer), h, h_kv)
            post_segments.append(UnpackSegment(off, Wo[e.u], e.lo, e.hi, qh.start, qh.stop))
    g_in = reduce(math.gcd, [W[u][2] for u in us], 0) or 1
    g_out = reduce(math.gcd, list(Wo.values()), 0) or 1
    # -- attention order per batch: its entries' chunks held by the sub-group, by (entry, gid, start)
    info = spec.chunk_info
    member_lo = _member_entry_lo(info)
    gathers, scatters, cus, maxes, tokens = [], [], [], [], []
    for _, u, ents_of_kind in kinds:
        ents = [spec.entries[i] for i in ents_of_kind]
        held = np.zeros(info.group.size, dtype=bool)
        for e in ents:
            held |= (info.group == e.group) & np.isin(info.dst, e.sub)
        sel = np.flatnonzero(held)
        sel = sel[np.argsort(info.group_order[sel], kind="stable")]  # (gid, start) order within an entry
        entry_of_group = {e.group: i for i, e in zip(ents_of_kind, ents)}
        chunk_ent = [entry_of_group[int(g)] for g in info.group[sel]]
        holders = info.dst[sel].tolist()  # the member holding a chunk sends it (and gets its output)
        lens = info.length[sel]
        in_slot = info.routed_offset[sel] - member_lo[sel]  # rows before the chunk in the holder's entry range
        tok = concat_ranges(np.zeros(lens.size, dtype=np.int64), lens)  # token index within its chunk
        chunk_of_tok = np.repeat(np.arange(lens.size), lens)
        for width, offsets, g, out in ((W[u][2], pre_recv_off, g_in, gathers), (Wo[u], post_send_off, g_out, scatters)):
            start = np.asarray([offsets[(m, i)] for m, i in zip(holders, chunk_ent)], dtype=np.int64) + in_slot * width
            first = (start[chunk_of_tok] + tok * width) // g
            out.append((first[:, None] + np.arange(width // g)[None, :]).reshape(-1))
        seq_lens = [L for e in ents for L in (e.blocks[e.ring_pos] if e.ring > 1 else e.seq_lens)]
        cus.append(np.concatenate([[0], np.cumsum(seq_lens)]).astype(np.int64).tolist())
        maxes.append(max(seq_lens, default=0))
        tokens.append(int(lens.sum()))
    one_group = None
    e = multi[0][1] if len(multi) == 1 else None
    if e is not None and e.ring == 1 and h_kv % e.degree == 0 and e.lo == spec.local_tokens < e.hi == spec.num_routed:
        one_group = (e.degree, tuple(e.members.index(r) for r in sorted(e.members)))
    return UlyssesLayout(
        degrees=tuple(k for k, _, _ in kinds),
        rings=tuple(spec.entries[ents[0]].ring for _, _, ents in kinds),
        ring_entries=tuple(ents[0] if spec.entries[ents[0]].ring > 1 else -1 for _, _, ents in kinds),
        widths=tuple(W[u] for _, u, _ in kinds),
        pre_peers=pre_peers,
        pre_segments=tuple(pre_segments),
        pre_rows=g_in,
        pre_gather=tuple(gathers),
        post_peers=post_peers,
        post_rows=g_out,
        post_scatter=tuple(scatters),
        post_segments=tuple(post_segments),
        cu_seqlens=tuple(cus),
        max_len=tuple(maxes),
        attn_tokens=tuple(tokens),
        replicated=any(h_kv % u for u in us),
        one_group=one_group,
    )


def _member_entry_lo(info: ChunkInfo) -> np.ndarray:
    """For each relevant chunk: the routed offset, on the chunk's destination, of the first
    token of its group's range there (the smallest offset among that (destination, group)'s
    chunks)."""
    key = info.dst * (1 << 32) + info.group
    _, inv = np.unique(key, return_inverse=True)
    lo = np.full(inv.max() + 1 if inv.size else 0, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(lo, inv, info.routed_offset)
    return lo[inv]
