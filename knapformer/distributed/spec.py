"""Route specs: one rank's view of a plan as split sizes, permutations and copy segments.

Built once per step by :func:`build_route_spec` (pure numpy, then torch CPU tensors) and
reused by route, every layer's pre/post attention, and reverse. Device copies of the index
tensors are made lazily, once per device (:meth:`RouteSpec.indices_on`); the Ulysses exchange
layout of a head configuration is derived from the spec once per plan by
:mod:`knapformer.distributed.ulysses` (cached in :attr:`RouteSpec.cache`).

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

from dataclasses import dataclass, field

import numpy as np
import torch

from knapformer.attention.bounds import index_to, to_device, upload
from knapformer.distributed.exchange import Peers
from knapformer.plan import Plan
from knapformer.plan.seqindex import DST, LEN, SRC, START, concat_ranges

__all__ = ["ChunkInfo", "GroupEntry", "RouteSpec", "build_route_spec", "concat_ranges", "prepared_spec"]


@dataclass(frozen=True)
class GroupEntry:
    """One group this rank is in, with the routed tokens it holds for it."""

    group: int
    """Index of the group in the plan's ``groups``."""
    members: tuple[int, ...]
    position: int
    """This rank's index in ``members`` (its head slice)."""
    lo: int
    hi: int
    """Routed token range of this entry: rows ``lo:hi`` in routed order."""
    seq_lens: tuple[int, ...]
    """Lengths of the entry's sequences, in attention order."""
    ring: int = 1
    """Ring sub-groups r of the group (1: Ulysses over all members). With r > 1 the members
    are r sub-groups of u = k/r consecutive members: Ulysses inside each, ring attention
    across them."""
    blocks: tuple[tuple[int, ...], ...] = ()
    """With a ring: per sub-group, its block of each sequence (tokens, attention order) — the
    sub-group's members' chunks together, in sequence order."""
    runs: tuple[tuple[tuple[tuple[int, int], ...], ...], ...] = ()
    """With a ring: per sub-group, per sequence, the block's contiguous position ranges
    ``(start, length)`` in order (zigzag: half-blocks s and 2r − 1 − s, one range where they
    meet). Causal masks between blocks follow from them."""

    @property
    def degree(self) -> int:
        return len(self.members)

    @property
    def u(self) -> int:
        """The Ulysses size: members that split the heads of one block."""
        return len(self.members) // self.ring

    @property
    def ring_pos(self) -> int:
        """This rank's sub-group (its block of each sequence)."""
        return self.position // self.u

    @property
    def sub(self) -> tuple[int, ...]:
        """The members of this rank's sub-group (its Ulysses partners; all members without a ring)."""
        s, u = self.ring_pos, self.u
        return self.members[s * u : (s + 1) * u]

    @property
    def ring_peers(self) -> tuple[int, ...]:
        """Per sub-group: its member with this rank's heads (the ring this rank passes K/V around)."""
        u, t = self.u, self.position % self.u
        return tuple(self.members[s * u + t] for s in range(self.ring))


