"""Route specs: one rank's view of a plan as split sizes, permutations and copy segments.

Built once per step by :func:`build_route_spec` (pure numpy, then torch CPU tensors) and
reused by route, every layer's pre/post attention, and reverse. Device copies of the index
tensors are made lazily, once per device (:meth:`RouteSpec.indices_on`); the Ulysses layout
for a head configuration is derived once per plan (:meth:`RouteSpec.ulysses`).

Plan form: every sequence runs on an ordered *group* of ranks (chunk i on member i); groups
of different sequences may overlap, so a rank can run whole sequences alone and chunks of
others with different partners in the same step. This rank's *entries* are the groups it
is in that hold sequences, in one global order every rank shares: by group size, then by
the group's index in the plan.

Token orders (legend: T = tokens on this rank before routing, R = routed tokens on this
rank, A_k = attention tokens of degree k):

- *local*: the caller's order, sequences concatenated in ``local_seq_lens`` order.
- *routed*: the chunks whose destination is this rank, sorted by (entry, global sequence id,
  start): each entry's tokens are one contiguous range, the single-rank entry (whole
  sequences run alone) first. When the rank has one entry this is the order
  ``all_to_all_single`` delivers; otherwise one permutation on receipt puts it there.
- *attention* (degree k): the whole sequences of this rank's k-member entries, each sequence's
  chunks in member order, with this member's h/k query heads (and its kv heads).

The reverse route is derived from the forward one (the same indices), so
``reverse(route(x)) == x`` by construction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import reduce

import numpy as np
import torch

from knapformer.plan import Plan
from knapformer.plan.plan import DST, LEN, SRC, START

__all__ = ["GroupEntry", "RouteSpec", "UlyssesLayout", "build_route_spec", "member_heads"]


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenate ``arange(s, s + l)`` for each pair, vectorised."""
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
    return np.arange(total, dtype=np.int64) + offsets


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


def heads_error(sizes, h: int, h_kv: int) -> str:
    """Why these group sizes cannot split h query / h_kv kv heads ("" if they can)."""
    if h <= 0 or h_kv <= 0 or h % h_kv:
        return f"{h} query heads and {h_kv} kv heads: the query heads must be a multiple of the kv heads"
    for k in sizes:
        if h % k:
            return (
                f"{h} attention heads cannot be split evenly over bag size {k} "
                f"(bag sizes in this plan: {sorted(set(sizes))})"
            )
        if h_kv % k and k % h_kv:
            return (
                f"a group of {k} ranks cannot share {h_kv} kv heads (h={h}): k must divide h_kv "
                f"(each member gets h_kv/k) or h_kv must divide k (kv heads replicated)"
            )
    return ""


@dataclass(frozen=True)
class GroupEntry:
    """One group this rank is in, with the routed tokens it holds for it."""

    group: int
    """Index of the group in the plan's ``bags``."""
    members: tuple[int, ...]
    position: int
    """This rank's index in ``members`` (its head slice)."""
    lo: int
    hi: int
    """Routed token range of this entry: rows ``lo:hi`` in routed order."""
    seq_lens: tuple[int, ...]
    """Lengths of the entry's sequences, in attention order."""

    @property
    def degree(self) -> int:
        return len(self.members)


