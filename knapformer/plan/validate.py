"""Checking a plan against the invariants of the plan form (:meth:`Plan.validate <knapformer.plan.plan.Plan.validate>`).

Groups of distinct ranks of the group; every sequence covered exactly by contiguous chunks in
group order (at most one per member, none on a non-member); the memory cap; no makespan below
the lower bound. The first breach found raises :class:`InvalidPlanError` naming it.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

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
        order = np.ones(gid.size, dtype=bool)
        order[1:] = first_row[1:] | (pos[1:] > pos[:-1])
        if not order.all():
            _fail(f"{where(~order)} chunks are not in group order / one per member")
    if plan.max_tokens_per_rank is not None:
        tok = plan.tokens_per_rank()
        worst = int(np.argmax(tok)) if tok.size else 0
        if tok.size and tok[worst] > plan.max_tokens_per_rank:
            _fail(f"rank {worst} holds {tok[worst]} tokens > max_tokens_per_rank={plan.max_tokens_per_rank}")
    if plan.time_after.shape != (S,) or plan.time_before.shape != (S,):
        _fail(f"time_before/time_after must have one entry per rank ({S})")
    if plan.makespan < plan.lower_bound * (1 - 1e-9):
        _fail("plan beats its lower bound")
