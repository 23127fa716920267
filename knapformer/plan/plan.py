"""The ``Plan`` value: where every chunk of every sequence goes, and what that predicts.

A plan gives each sequence a *group*: an ordered tuple of distinct ranks of the balancing
group (``bags[seq_bag[g]]``); the sequence is cut into one contiguous chunk per member, chunk
i on member i. In a bag layout the groups are the layout's bags, a partition of the ranks; in
per-sequence plans groups may overlap arbitrarily (a rank runs some sequences alone and
chunks of others with different partners). A solver only decides ``seq_bag``;
:func:`chunk_table` turns that into the chunk table the executor follows, so every solver cuts
sequences the same way:

- a sequence of length L in a group of k ranks is cut into k contiguous chunks of ⌊L/k⌋
  tokens; the ``L mod k`` leftover tokens go one each to chunk positions ``offset, offset+1,
  ...`` (mod k), and the group's ``offset`` advances by ``L mod k`` after each sequence
  (global id order). Token counts of a bag's ranks therefore differ by at most one.
- chunk position i lives on the group's i-th rank; positions with zero tokens get no row.

Chunk table rows: ``[src_rank, seq_index, start, length, dst_rank]`` sorted by
``(src_rank, seq_index, start)``.

Cost of a rank (:func:`rank_features`): the linear cost of the tokens it holds, plus for every
sequence whose group it is in, 1/k of the sequence's attention and the per-sequence cost
(Ulysses gives each member all L tokens for h/k heads; a member holding zero tokens of a short
sequence still runs its heads).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from knapformer.plan.cost import comm_features, route_seconds, ulysses_seconds
from knapformer.plan.problem import PlanProblem, moldable_lower_bound, validate_seq_lens
from knapformer.plan.seqindex import DST, IDX, LEN, SRC, START, SeqIndex, spread_over_groups, sum_by
from knapformer.workload import WorkloadModel

__all__ = [
    "InvalidPlanError",
    "Plan",
    "RankFeatures",
    "build_plan",
    "chunk_table",
    "moldable_lower_bound",
    "plan_from_groups",
    "rank_features",
    "spread_over_groups",
]


class InvalidPlanError(ValueError):
    """A plan breaks an invariant (names the first breach found)."""


def _group_arrays(groups) -> tuple[np.ndarray, np.ndarray]:
    """(G,) group sizes and (G, max size) group ranks padded with -1."""
    sizes = np.fromiter((len(g) for g in groups), dtype=np.int64, count=len(groups))
    mat = np.full((len(groups), int(sizes.max()) if len(groups) else 1), -1, dtype=np.int64)
    for i, g in enumerate(groups):
        mat[i, : len(g)] = g
    return sizes, mat


def chunk_table(index: SeqIndex, groups, seq_group: np.ndarray) -> np.ndarray:
    """Vectorised chunking of every sequence in its group (see module docstring)."""
    n = index.num_seqs
    if n == 0:
        return np.zeros((0, 5), dtype=np.int64)
    lengths = index.lengths
    sizes, mat = _group_arrays(groups)
    k = sizes[seq_group]
    base, rem = lengths // k, lengths % k
    # Rotation offset: leftovers of earlier sequences in the same group, in global id order.
    order = np.argsort(seq_group, kind="stable")
    rem_sorted = rem[order]
    csum = np.cumsum(rem_sorted) - rem_sorted
    group_sorted = seq_group[order]
    first = np.searchsorted(group_sorted, group_sorted, side="left")
    offset = np.empty(n, dtype=np.int64)
    offset[order] = csum - csum[first]
    offset %= k
    # One row per (sequence, group position).
    seq_of_row = np.repeat(np.arange(n), k)
    row_start = np.cumsum(k) - k
    pos = np.arange(seq_of_row.shape[0]) - np.repeat(row_start, k)
    kr = k[seq_of_row]
    extra = ((pos - offset[seq_of_row]) % kr) < rem[seq_of_row]
    length = base[seq_of_row] + extra.astype(np.int64)
    csum_len = np.cumsum(length)
    seq_first = np.repeat(csum_len[row_start] - length[row_start], k)
    start = csum_len - length - seq_first
    dst = mat[seq_group[seq_of_row], pos]
    keep = length > 0
    table = np.stack([index.src_rank[seq_of_row], index.seq_index[seq_of_row], start, length, dst], axis=1)[keep]
    return np.ascontiguousarray(table, dtype=np.int64)


@dataclass(frozen=True)
class RankFeatures:
    """What a rank's predicted time is made of, per rank (S,): the cost model prices these."""

    tokens: np.ndarray
    """Tokens the rank holds after routing (linear work)."""
    attn: np.ndarray
    """Σ L²/k over the sequences of its groups (its share of the attention work)."""
    seqs: np.ndarray
    """Sequences whose group it is in (per-sequence cost)."""

    def cost(self, model: WorkloadModel) -> np.ndarray:
        """(S,) predicted work under ``model`` (same units as ``model.cost``)."""
        return model.linear_coef * self.tokens + model.quad_coef * self.attn + model.per_seq_coef * self.seqs


