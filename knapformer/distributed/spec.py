"""Route specs: one rank's view of a plan as split sizes and permutation indices.

Built once per step by :func:`build_route_spec` (pure numpy, then torch CPU tensors) and
reused by route, every layer's pre/post attention, and reverse. Device copies of the index
tensors are made lazily, once per device (:meth:`RouteSpec.indices_on`).

Token orders (legend: T = tokens on this rank before routing, R = routed tokens on this
rank, A = tokens of the whole sequences this rank attends over):

- *local*: the caller's order, sequences concatenated in ``local_seq_lens`` order.
- *routed*: the chunks whose destination is this rank, sorted by (global sequence id, start).
  ``all_to_all_single`` delivers exactly this order when every source sends its chunks in
  sequence order, so receiving needs no permutation.
- *attention*: whole sequences of this rank's bag in global id order, each with h/k heads.

The reverse route is derived from the forward one (the same ``send_index``), so
``reverse(route(x)) == x`` by construction.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from knapformer.plan import Plan
from knapformer.plan.plan import DST, LEN, SRC, START

__all__ = ["RouteSpec", "build_route_spec"]


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenate ``arange(s, s + l)`` for each pair, vectorised."""
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
    return np.arange(total, dtype=np.int64) + offsets


@dataclass(frozen=True, eq=False)
class RouteSpec:
    """This rank's exchanges for one step. Split sizes are in tokens, indexed by group rank."""

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
    """(T,) local positions in send order (grouped by destination, then sequence order)."""
    routed_seq_id: torch.Tensor
    """(R,) global (group) sequence id of each routed token."""
    routed_pos: torch.Tensor
    """(R,) position of each routed token within its sequence."""
    bag_size: int
    """k: ranks in this rank's bag (1 = no Ulysses exchange)."""
    attn_send_splits: list[int]
    attn_recv_splits: list[int]
    head_order: torch.Tensor
    """(k,) head group sent to each bag member, members in ascending rank order."""
    heads_in_order: bool
    """Bag members already ascending (the usual case): no head-group reordering per layer."""
    attn_index: torch.Tensor
    """(A,) row of the received buffer for each attention-order token."""
    attn_seq_lens: list[int]
    """Lengths of the whole sequences this rank attends over (attention order)."""
    all_bag_sizes: tuple[int, ...]
    """Sizes of every bag of the plan (to check head divisibility identically on all ranks)."""
    any_multi_rank_bag: bool
    """False when every bag has one rank: pre/post attention then skip the collective."""
    _device_cache: dict = field(default_factory=dict, repr=False)

    @property
    def num_attn(self) -> int:
        return int(sum(self.attn_seq_lens))

    def indices_on(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Index tensors on ``device``, copied once per device and cached."""
        key = str(device)
        if key not in self._device_cache:
            names = ("send_index", "head_order", "attn_index", "routed_seq_id", "routed_pos")
            d = {n: getattr(self, n).to(device) for n in names}
            d["send_inverse"] = torch.empty_like(d["send_index"])
            d["send_inverse"][d["send_index"]] = torch.arange(self.num_local, device=device)
            d["head_inverse"] = torch.argsort(d["head_order"])
            d["attn_inverse"] = torch.empty_like(d["attn_index"])
            d["attn_inverse"][d["attn_index"]] = torch.arange(self.num_attn, device=device)
            lens = torch.tensor([0] + self.attn_seq_lens, dtype=torch.int64)
            d["cu_seqlens"] = torch.cumsum(lens, 0).to(torch.int32).to(device)
            self._device_cache[key] = d
        return self._device_cache[key]


def build_route_spec(plan: Plan, rank: int) -> RouteSpec:
    """This rank's route spec for ``plan`` (pure; every rank builds its own)."""
    S = plan.num_ranks
    if not 0 <= rank < S:
        raise ValueError(f"rank {rank} is outside the plan's group of {S} ranks")
    ch = plan.chunks
    index = plan.index
    flat_lens, local_start, rank_tokens = index.lengths, index.local_start, index.rank_tokens
    gid = plan.chunk_gid

    # -- route: send my chunks grouped by destination (stable: sequence order within)
    mine = np.flatnonzero(ch[:, SRC] == rank)
    mine = mine[np.argsort(ch[mine, DST], kind="stable")]
    send_index = _ranges(local_start[gid[mine]] + ch[mine, START], ch[mine, LEN])
    send_splits = np.bincount(ch[mine, DST], weights=ch[mine, LEN], minlength=S).astype(np.int64)
    to_me = np.flatnonzero(ch[:, DST] == rank)
    recv_splits = np.bincount(ch[to_me, SRC], weights=ch[to_me, LEN], minlength=S).astype(np.int64)
    routed_seq_id = np.repeat(gid[to_me], ch[to_me, LEN])
    routed_pos = _ranges(ch[to_me, START], ch[to_me, LEN])
    num_local = int(rank_tokens[rank])

    # -- attention: my bag's sequences, whole, with h/k heads
    my_bags = [b for b, members in enumerate(plan.bags) if rank in members]
    if len(my_bags) != 1:
        raise ValueError(
            f"rank {rank} belongs to {len(my_bags)} bags of this plan; Ulysses attention needs exactly one"
        )
    bag = my_bags[0]
    members = list(plan.bags[bag])
    k = len(members)
    routed_per_rank = np.bincount(ch[:, DST], weights=ch[:, LEN], minlength=S).astype(np.int64)
    attn_send = np.zeros(S, dtype=np.int64)
    attn_recv = np.zeros(S, dtype=np.int64)
    attn_send[members] = len(routed_seq_id)
    attn_recv[members] = routed_per_rank[members]
    ascending = sorted(members)
    head_order = np.asarray([members.index(e) for e in ascending], dtype=np.int64)
    # received buffer: blocks from members in ascending rank order, each in that member's routed order
    block_start = {e: int(s) for e, s in zip(ascending, np.cumsum([0] + [int(routed_per_rank[e]) for e in ascending]))}
    in_bag = np.isin(ch[:, DST], members)
    rows = np.flatnonzero(in_bag)
    # offset of each row inside its destination's routed order (table order = routed order)
    dst_rows = ch[rows, DST]
    lens_rows = ch[rows, LEN]
    offset_in_dst = np.zeros(rows.size, dtype=np.int64)
    for e in members:
        sel = dst_rows == e
        offset_in_dst[sel] = np.cumsum(lens_rows[sel]) - lens_rows[sel]
    base = np.asarray([block_start[int(e)] for e in dst_rows], dtype=np.int64) + offset_in_dst
    # table order is (gid, start): exactly attention order
    attn_index = _ranges(base, lens_rows)
    seq_ids = np.flatnonzero(plan.seq_bag == bag)
    return RouteSpec(
        rank=rank,
        num_ranks=S,
        num_local=num_local,
        num_routed=int(len(routed_seq_id)),
        send_splits=send_splits.tolist(),
        recv_splits=recv_splits.tolist(),
        send_index=torch.from_numpy(send_index),
        routed_seq_id=torch.from_numpy(routed_seq_id.astype(np.int64)),
        routed_pos=torch.from_numpy(routed_pos),
        bag_size=k,
        attn_send_splits=attn_send.tolist(),
        attn_recv_splits=attn_recv.tolist(),
        head_order=torch.from_numpy(head_order),
        heads_in_order=members == ascending,
        attn_index=torch.from_numpy(attn_index),
        attn_seq_lens=flat_lens[seq_ids].tolist(),
        all_bag_sizes=tuple(sorted({len(b) for b in plan.bags})),
        any_multi_rank_bag=any(len(b) > 1 for b in plan.bags),
    )
