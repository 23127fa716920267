"""Checking a plan against the invariants of the plan form (:meth:`Plan.validate <knapformer.plan.plan.Plan.validate>`).

Groups of distinct ranks of the group; every sequence covered exactly by contiguous chunks in
group order (at most one per member, none on a non-member; ring groups: zigzag order, at most
two per member); the memory cap; no makespan below
the lower bound. The first breach found raises :class:`InvalidPlanError` naming it.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from knapformer.plan.chunks import zigzag_slots
from knapformer.plan.problem import validate_seq_lens
from knapformer.plan.seqindex import DST, IDX, LEN, SRC, START, SeqIndex, group_arrays

__all__ = ["InvalidPlanError", "PlanForm", "check_plan"]


class PlanForm(Protocol):
    """What checking (and drawing) a plan reads of it: the plan form of
    :class:`~knapformer.plan.plan.Plan`, named here so that this module and the picture need
    not import the module that defines the plan (which imports them)."""

    seq_lens: tuple[tuple[int, ...], ...]
    groups: tuple[tuple[int, ...], ...]
    seq_group: np.ndarray
    chunks: np.ndarray
    time_before: np.ndarray
    time_after: np.ndarray
    lower_bound: float
    solver: str
    max_tokens_per_rank: int | None
    cost_model: object
    ring: tuple[int, ...] | None
    kv_gather: bool
    link: object

    @property
    def index(self) -> SeqIndex: ...
    @property
    def chunk_gid(self) -> np.ndarray: ...
    @property
    def num_ranks(self) -> int: ...
    @property
    def rings(self) -> tuple[int, ...]: ...
    @property
    def makespan(self) -> float: ...
    def tokens_per_rank(self) -> np.ndarray: ...
    def memory_per_rank(self) -> np.ndarray: ...
    def stats(self) -> dict[str, float]: ...


class InvalidPlanError(ValueError):
    """A plan breaks an invariant (names the first breach found)."""


def _fail(message: str) -> None:
    raise InvalidPlanError(message)


def check_plan(plan: PlanForm) -> None:
    try:
        lens = validate_seq_lens(plan.seq_lens)
    except ValueError as exc:
        _fail(f"plan.seq_lens: {exc}")
    S = len(lens)
    index = plan.index
    n = index.num_seqs
    if not plan.groups and n:
        _fail("plan has sequences but no groups")
    for i, g in enumerate(plan.groups):
        if len(g) == 0:
            _fail(f"group {i} is empty")
        if len(set(g)) != len(g):
            _fail(f"group {i} {tuple(g)} repeats a rank")
        bad = [r for r in g if not (isinstance(r, (int, np.integer)) and 0 <= r < S)]
        if bad:
            _fail(f"group {i} {tuple(g)} has rank {bad[0]!r} outside the group's {S} ranks")
    if plan.ring is not None:
        if len(plan.ring) != len(plan.groups):
            _fail(f"ring has {len(plan.ring)} entries for {len(plan.groups)} groups")
        for i, (g, r) in enumerate(zip(plan.groups, plan.ring)):
            if not (isinstance(r, (int, np.integer)) and r >= 1 and len(g) % r == 0):
                _fail(f"group {i} {tuple(g)}: ring {r!r} must be an int >= 1 dividing its {len(g)} ranks")
    sb = np.asarray(plan.seq_group)
    if sb.shape != (n,):
        _fail(f"seq_group has shape {sb.shape}, expected ({n},)")
    if n and (sb.min() < 0 or sb.max() >= len(plan.groups)):
        _fail(
            f"seq_group names group {int(sb.max() if sb.max() >= len(plan.groups) else sb.min())}, "
            f"the plan has {len(plan.groups)}"
        )
    ch = plan.chunks
    if ch.ndim != 2 or ch.shape[1] != 5:
        _fail(f"chunk table has shape {ch.shape}, expected (m, 5)")
    if (ch[:, LEN] <= 0).any():
        _fail("chunk with non-positive length")
    if ((ch[:, SRC] < 0) | (ch[:, SRC] >= S) | (ch[:, DST] < 0) | (ch[:, DST] >= S)).any():
        _fail(f"chunk with a source or destination outside the group's {S} ranks")
    if ((ch[:, IDX] < 0) | (ch[:, IDX] >= index.counts[ch[:, SRC]])).any():
        row = int(np.flatnonzero((ch[:, IDX] < 0) | (ch[:, IDX] >= index.counts[ch[:, SRC]]))[0])
        _fail(f"chunk row {row} names sequence {int(ch[row, IDX])} of rank {int(ch[row, SRC])}, which does not exist")
    key = ch[:, SRC] * (1 << 32) + ch[:, IDX]
    if (np.diff(key) < 0).any():
        _fail("chunk table is not sorted by (src, seq_index)")
    gid = plan.chunk_gid
    seen = np.bincount(gid, minlength=n)
    if n and (seen == 0).any():
        g = int(np.flatnonzero(seen == 0)[0])
        _fail(f"sequence ({int(index.src_rank[g])},{int(index.seq_index[g])}) has no chunks")
    # vectorised per-sequence checks over rows sorted by (gid, start)
    first_row = np.concatenate([[True], gid[1:] != gid[:-1]]) if gid.size else np.zeros(0, dtype=bool)
    last_row = np.concatenate([gid[1:] != gid[:-1], [True]]) if gid.size else np.zeros(0, dtype=bool)
    starts, lengths = ch[:, START], ch[:, LEN]

    def where(mask):
        g = int(gid[np.flatnonzero(mask)[0]])
        return f"sequence ({int(index.src_rank[g])},{int(index.seq_index[g])})"

    bad = first_row & (starts != 0)
    if bad.any():
        _fail(f"{where(bad)} does not start at token 0")
    cont = np.ones(gid.size, dtype=bool)
    cont[1:] = first_row[1:] | (starts[1:] == starts[:-1] + lengths[:-1])
    if not cont.all():
        _fail(f"{where(~cont)} chunks are not contiguous")
    bad = last_row & (starts + lengths != index.lengths[gid])
    if bad.any():
        _fail(f"{where(bad)} is not covered exactly")
    if ch.shape[0]:
        sizes, mat = group_arrays(plan.groups)
        grp = sb[gid]
        member = mat[grp] == ch[:, DST][:, None]
        inside = member.any(axis=1)
        if not inside.all():
            _fail(
                f"{where(~inside)} has a chunk on rank {int(ch[np.flatnonzero(~inside)[0], DST])}, "
                f"not a member of its group {tuple(plan.groups[int(grp[np.flatnonzero(~inside)[0]])])}"
            )
        pos = member.argmax(axis=1)
        order = _increasing(pos, first_row)
        rings = np.asarray(plan.rings, dtype=np.int64)
        ringed = rings[grp] > 1
        if ringed.any() and not order.all():
            # ring groups: zigzag order (two chunks per member; what the planner cuts) or group
            # order (contiguous blocks: plans of earlier releases), one of them per sequence
            zig = pos.copy()
            zig[ringed] = _zigzag_positions(pos, ringed, first_row, grp, sizes, rings)
            zig_ok = _increasing(zig, first_row) & (zig >= 0)
            bad_plain = np.bincount(gid, weights=~order, minlength=n) > 0
            bad_zig = np.bincount(gid, weights=~zig_ok, minlength=n) > 0
            ok_seq = ~bad_plain | (~bad_zig & (rings[sb] > 1))
            order = ok_seq[gid]
        if not order.all():
            what = (
                "group order (ring groups: or zigzag order, two per member)" if ringed[~order].any() else "group order"
            )
            _fail(f"{where(~order)} chunks are not in {what} / one per member")
    if plan.max_tokens_per_rank is not None:
        tok = plan.memory_per_rank()
        worst = int(np.argmax(tok)) if tok.size else 0
        if tok.size and tok[worst] > plan.max_tokens_per_rank:
            routed = tok[worst] == plan.tokens_per_rank()[worst]
            what = "tokens" if routed else "token-equivalents (gathered K/V included)"
            _fail(f"rank {worst} holds {tok[worst]} {what} > max_tokens_per_rank={plan.max_tokens_per_rank}")
    if plan.time_after.shape != (S,) or plan.time_before.shape != (S,):
        _fail(f"time_before/time_after must have one entry per rank ({S})")
    if plan.makespan < plan.lower_bound * (1 - 1e-9):
        _fail("plan beats its lower bound")


def _increasing(pos: np.ndarray, first_row: np.ndarray) -> np.ndarray:
    """Per row: its position is past the previous row's of the same sequence."""
    ok = np.ones(pos.size, dtype=bool)
    ok[1:] = first_row[1:] | (pos[1:] > pos[:-1])
    return ok


def _zigzag_positions(pos, ringed, first_row, grp, sizes, rings) -> np.ndarray:
    """For the rows of ring groups (in (sequence, start) order): the zigzag chunk position of
    each row's member — its first slot while that is past the previous row's, else its second
    (-1 if neither is: an order breach). Ring sequences are few and long; a loop over their rows."""
    out = []
    prev = -1
    slots_of: dict[tuple[int, int], list[list[int]]] = {}
    for i in np.flatnonzero(ringed).tolist():
        g = int(grp[i])
        key = (int(sizes[g]), int(rings[g]))
        if key not in slots_of:
            slot_member = zigzag_slots(*key)
            table = [[] for _ in range(key[0])]
            for slot, m in enumerate(slot_member.tolist()):
                table[m].append(slot)
            slots_of[key] = table
        if first_row[i]:
            prev = -1
        first, second = slots_of[key][int(pos[i])]
        prev = first if first > prev else second if second > prev else -1
        out.append(prev)
    return np.asarray(out, dtype=np.int64)