def rank_features(index: SeqIndex, groups, seq_group: np.ndarray, chunks: np.ndarray) -> RankFeatures:
    """Per-rank features of a chunk table (see module docstring)."""
    S = index.num_ranks
    sizes = np.fromiter((len(g) for g in groups), dtype=np.float64, count=len(groups))
    L = index.lengths.astype(np.float64)
    return RankFeatures(
        tokens=sum_by(chunks[:, DST], chunks[:, LEN], S),
        attn=spread_over_groups(groups, seq_group, L * L / sizes[seq_group], S),
        seqs=spread_over_groups(groups, seq_group, np.ones_like(L), S),
    )


@dataclass(frozen=True, eq=False)
class Plan:
    """One step's plan for one balancing group. Frozen; build with :func:`build_plan`."""

    seq_lens: tuple[tuple[int, ...], ...]
    """Input lengths per rank."""
    bags: tuple[tuple[int, ...], ...]
    """The groups sequences run on: ordered tuples of distinct group ranks (chunk position j of
    group i lives on ``bags[i][j]``). A bag layout's bags partition the ranks; per-sequence
    plans may use overlapping groups of any sizes."""
    seq_bag: np.ndarray
    """(n,) group (index into ``bags``) of each sequence, global rank-major order."""
    chunks: np.ndarray
    """(m, 5) rows ``[src_rank, seq_index, start, length, dst_rank]``."""
    time_before: np.ndarray
    """(S,) predicted per-rank time without balancing."""
    time_after: np.ndarray
    """(S,) predicted per-rank time with this plan."""
    lower_bound: float
    """No plan's makespan can be below this."""
    tokens_moved: int
    """Tokens whose destination differs from their source rank."""
    plan_seconds: float
    """Wall time the solver took."""
    solver: str
    """Name of the solver that produced the plan."""
    max_tokens_per_rank: int | None = None
    """Memory cap the plan was built under."""
    cost_model: WorkloadModel | None = None
    """The cost model the times were predicted with (carried for pictures and reports; not
    part of the digest)."""

    # -- derived ---------------------------------------------------------------------------
    @property
    def num_ranks(self) -> int:
        return len(self.seq_lens)

    @cached_property
    def index(self) -> SeqIndex:
        """Global sequence numbering of ``seq_lens`` (derived once)."""
        return SeqIndex(self.seq_lens)

    @cached_property
    def chunk_gid(self) -> np.ndarray:
        """(m,) global sequence id of each chunk row."""
        return self.index.gid(self.chunks[:, SRC], self.chunks[:, IDX])

    @property
    def makespan(self) -> float:
        return float(self.time_after.max()) if self.time_after.size else 0.0

    @property
    def imbalance_before(self) -> float:
        """max/mean − 1 of the unbalanced per-rank time."""
        return _imbalance(self.time_before)

    @property
    def imbalance_after(self) -> float:
        return _imbalance(self.time_after)

    @property
    def gap_to_bound(self) -> float:
        """makespan / lower bound (1.0 = provably optimal)."""
        return self.makespan / self.lower_bound if self.lower_bound > 0 else 1.0

    def tokens_per_rank(self) -> np.ndarray:
        """(S,) routed tokens held by each rank."""
        return sum_by(self.chunks[:, DST], self.chunks[:, LEN], self.num_ranks).astype(np.int64)

    def group_sizes(self) -> np.ndarray:
        """(n,) parallel degree k of each sequence."""
        return np.fromiter((len(b) for b in self.bags), dtype=np.int64, count=len(self.bags))[self.seq_bag]

    @property
    def is_partition(self) -> bool:
        """True when the groups partition the ranks (a bag layout); False for overlapping groups."""
        members = [r for b in self.bags for r in b]
        return len(members) == len(set(members))

    def features(self) -> RankFeatures:
        """Per-rank tokens, attention share and sequence count under this plan."""
        return rank_features(self.index, self.bags, self.seq_bag, self.chunks)

    def stats(self) -> dict[str, float]:
        return {
            "imbalance_before": self.imbalance_before,
            "imbalance_after": self.imbalance_after,
            "makespan": self.makespan,
            "lower_bound": self.lower_bound,
            "gap_to_bound": self.gap_to_bound,
            "tokens_moved": self.tokens_moved,
            "plan_ms": 1e3 * self.plan_seconds,
        }

    def digest(self) -> str:
        """Hash of what the executor depends on (lengths, groups, seq_bag, chunks): equal
        across ranks exactly when they will move the same data."""
        h = hashlib.sha256()
        h.update(json.dumps([self.seq_lens, self.bags]).encode())
        h.update(np.ascontiguousarray(self.seq_bag, dtype=np.int64).tobytes())
        h.update(np.ascontiguousarray(self.chunks, dtype=np.int64).tobytes())
        return h.hexdigest()

    # -- checks ----------------------------------------------------------------------------
    def validate(self) -> None:
        """Check the invariants of the plan form; raise :class:`InvalidPlanError` naming the
        first breach: groups of distinct ranks of the group, every sequence covered exactly
        by contiguous chunks in group order (at most one per member, none on a non-member),
        the memory cap, and no makespan below the lower bound."""
        _check(self)

    def plot(self, path, *, title: str | None = None) -> None:
        """A PNG of the plan (:func:`knapformer.plan.picture.plot_plan`; needs matplotlib)."""
        from knapformer.plan.picture import plot_plan

        plot_plan(self, path, title=title)

    # -- JSON ------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return _plan_to_dict(self)

    def to_json(self) -> str:
        return json.dumps(_plan_to_dict(self))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        """Inverse of :meth:`to_dict` (also reads files that call the times ``work_*``)."""
        return _plan_from_dict(d)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return _plan_from_dict(json.loads(text))