@dataclass(frozen=True, eq=False)
class UlyssesLayout:
    """How pre/post attention move one head configuration (h, h_kv, D, Dv) under a plan.

    Exchanges are 1-D (splits in elements), so entries of different degrees share one
    ``all_to_all_single``. Pre attention packs (peer, entry) slots by copy segments and gathers
    the received rows into per-degree attention tensors; post attention scatters the outputs
    into per-peer slots and unpacks the received slots by copy segments."""

    degrees: tuple[int, ...]
    """Degrees (>1) of this rank's multi-rank entries, ascending."""
    widths: tuple[tuple[int, int, int], ...]
    """Per degree: (query heads, kv heads, elements per token in the pre exchange)."""
    pre_send: list[int]
    pre_recv: list[int]
    pre_segments: tuple
    """(tensor 0=q/1=k/2=v, row lo, row hi, head lo, head hi, element offset, slot width, feature offset)."""
    pre_rows: int
    """Granularity (elements) of the received buffer's gather (gcd of the slot widths)."""
    pre_gather: tuple[np.ndarray, ...]
    """Per degree: received rows (of ``pre_rows`` elements) in attention order."""
    post_send: list[int]
    post_recv: list[int]
    post_rows: int
    post_scatter: tuple[np.ndarray, ...]
    """Per degree: rows (of ``post_rows`` elements) of the send buffer, in attention order."""
    post_segments: tuple
    """(element offset, slot width, row lo, row hi, head lo, head hi) of the received slots."""
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
            index = torch.tensor(order, device=device)
            self._device_cache[key] = (index, torch.argsort(index))
        return self._device_cache[key]

    def indices_on(self, device: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """(pre gathers, post scatters, cu_seqlens) as tensors on ``device``, cached. With one
        degree the post scatter is a permutation of every send row, and the pre gather one of
        every received row; their inverses are appended (then forward and backward are both
        gathers, cheaper than scattering into a fresh buffer)."""
        key = str(device)
        if key not in self._device_cache:
            gathers = [torch.from_numpy(a).to(device) for a in self.pre_gather]
            scatters = [torch.from_numpy(a).to(device) for a in self.post_scatter]
            if len(scatters) == 1:
                scatters.append(torch.argsort(scatters[0]))
            if len(gathers) == 1 and self.pre_rows and gathers[0].numel() == sum(self.pre_recv) // self.pre_rows:
                gathers.append(torch.argsort(gathers[0]))
            self._device_cache[key] = (
                gathers,
                scatters,
                [torch.tensor(c, dtype=torch.int32, device=device) for c in self.cu_seqlens],
            )
        return self._device_cache[key]


@dataclass(frozen=True, eq=False)
class RouteSpec:
    """This rank's exchanges for one step. Split sizes are indexed by group rank."""

    rank: int
    """This rank's index in the balancing group."""
    num_ranks: int
    num_local: int
    """T: tokens this rank contributes."""
    num_routed: int
    """R: tokens this rank holds after routing."""
    send_splits: list[int]
    recv_splits: list[int]
    send_index: torch.Tensor
    """(T,) local positions in send order (grouped by destination, then the destination's routed order)."""
    recv_index: torch.Tensor | None
    """(R,) received row of each routed row; None when they arrive in routed order already."""
    routed_seq_id: torch.Tensor
    """(R,) global (group) sequence id of each routed token."""
    routed_pos: torch.Tensor
    """(R,) position of each routed token within its sequence."""
    entries: tuple[GroupEntry, ...]
    """This rank's groups holding sequences, in the global group order."""
    local_tokens: int
    """Routed rows ``0:local_tokens`` belong to sequences this rank runs alone."""
    local_seq_lens: tuple[int, ...]
    """Those sequences' lengths (attention order)."""
    group_sizes: tuple[int, ...]
    """Sizes of every group of the plan that holds sequences (checked against the heads)."""
    has_ulysses: bool
    """Some group of the plan has several members: every rank joins the pre/post exchanges."""
    _peer_tokens: dict = field(repr=False)
    """(peer, entry index) -> tokens of that entry routed to that peer."""
    _chunk_info: dict = field(repr=False)
    _device_cache: dict = field(default_factory=dict, repr=False)
    _layouts: dict = field(default_factory=dict, repr=False)

    # kept for callers of the bag-only executor: a rank in one group
    @property
    def bag_size(self) -> int:
        multi = [e.degree for e in self.entries if e.degree > 1]
        return multi[0] if len(set(multi)) == 1 else (1 if not multi else 0)

    @property
    def attn_seq_lens(self) -> list[int]:
        """Lengths of every sequence this rank attends over (degree 1 first, then by degree)."""
        out = list(self.local_seq_lens)
        for e in sorted((e for e in self.entries if e.degree > 1), key=lambda e: e.degree):
            out += list(e.seq_lens)
        return out

    def indices_on(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Index tensors on ``device``, copied once per device and cached."""
        key = str(device)
        if key not in self._device_cache:
            d = {n: getattr(self, n).to(device) for n in ("send_index", "routed_seq_id", "routed_pos")}
            d["send_inverse"] = torch.empty_like(d["send_index"])
            d["send_inverse"][d["send_index"]] = torch.arange(self.num_local, device=device)
            if self.recv_index is not None:
                d["recv_index"] = self.recv_index.to(device)
                d["recv_inverse"] = torch.argsort(d["recv_index"])
            lens = torch.tensor([0, *self.local_seq_lens], dtype=torch.int64)
            d["local_cu_seqlens"] = torch.cumsum(lens, 0).to(torch.int32).to(device)
            self._device_cache[key] = d
        return self._device_cache[key]

    def ulysses(self, h: int, h_kv: int, d: int, dv: int) -> UlyssesLayout:
        """The exchange layout for h query / h_kv kv heads of dims d (q, k) and dv (v, out),
        derived once per plan and head configuration."""
        key = (h, h_kv, d, dv)
        if key not in self._layouts:
            error = heads_error(self.group_sizes, h, h_kv)
            if error:
                raise ValueError(error)
            self._layouts[key] = _ulysses_layout(self, h, h_kv, d, dv)
        return self._layouts[key]


def build_route_spec(plan: Plan, rank: int) -> RouteSpec:
    """This rank's route spec for ``plan`` (pure; every rank builds its own)."""
    S = plan.num_ranks
    if not 0 <= rank < S:
        raise ValueError(f"rank {rank} is outside the plan's group of {S} ranks")
    ch = plan.chunks
    index = plan.index
    gid = plan.chunk_gid
    grp = np.asarray(plan.seq_bag, dtype=np.int64)[gid]
    sizes = np.fromiter((len(b) for b in plan.bags), dtype=np.int64, count=len(plan.bags))
    used = np.unique(plan.seq_bag) if index.num_seqs else np.zeros(0, dtype=np.int64)
    # one global group order: by size, then index in the plan
    order_of_group = np.full(len(plan.bags), -1, dtype=np.int64)
    by_size = used[np.argsort(sizes[used], kind="stable")]
    order_of_group[by_size] = np.arange(by_size.size)
    g_order = order_of_group[grp]

    # -- routed order of every rank: (dst, group order, gid, start); table order is (gid, start)
    key = np.lexsort((np.arange(ch.shape[0]), g_order, ch[:, DST]))
    lens_sorted = ch[key, LEN]
    csum = np.cumsum(lens_sorted) - lens_sorted
    dst_sorted = ch[key, DST]
    first_of_dst = np.searchsorted(dst_sorted, dst_sorted, side="left")
    routed_off = np.empty(ch.shape[0], dtype=np.int64)
    routed_off[key] = csum - csum[first_of_dst]  # offset of each chunk in its destination's routed order

    # -- route: my chunks grouped by destination, each destination's rows in its routed order
    mine = np.flatnonzero(ch[:, SRC] == rank)
    mine = mine[np.lexsort((routed_off[mine], ch[mine, DST]))]
    send_index = _ranges(index.local_start[gid[mine]] + ch[mine, START], ch[mine, LEN])
    send_splits = np.bincount(ch[mine, DST], weights=ch[mine, LEN], minlength=S).astype(np.int64)
    to_me = np.flatnonzero(ch[:, DST] == rank)
    recv_splits = np.bincount(ch[to_me, SRC], weights=ch[to_me, LEN], minlength=S).astype(np.int64)
    # received: by source, each source's rows in my routed order; routed: my routed order
    arrival = to_me[np.lexsort((routed_off[to_me], ch[to_me, SRC]))]
    recv_start = np.cumsum(ch[arrival, LEN]) - ch[arrival, LEN]
    routed = to_me[np.argsort(routed_off[to_me], kind="stable")]
    pos_in_recv = np.empty(ch.shape[0], dtype=np.int64)
    pos_in_recv[arrival] = recv_start
    recv_index = _ranges(pos_in_recv[routed], ch[routed, LEN])
    identity = bool((recv_index == np.arange(recv_index.size)).all())
    routed_seq_id = np.repeat(gid[routed], ch[routed, LEN])
    routed_pos = _ranges(ch[routed, START], ch[routed, LEN])

    # -- my entries: groups I am in that hold sequences, in the global order
    entries, peer_tokens = [], {}
    lo = 0
    local_tokens, local_lens = 0, ()
    seq_group = np.asarray(plan.seq_bag, dtype=np.int64)
    for g in by_size.tolist():
        members = tuple(int(r) for r in plan.bags[g])
        if rank not in members:
            continue
        n = int(ch[to_me[grp[to_me] == g], LEN].sum())
        seqs = np.flatnonzero(seq_group == g)
        e = GroupEntry(
            group=g,
            members=members,
            position=members.index(rank),
            lo=lo,
            hi=lo + n,
            seq_lens=tuple(index.lengths[seqs].tolist()),
        )
        if e.degree == 1:
            local_tokens, local_lens = n, e.seq_lens
        entries.append(e)
        lo += n
    # tokens of each of my multi-rank entries routed to each member (what a member sends me)
    rel = np.flatnonzero(np.isin(grp, [e.group for e in entries if e.degree > 1]))
    for i, e in enumerate(entries):
        if e.degree == 1:
            continue
        sel = rel[grp[rel] == e.group]
        for m in e.members:
            peer_tokens[(m, i)] = int(ch[sel[ch[sel, DST] == m], LEN].sum())
    chunk_info = {
        "rel": rel,
        "grp": grp[rel],
        "dst": ch[rel, DST],
        "len": ch[rel, LEN],
        "off": routed_off[rel],
        "g_order": g_order[rel],
    }
    return RouteSpec(
        rank=rank,
        num_ranks=S,
        num_local=int(index.rank_tokens[rank]),
        num_routed=int(routed_seq_id.size),
        send_splits=send_splits.tolist(),
        recv_splits=recv_splits.tolist(),
        send_index=torch.from_numpy(send_index),
        recv_index=None if identity else torch.from_numpy(recv_index),
        routed_seq_id=torch.from_numpy(routed_seq_id.astype(np.int64)),
        routed_pos=torch.from_numpy(routed_pos),
        entries=tuple(entries),
        local_tokens=local_tokens,
        local_seq_lens=local_lens,
        group_sizes=tuple(sorted({int(sizes[g]) for g in used.tolist()})),
        has_ulysses=bool(used.size and sizes[used].max() > 1),
        _peer_tokens=peer_tokens,
        _chunk_info=chunk_info,
    )


def _ulysses_layout(spec: RouteSpec, h: int, h_kv: int, d: int, dv: int) -> UlyssesLayout:
    S = spec.num_ranks
    multi = [(i, e) for i, e in enumerate(spec.entries) if e.degree > 1]
    degrees = tuple(sorted({e.degree for _, e in multi}))

    def widths(k: int) -> tuple[int, int, int]:
        hq = h // k
        hkv = h_kv // k if h_kv % k == 0 else 1
        return hq, hkv, hq * d + hkv * d + hkv * dv

    W = {k: widths(k) for k in degrees}  # pre exchange: q | k | v heads of one member, per token
    Wo = {k: W[k][0] * dv for k in degrees}  # post exchange: that member's output heads, per token

    def slots(width: dict, tokens) -> tuple[list[int], dict]:
        """Per peer (ascending): my entries containing it (entry order), ``tokens(peer, i, e)``
        rows of ``width[degree]`` each. Returns the split sizes and each slot's offset."""
        splits, offset, off = [0] * S, {}, 0
        for peer in range(S):
            start = off
            for i, e in multi:
                if peer in e.members:
                    offset[(peer, i)] = off
                    off += tokens(peer, i, e) * width[e.degree]
            splits[peer] = off - start
        return splits, offset

    mine = lambda peer, i, e: e.hi - e.lo  # noqa: E731  (I send all my rows of an entry to each member)
    theirs = lambda peer, i, e: spec._peer_tokens[(peer, i)]  # noqa: E731
    Wi = {k: W[k][2] for k in degrees}
    pre_send, pre_send_off = slots(Wi, mine)
    pre_recv, pre_recv_off = slots(Wi, theirs)
    post_send, post_send_off = slots(Wo, theirs)
    post_recv, post_recv_off = slots(Wo, mine)
    pre_segments, post_segments = [], []
    for (peer, i), off in pre_send_off.items():
        e = spec.entries[i]
        if e.hi == e.lo:
            continue
        hq, hkv, w = W[e.degree]
        qh, kvh = member_heads(e.degree, e.members.index(peer), h, h_kv)
        pre_segments += [
            (0, e.lo, e.hi, qh.start, qh.stop, off, w, 0),
            (1, e.lo, e.hi, kvh.start, kvh.stop, off, w, hq * d),
            (2, e.lo, e.hi, kvh.start, kvh.stop, off, w, hq * d + hkv * d),
        ]
    for (peer, i), off in post_recv_off.items():
        e = spec.entries[i]
        if e.hi > e.lo:
            qh, _ = member_heads(e.degree, e.members.index(peer), h, h_kv)
            post_segments.append((off, Wo[e.degree], e.lo, e.hi, qh.start, qh.stop))
    g_in = reduce(math.gcd, [W[k][2] for k in degrees], 0) or 1
    g_out = reduce(math.gcd, list(Wo.values()), 0) or 1
    # -- attention order per degree: chunks of the degree's entries by (entry, gid, start)
    info = spec._chunk_info
    entry_of_group = {e.group: i for i, e in multi}
    member_lo = _member_entry_lo(info)
    gathers, scatters, cus, maxes, tokens = [], [], [], [], []
    for k in degrees:
        sel = np.flatnonzero(np.isin(info["grp"], [e.group for _, e in multi if e.degree == k]))
        sel = sel[np.argsort(info["g_order"][sel], kind="stable")]  # (gid, start) order within an entry
        ents = [entry_of_group[int(g)] for g in info["grp"][sel]]
        holders = info["dst"][sel].tolist()  # the member holding a chunk sends it (and gets its output)
        lens = info["len"][sel]
        in_slot = info["off"][sel] - member_lo[sel]  # rows before the chunk in the holder's entry range
        tok = _ranges(np.zeros(lens.size, dtype=np.int64), lens)  # token index within its chunk
        chunk_of_tok = np.repeat(np.arange(lens.size), lens)
        for width, offsets, g, out in ((W[k][2], pre_recv_off, g_in, gathers), (Wo[k], post_send_off, g_out, scatters)):
            start = np.asarray([offsets[(m, i)] for m, i in zip(holders, ents)], dtype=np.int64) + in_slot * width
            first = (start[chunk_of_tok] + tok * width) // g
            out.append((first[:, None] + np.arange(width // g)[None, :]).reshape(-1))
        seq_lens = [L for _, e in multi if e.degree == k for L in e.seq_lens]
        cus.append(np.concatenate([[0], np.cumsum(seq_lens)]).astype(np.int64).tolist())
        maxes.append(max(seq_lens, default=0))
        tokens.append(int(lens.sum()))
    one_group = None
    e = multi[0][1] if len(multi) == 1 else None
    if e is not None and h_kv % e.degree == 0 and e.lo == spec.local_tokens < e.hi == spec.num_routed:
        one_group = (e.degree, tuple(e.members.index(r) for r in sorted(e.members)))
    return UlyssesLayout(
        degrees=degrees,
        widths=tuple(W[k] for k in degrees),
        pre_send=pre_send,
        pre_recv=pre_recv,
        pre_segments=tuple(pre_segments),
        pre_rows=g_in,
        pre_gather=tuple(gathers),
        post_send=post_send,
        post_recv=post_recv,
        post_rows=g_out,
        post_scatter=tuple(scatters),
        post_segments=tuple(post_segments),
        cu_seqlens=tuple(cus),
        max_len=tuple(maxes),
        attn_tokens=tuple(tokens),
        replicated=any(h_kv % k for k in degrees),
        one_group=one_group,
    )


def _member_entry_lo(info: dict) -> np.ndarray:
    """For each relevant chunk: the routed offset, on the chunk's destination, of the first
    token of its group's range there (the smallest offset among that (destination, group)'s
    chunks)."""
    key = info["dst"] * (1 << 32) + info["grp"]
    _, inv = np.unique(key, return_inverse=True)
    lo = np.full(inv.max() + 1 if inv.size else 0, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(lo, inv, info["off"])
    return lo[inv]