@dataclass(frozen=True)
class ChunkInfo:
    """The plan's chunks of groups with several members of which this rank is one, in chunk
    table order: what the Ulysses layout needs to place every member's rows."""

    group: np.ndarray
    """(c,) the chunk's group."""
    dst: np.ndarray
    """(c,) the member holding the chunk."""
    length: np.ndarray
    """(c,) its tokens."""
    routed_offset: np.ndarray
    """(c,) its first row in the holder's routed order."""
    group_order: np.ndarray
    """(c,) its group's place in the global group order."""


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
    used_groups: tuple[tuple[int, ...], ...]
    """Every group of the plan that holds sequences, in the global group order (the heads are
    checked against them)."""
    used_rings: tuple[int, ...]
    """Their ring sub-groups r (1: Ulysses alone)."""
    ring_rounds: int
    """The largest r of the plan (1: no ring): ring exchanges run in rounds 1 … r − 1 (a rank
    exchanges in a round only with the ring peers it has in it)."""
    has_ulysses: bool
    """This rank is in some group with several members: it exchanges before and after
    attention (else its layers exchange nothing)."""
    in_ring: bool
    """This rank is in some ring group (ring rounds, or the K/V gather of ``pre_attn``)."""
    routes: bool
    """This rank's route sends or receives rows, or reorders them: else its routed order is
    its local order and route/reverse are identities (no exchange, no copy)."""
    route_peers: Peers
    """Route's exchange (reverse: ``route_peers.reversed()``): rows to and from each peer."""
    layer_peers: frozenset[int]
    """The ranks this rank moves data with in a layer's attention exchanges (Ulysses pre/post,
    ring rounds, the K/V gather), whatever the heads: the members of its groups that hold
    tokens it needs or need tokens it holds."""
    peer_tokens: dict[tuple[int, int], int] = field(repr=False)
    """(peer, entry index) -> tokens of that entry routed to that peer (peers of this rank's
    sub-group)."""
    chunk_info: ChunkInfo = field(repr=False)
    cache: dict = field(default_factory=dict, repr=False)
    """Layouts derived from this spec (per head configuration), built once per plan."""
    _device_cache: dict = field(default_factory=dict, repr=False)

    @property
    def group_sizes(self) -> tuple[int, ...]:
        """The distinct sizes of :attr:`used_groups`, ascending."""
        return tuple(sorted({len(g) for g in self.used_groups}))

    def indices_on(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Index tensors on ``device``, copied once per device (per plan) and cached: built on
        the host, uploaded asynchronously from pinned memory (no host-device synchronisation)."""
        key = str(device)
        if key not in self._device_cache:
            d = {n: to_device(getattr(self, n), device) for n in ("send_index", "routed_seq_id", "routed_pos")}
            inverse = torch.empty_like(self.send_index)
            inverse[self.send_index] = torch.arange(self.num_local)
            d["send_inverse"] = to_device(inverse, device)
            if self.recv_index is not None:
                d["recv_index"] = to_device(self.recv_index, device)
                d["recv_inverse"] = to_device(torch.argsort(self.recv_index), device)
            d["local_cu_seqlens"] = upload(np.cumsum([0, *self.local_seq_lens]), device)
            present, slot = np.unique(self.routed_seq_id.numpy(), return_inverse=True)
            d["present"], d["slot"] = index_to(present, device), index_to(slot.reshape(-1), device)
            self._device_cache[key] = d
        return self._device_cache[key]


def _ring_blocks(ch, gid, grp, g: int, members, seqs: np.ndarray, r: int):
    """Per sub-group of group ``g`` (r of them, consecutive members): its tokens of each of
    ``seqs`` (the block it holds: its members' chunks) and the block's position runs."""
    sel = np.flatnonzero(grp == g)
    u = len(members) // r
    member_of = {m: i for i, m in enumerate(members)}
    sub = np.fromiter((member_of[int(d)] // u for d in ch[sel, DST]), dtype=np.int64, count=sel.size)
    seq_pos = np.searchsorted(seqs, gid[sel])
    out = np.zeros((r, seqs.size), dtype=np.int64)
    np.add.at(out, (sub, seq_pos), ch[sel, LEN])
    runs: list[list[list[tuple[int, int]]]] = [[[] for _ in range(seqs.size)] for _ in range(r)]
    order = np.lexsort((ch[sel, START], seq_pos, sub))
    for s_, q, start, n in zip(
        sub[order].tolist(), seq_pos[order].tolist(), *ch[sel[order]][:, [START, LEN]].T.tolist()
    ):
        mine = runs[s_][q]
        if mine and mine[-1][0] + mine[-1][1] == start:
            mine[-1] = (mine[-1][0], mine[-1][1] + n)
        else:
            mine.append((start, n))
    blocks = tuple(tuple(int(x) for x in row) for row in out)
    return blocks, tuple(tuple(tuple(q) for q in row) for row in runs)


def prepared_spec(plan: Plan, rank: int) -> RouteSpec:
    """:func:`build_route_spec`, kept on the plan (per rank) for the next call: a plan made
    ahead in a DataLoader worker carries this rank's spec, built there, to the training loop
    (:class:`knapformer.data.PlannedSteps`), which then builds nothing on its critical path."""
    cache = plan.__dict__.setdefault("_route_specs", {})
    if rank not in cache:
        cache[rank] = build_route_spec(plan, rank)
    return cache[rank]


def build_route_spec(plan: Plan, rank: int) -> RouteSpec:
    """This rank's route spec for ``plan`` (pure; every rank builds its own)."""
    S = plan.num_ranks
    if not 0 <= rank < S:
        raise ValueError(f"rank {rank} is outside the plan's group of {S} ranks")
    ch = plan.chunks
    index = plan.index
    gid = plan.chunk_gid
    grp = np.asarray(plan.seq_group, dtype=np.int64)[gid]
    sizes = np.fromiter((len(b) for b in plan.groups), dtype=np.int64, count=len(plan.groups))
    used = np.unique(plan.seq_group) if index.num_seqs else np.zeros(0, dtype=np.int64)
    # one global group order: by size, then index in the plan
    order_of_group = np.full(len(plan.groups), -1, dtype=np.int64)
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
    send_index = concat_ranges(index.local_start[gid[mine]] + ch[mine, START], ch[mine, LEN])
    send_splits = np.bincount(ch[mine, DST], weights=ch[mine, LEN], minlength=S).astype(np.int64)
    to_me = np.flatnonzero(ch[:, DST] == rank)
    recv_splits = np.bincount(ch[to_me, SRC], weights=ch[to_me, LEN], minlength=S).astype(np.int64)
    # received: by source, each source's rows in my routed order; routed: my routed order
    arrival = to_me[np.lexsort((routed_off[to_me], ch[to_me, SRC]))]
    recv_start = np.cumsum(ch[arrival, LEN]) - ch[arrival, LEN]
    routed = to_me[np.argsort(routed_off[to_me], kind="stable")]
    pos_in_recv = np.empty(ch.shape[0], dtype=np.int64)
    pos_in_recv[arrival] = recv_start
    recv_index = concat_ranges(pos_in_recv[routed], ch[routed, LEN])
    identity = bool((recv_index == np.arange(recv_index.size)).all())
    routed_seq_id = np.repeat(gid[routed], ch[routed, LEN])
    routed_pos = concat_ranges(ch[routed, START], ch[routed, LEN])

    # -- my entries: groups I am in that hold sequences, in the global order
    entries, peer_tokens = [], {}
    lo = 0
    local_tokens, local_lens = 0, ()
    seq_group = np.asarray(plan.seq_group, dtype=np.int64)
    rings = plan.rings
    for g in by_size.tolist():
        members = tuple(int(r) for r in plan.groups[g])
        if rank not in members:
            continue
        n = int(ch[to_me[grp[to_me] == g], LEN].sum())
        seqs = np.flatnonzero(seq_group == g)
        r = int(rings[g])
        blocks, runs = _ring_blocks(ch, gid, grp, g, members, seqs, r) if r > 1 else ((), ())
        e = GroupEntry(
            group=g,
            members=members,
            position=members.index(rank),
            lo=lo,
            hi=lo + n,
            seq_lens=tuple(index.lengths[seqs].tolist()),
            ring=r,
            blocks=blocks,
            runs=runs,
        )
        if e.degree == 1:  # one-rank groups come first; a plan may list this rank's more than once
            local_tokens, local_lens = local_tokens + n, local_lens + e.seq_lens
        entries.append(e)
        lo += n
    # tokens of each of my multi-rank entries routed to each member (what a member sends me)
    rel = np.flatnonzero(np.isin(grp, [e.group for e in entries if e.degree > 1]))
    for i, e in enumerate(entries):
        if e.degree == 1:
            continue
        sel = rel[grp[rel] == e.group]
        for m in e.sub:
            peer_tokens[(m, i)] = int(ch[sel[ch[sel, DST] == m], LEN].sum())
    route_peers = Peers.from_splits(send_splits.tolist(), recv_splits.tolist(), rank)
    layer_peers = set()
    for i, e in enumerate(entries):
        if e.degree == 1:
            continue
        mine_rows = e.hi - e.lo
        layer_peers |= {m for m in e.sub if m != rank and (mine_rows or peer_tokens[(m, i)])}
        if e.ring > 1:
            own = sum(e.blocks[e.ring_pos])
            layer_peers |= {m for s_, m in enumerate(e.ring_peers) if m != rank and (own or sum(e.blocks[s_]))}
    home_in_order = bool((send_index == np.arange(send_index.size)).all())
    chunk_info = ChunkInfo(
        group=grp[rel],
        dst=ch[rel, DST],
        length=ch[rel, LEN],
        routed_offset=routed_off[rel],
        group_order=g_order[rel],
    )
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
        used_groups=tuple(tuple(int(r) for r in plan.groups[g]) for g in by_size.tolist()),
        used_rings=tuple(int(rings[g]) for g in by_size.tolist()),
        ring_rounds=max((int(rings[g]) for g in by_size.tolist()), default=1),
        has_ulysses=any(e.degree > 1 for e in entries),
        in_ring=any(e.ring > 1 for e in entries),
        routes=bool(route_peers.moves or not identity or not home_in_order),
        route_peers=route_peers,
        layer_peers=frozenset(layer_peers),
        peer_tokens=peer_tokens,
        chunk_info=chunk_info,
    )