def _fail(message: str) -> None:
    raise InvalidPlanError(message)


def _check(plan: Plan) -> None:
    try:
        lens = validate_seq_lens(plan.seq_lens)
    except ValueError as exc:
        _fail(f"plan.seq_lens: {exc}")
    S = len(lens)
    index = plan.index
    n = index.num_seqs
    if not plan.bags and n:
        _fail("plan has sequences but no groups")
    for i, g in enumerate(plan.bags):
        if len(g) == 0:
            _fail(f"group {i} is empty")
        if len(set(g)) != len(g):
            _fail(f"group {i} {tuple(g)} repeats a rank")
        bad = [r for r in g if not (isinstance(r, (int, np.integer)) and 0 <= r < S)]
        if bad:
            _fail(f"group {i} {tuple(g)} has rank {bad[0]!r} outside the group's {S} ranks")
    sb = np.asarray(plan.seq_bag)
    if sb.shape != (n,):
        _fail(f"seq_bag has shape {sb.shape}, expected ({n},)")
    if n and (sb.min() < 0 or sb.max() >= len(plan.bags)):
        _fail(
            f"seq_bag names group {int(sb.max() if sb.max() >= len(plan.bags) else sb.min())}, "
            f"the plan has {len(plan.bags)}"
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
        sizes, mat = _group_arrays(plan.bags)
        grp = sb[gid]
        member = mat[grp] == ch[:, DST][:, None]
        inside = member.any(axis=1)
        if not inside.all():
            _fail(
                f"{where(~inside)} has a chunk on rank {int(ch[np.flatnonzero(~inside)[0], DST])}, "
                f"not a member of its group {tuple(plan.bags[int(grp[np.flatnonzero(~inside)[0]])])}"
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


def _plan_to_dict(plan: Plan) -> dict[str, Any]:
    return {
        "solver": plan.solver,
        "seq_lens": [list(r) for r in plan.seq_lens],
        "bags": [list(b) for b in plan.bags],
        "seq_bag": plan.seq_bag.tolist(),
        "chunks": plan.chunks.tolist(),
        "time_before": plan.time_before.tolist(),
        "time_after": plan.time_after.tolist(),
        "lower_bound": plan.lower_bound,
        "tokens_moved": plan.tokens_moved,
        "plan_seconds": plan.plan_seconds,
        "max_tokens_per_rank": plan.max_tokens_per_rank,
        "cost_model": plan.cost_model.to_dict() if plan.cost_model is not None else None,
        "stats": plan.stats(),
    }


def _plan_from_dict(d: dict[str, Any]) -> Plan:
    if not isinstance(d, dict):
        raise ValueError(f"a plan must be a JSON object, got {type(d).__name__}")
    # files written before the rename call the times "work_*"
    before = d.get("time_before", d.get("work_before"))
    after = d.get("time_after", d.get("work_after"))
    missing = [k for k, v in (("seq_lens", 1), ("bags", 1), ("seq_bag", 1), ("chunks", 1)) if k not in d]
    if missing or before is None or after is None:
        raise ValueError(f"plan JSON lacks {missing or ['time_before/time_after']}")
    try:
        return Plan(
            seq_lens=tuple(tuple(int(v) for v in r) for r in d["seq_lens"]),
            bags=tuple(tuple(int(v) for v in b) for b in d["bags"]),
            seq_bag=np.asarray(d["seq_bag"], dtype=np.int64).reshape(-1),
            chunks=np.asarray(d["chunks"], dtype=np.int64).reshape(-1, 5),
            time_before=np.asarray(before, dtype=np.float64),
            time_after=np.asarray(after, dtype=np.float64),
            lower_bound=float(d.get("lower_bound", 0.0)),
            tokens_moved=int(d.get("tokens_moved", 0)),
            plan_seconds=float(d.get("plan_seconds", 0.0)),
            solver=str(d.get("solver", "unknown")),
            max_tokens_per_rank=d.get("max_tokens_per_rank"),
            cost_model=WorkloadModel.from_dict(d["cost_model"]) if d.get("cost_model") else None,
        )
    except (TypeError, ValueError) as exc:
        raise ValueError(f"malformed plan JSON: {exc}") from exc


def _imbalance(t: np.ndarray) -> float:
    mean = float(t.mean()) if t.size else 0.0
    return float(t.max()) / mean - 1.0 if mean > 0 else 0.0


def rank_times(problem: PlanProblem, groups, seq_group: np.ndarray, chunks: np.ndarray) -> np.ndarray:
    """(S,) predicted time of each rank under a chunk table: compute / speed, plus the Ulysses
    exchanges priced by the problem's link model (the one cost function of the planner and
    the cluster model)."""
    t = rank_features(problem.index, groups, seq_group, chunks).cost(problem.model) / problem.speed
    if problem.link is not None:
        link = problem.link
        comm = comm_features(problem.index, groups, seq_group, chunks, problem.model, link.gpus_per_node)
        per_layer = ulysses_seconds(comm, link) + route_seconds(comm, link) / problem.model.num_layers
        t = t + per_layer * link.units_per_second
    return t


def build_plan(
    problem: PlanProblem, seq_bag: np.ndarray, *, solver: str, plan_seconds: float = 0.0, groups=None
) -> Plan:
    """Chunk ``seq_bag`` into a full :class:`Plan` and check the memory cap. ``groups``
    defaults to the problem's bags (per-sequence solvers pass the groups they chose)."""
    seq_bag = np.ascontiguousarray(seq_bag, dtype=np.int64)
    groups = problem.bags if groups is None else tuple(tuple(int(r) for r in g) for g in groups)
    chunks = chunk_table(problem.index, groups, seq_bag)
    time_after = rank_times(problem, groups, seq_bag, chunks)
    moved = int(chunks[chunks[:, SRC] != chunks[:, DST], LEN].sum())
    plan = Plan(
        seq_lens=problem.seq_lens,
        bags=groups,
        seq_bag=seq_bag,
        chunks=chunks,
        time_before=problem.time_before,
        time_after=time_after,
        lower_bound=problem.lower_bound,
        tokens_moved=moved,
        plan_seconds=plan_seconds,
        solver=solver,
        max_tokens_per_rank=problem.max_tokens_per_rank,
        cost_model=problem.model,
    )
    plan.__dict__["index"] = problem.index  # share the numbering (fills the cached_property)
    cap = problem.max_tokens_per_rank
    if cap is not None:
        tok = plan.tokens_per_rank()
        worst = int(np.argmax(tok)) if tok.size else 0
        if tok.size and tok[worst] > cap:
            raise ValueError(
                f"solver {solver!r} put {int(tok[worst])} tokens on rank {worst}, over max_tokens_per_rank={cap}"
            )
    return plan


def plan_from_groups(
    seq_lens,
    groups,
    seq_group,
    model: WorkloadModel,
    *,
    rank_speed=None,
    max_tokens_per_rank: int | None = None,
    solver: str = "manual",
) -> Plan:
    """A plan with the groups you choose: sequence ``g`` runs on ``groups[seq_group[g]]``
    (ordered, distinct ranks; groups may overlap). Chunking, costs and the lower bound are the
    planner's own (the bound allows every group size up to the whole group), so the result
    validates and runs with ``SequenceBalancer.use_plan``."""
    S = len(seq_lens)
    layout = f"g1n{S}"
    problem = PlanProblem(
        seq_lens=seq_lens, layout=layout, model=model, rank_speed=rank_speed, max_tokens_per_rank=max_tokens_per_rank
    )
    plan = build_plan(problem, np.asarray(seq_group, dtype=np.int64), solver=solver, groups=groups)
    object.__setattr__(plan, "lower_bound", moldable_lower_bound(problem, range(1, S + 1)))
    return plan
