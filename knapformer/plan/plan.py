"""The ``Plan`` value: where every chunk of every sequence goes, and what that predicts.

A plan gives each sequence a *group*: an ordered tuple of distinct ranks of the balancing
group (``groups[seq_group[g]]``); the sequence is cut into one contiguous chunk per member,
chunk i on member i. In a bag layout the groups are the layout's bags, a partition of the
ranks; in per-sequence plans groups may overlap arbitrarily (a rank runs some sequences alone
and chunks of others with different partners). A solver only decides ``seq_group``;
:func:`chunk_table` turns that into the chunk table the executor follows, so every solver cuts
sequences the same way:

- a sequence of length L in a group of k ranks is cut into k contiguous chunks of ⌊L/k⌋
  tokens; the ``L mod k`` leftover tokens go one each to chunk positions ``offset, offset+1,
  ...`` (mod k), and the group's ``offset`` advances by ``L mod k`` after each sequence
  (global id order). Token counts of a bag's ranks therefore differ by at most one.
- chunk position i lives on the group's i-th rank; positions with zero tokens get no row.
- a ring group (k = u·r members as r sub-groups of u, ``Plan.ring``) cuts each sequence into
  2k positions instead — 2r half-blocks of u chunks — and gives sub-group s half-blocks s and
  2r − 1 − s (*zigzag*, :func:`zigzag_slots`): under causal masking every sub-group then
  attends to the same number of key tokens (a contiguous cut makes the last do (2r − 1)/r of
  the mean), and without masking the order costs nothing. Each member holds two chunks.

Chunk table rows: ``[src_rank, seq_index, start, length, dst_rank]`` sorted by
``(src_rank, seq_index, start)``.

Cost of a rank (:func:`rank_features`): the linear cost of the tokens it holds, plus for every
sequence whose group it is in, 1/k of the sequence's attention and the per-sequence cost
(Ulysses gives each member all L tokens for h/k heads; a member holding zero tokens of a short
sequence still runs its heads).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from knapformer.cost_terms import COST_TERMS, coefficients
from knapformer.plan.chunks import chunk_table, slot_arrays, zigzag_slots
from knapformer.plan.cost import LinkModel, comm_features, jitter_factor, ring_seconds, route_seconds, ulysses_seconds
from knapformer.plan.memory import gathered_memory
from knapformer.plan.problem import PlanProblem, moldable_lower_bound
from knapformer.plan.seqindex import (
    DST,
    IDX,
    LEN,
    SRC,
    SeqIndex,
    group_arrays,
    largest_group,
    spread_over_groups,
    sum_by,
)
from knapformer.plan.sync import sync_sets, synced_times
from knapformer.plan.validate import InvalidPlanError, check_plan
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
    "slot_arrays",
    "spread_over_groups",
    "zigzag_slots",
]


@dataclass(frozen=True)
class RankFeatures:
    """What a rank's predicted time is made of, per rank (S,): the cost model prices these.
    One field per term of :data:`~knapformer.cost_terms.COST_TERMS` (same names)."""

    tokens: np.ndarray
    """Tokens the rank holds after routing (linear work)."""
    attn: np.ndarray
    """Σ L²/k over the sequences of its groups (its share of the attention work)."""
    seqs: np.ndarray
    """Sequences whose group it is in (per-sequence cost)."""

    def matrix(self) -> np.ndarray:
        """(S, terms) the features in :data:`~knapformer.cost_terms.COST_TERMS` order."""
        return np.stack([np.asarray(getattr(self, t.name), dtype=np.float64) for t in COST_TERMS], axis=1)

    def cost(self, model: WorkloadModel) -> np.ndarray:
        """(S,) predicted work under ``model`` (same units as ``model.cost``)."""
        return self.matrix() @ coefficients(model)


def rank_features(
    index: SeqIndex, groups, seq_group: np.ndarray, chunks: np.ndarray, ring=None, causal: bool = False
) -> RankFeatures:
    """Per-rank features of a chunk table (see module docstring). A ring group's members share
    the attention evenly too (each attends its block's L/r queries to all L keys for h/u
    heads), under ``causal`` masking as well: the zigzag cut gives every sub-group the same
    causal work (``causal`` and ``ring`` are kept for callers; they change nothing)."""
    S = index.num_ranks
    sizes = group_arrays(groups)[0].astype(np.float64)
    L = index.lengths.astype(np.float64)
    attn = spread_over_groups(groups, seq_group, L * L / sizes[seq_group], S)
    return RankFeatures(
        tokens=sum_by(chunks[:, DST], chunks[:, LEN], S),
        attn=attn,
        seqs=spread_over_groups(groups, seq_group, np.ones_like(L), S),
    )


@dataclass(frozen=True, eq=False)
class Plan:
    """One step's plan for one balancing group. Frozen; build with :func:`build_plan`."""

    seq_lens: tuple[tuple[int, ...], ...]
    """Input lengths per rank."""
    groups: tuple[tuple[int, ...], ...]
    """The groups sequences run on: ordered tuples of distinct group ranks (chunk position j of
    group i lives on ``groups[i][j]``). A bag layout's bags partition the ranks; per-sequence
    plans may use overlapping groups of any sizes."""
    seq_group: np.ndarray
    """(n,) group (index into ``groups``) of each sequence, global rank-major order."""
    chunks: np.ndarray
    """(m, 5) rows ``[src_rank, seq_index, start, length, dst_rank]``."""
    time_before: np.ndarray
    """(S,) predicted per-rank time without balancing."""
    time_after: np.ndarray
    """(S,) predicted per-rank busy time with this plan (its own work and exchanges)."""
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
    ring: tuple[int, ...] | None = None
    """Per group: the ring sub-groups r it runs as — Ulysses over the k/r members of each
    sub-group (consecutive members), ring attention across the r sub-groups. None: 1 for every
    group (Ulysses alone)."""
    kv_gather: bool = False
    """Made for the ``pre_attn`` path (``attn_path="pre_attn"``): its ring groups all-gather
    keys and values for one kernel call, priced so in ``time_after`` and counted in
    :meth:`memory_per_rank` (not part of the digest: the data a step moves is the same)."""
    link: LinkModel | None = None
    """The links the exchanges in ``time_after`` were priced with (None: free); its
    ``units_per_second`` turns the times into seconds for pictures (not part of the digest)."""
    step_after: np.ndarray | None = None
    """(S,) predicted time each rank finishes the step: its busy time plus what it waits at its
    exchanges for the slowest rank of its synchronised set (:mod:`knapformer.plan.sync`);
    None: not priced (``time_after`` stands for it). ``makespan`` is its maximum."""

    # -- derived ---------------------------------------------------------------------------
    @property
    def bags(self) -> tuple[tuple[int, ...], ...]:
        """Old name of :attr:`groups` (kept for code written before the rename)."""
        return self.groups

    @property
    def seq_bag(self) -> np.ndarray:
        """Old name of :attr:`seq_group`."""
        return self.seq_group

    @property
    def rings(self) -> tuple[int, ...]:
        """:attr:`ring` with its default filled in: one entry per group."""
        return self.ring if self.ring is not None else (1,) * len(self.groups)

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
        """The predicted step: the latest rank's finish (its waits at exchanges included)."""
        t = self.time_after if self.step_after is None else self.step_after
        return float(t.max()) if t.size else 0.0

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

    def memory_per_rank(self) -> np.ndarray:
        """(S,) what each rank holds in the unit ``max_tokens_per_rank`` caps: routed tokens,
        plus on a plan for the ``pre_attn`` path its rings' gathered K/V as tokens
        (:mod:`knapformer.plan.memory`; the cost model's heads and causal flag)."""
        if not self.kv_gather or self.ring is None:
            return self.tokens_per_rank()
        m = self.cost_model
        h, h_kv = (m.num_heads, m.num_kv_heads) if m is not None else (None, None)
        return gathered_memory(self, h, h_kv, bool(m is not None and m.causal))

    def group_sizes(self) -> np.ndarray:
        """(n,) parallel degree k of each sequence."""
        return np.fromiter((len(b) for b in self.groups), dtype=np.int64, count=len(self.groups))[self.seq_group]

    @property
    def is_partition(self) -> bool:
        """True when the groups partition the ranks (a bag layout); False for overlapping groups."""
        members = [r for b in self.groups for r in b]
        return len(members) == len(set(members))

    def features(self) -> RankFeatures:
        """Per-rank tokens, attention share and sequence count under this plan (a causal cost
        model's ring groups share their attention unevenly)."""
        causal = bool(self.cost_model is not None and self.cost_model.causal)
        return rank_features(self.index, self.groups, self.seq_group, self.chunks, self.ring, causal)

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
        """Hash of what the executor depends on (lengths, groups, seq_group, chunks): equal
        across ranks exactly when they will move the same data."""
        if "_digest" in self.__dict__:  # (a plan is immutable: computed once, e.g. in the worker that made it)
            return self.__dict__["_digest"]
        h = hashlib.sha256()
        h.update(json.dumps([self.seq_lens, self.groups] + ([list(self.rings)] if self.ring else [])).encode())
        h.update(np.ascontiguousarray(self.seq_group, dtype=np.int64).tobytes())
        h.update(np.ascontiguousarray(self.chunks, dtype=np.int64).tobytes())
        self.__dict__["_digest"] = h.hexdigest()
        return self.__dict__["_digest"]

    # -- checks ----------------------------------------------------------------------------
    def validate(self) -> None:
        """Check the invariants of the plan form; raise :class:`InvalidPlanError` naming the
        first breach: groups of distinct ranks of the group, every sequence covered exactly
        by contiguous chunks in group order (at most one per member, none on a non-member),
        the memory cap, and no makespan below the lower bound."""
        check_plan(self)

    def plot(self, path, *, title: str | None = None, ranks_per_band: int | None = None) -> None:
        """A PNG of the plan, per rank or in bands of ranks at scale
        (:func:`knapformer.plan.picture.plot_plan`; needs matplotlib)."""
        from knapformer.plan.picture import plot_plan

        plot_plan(self, path, title=title, ranks_per_band=ranks_per_band)

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


def _plan_to_dict(plan: Plan) -> dict[str, Any]:
    return {
        "solver": plan.solver,
        "seq_lens": [list(r) for r in plan.seq_lens],
        "groups": [list(b) for b in plan.groups],
        "seq_group": plan.seq_group.tolist(),
        "chunks": plan.chunks.tolist(),
        "time_before": plan.time_before.tolist(),
        "time_after": plan.time_after.tolist(),
        "step_after": plan.step_after.tolist() if plan.step_after is not None else None,
        "lower_bound": plan.lower_bound,
        "tokens_moved": plan.tokens_moved,
        "plan_seconds": plan.plan_seconds,
        "max_tokens_per_rank": plan.max_tokens_per_rank,
        "cost_model": plan.cost_model.to_dict() if plan.cost_model is not None else None,
        "ring": list(plan.ring) if plan.ring is not None else None,
        "kv_gather": plan.kv_gather,
        "link": dataclasses.asdict(plan.link) if plan.link is not None else None,
        "stats": plan.stats(),
    }


def _plan_from_dict(d: dict[str, Any]) -> Plan:
    if not isinstance(d, dict):
        raise ValueError(f"a plan must be a JSON object, got {type(d).__name__}")
    # files written before the renames call the times "work_*" and the groups "bags"/"seq_bag"
    before = d.get("time_before", d.get("work_before"))
    after = d.get("time_after", d.get("work_after"))
    d = {"groups": d.get("bags"), "seq_group": d.get("seq_bag"), **{k: v for k, v in d.items() if v is not None}}
    missing = [k for k in ("seq_lens", "groups", "seq_group", "chunks") if d.get(k) is None]
    if missing or before is None or after is None:
        raise ValueError(f"plan JSON lacks {missing or ['time_before/time_after']}")
    try:
        return Plan(
            seq_lens=tuple(tuple(int(v) for v in r) for r in d["seq_lens"]),
            groups=tuple(tuple(int(v) for v in b) for b in d["groups"]),
            seq_group=np.asarray(d["seq_group"], dtype=np.int64).reshape(-1),
            chunks=np.asarray(d["chunks"], dtype=np.int64).reshape(-1, 5),
            time_before=np.asarray(before, dtype=np.float64),
            time_after=np.asarray(after, dtype=np.float64),
            lower_bound=float(d.get("lower_bound", 0.0)),
            tokens_moved=int(d.get("tokens_moved", 0)),
            plan_seconds=float(d.get("plan_seconds", 0.0)),
            solver=str(d.get("solver", "unknown")),
            max_tokens_per_rank=d.get("max_tokens_per_rank"),
            cost_model=WorkloadModel.from_dict(d["cost_model"]) if d.get("cost_model") else None,
            ring=tuple(int(r) for r in d["ring"]) if d.get("ring") is not None else None,
            kv_gather=d.get("kv_gather", False) is True or _not_a_flag(d.get("kv_gather", False)),
            link=LinkModel(**d["link"]) if d.get("link") is not None else None,
            step_after=np.asarray(d["step_after"], dtype=np.float64) if d.get("step_after") is not None else None,
        )
    except (TypeError, ValueError) as exc:
        raise ValueError(f"malformed plan JSON: {exc}") from exc


def _not_a_flag(v) -> bool:
    if v is not False:
        raise ValueError(f"kv_gather must be true or false, got {v!r}")
    return False


def _imbalance(t: np.ndarray) -> float:
    mean = float(t.mean()) if t.size else 0.0
    return float(t.max()) / mean - 1.0 if mean > 0 else 0.0


def rank_segments(
    problem: PlanProblem, groups, seq_group: np.ndarray, chunks: np.ndarray, ring=None
) -> tuple[list[np.ndarray], np.ndarray]:
    """Each rank's predicted time per layer under a chunk table, by the segments its exchanges
    cut a layer into (:mod:`knapformer.plan.sync`): ([linear work, attention with the ring's
    exposed exchanges, the Ulysses exchanges], route and reverse per layer) — compute / speed,
    exchanges priced by the problem's link model (the one cost function of the planner and the
    cluster model). Their sum is the rank's busy time."""
    model = problem.model
    f = rank_features(problem.index, groups, seq_group, chunks, ring, model.causal)
    coef = dict(zip((t.name for t in COST_TERMS), coefficients(model)))
    attn = f.attn * coef["attn"] / problem.speed
    linear = f.cost(model) / problem.speed - attn
    S = problem.num_ranks
    uly, route = np.zeros(S), np.zeros(S)
    if problem.link is not None:
        link = problem.link
        if link.sync_jitter and seq_group.size:  # members wait for the slowest of their largest group
            jitter = 1.0 + link.sync_jitter * jitter_factor(largest_group(groups, seq_group, problem.num_ranks))
            linear, attn = linear * jitter, attn * jitter
        comm = comm_features(problem.index, groups, seq_group, chunks, model, link.gpus_per_node, ring)
        ups = link.units_per_second
        uly = ulysses_seconds(comm, link) * ups
        route = route_seconds(comm, link) / model.num_layers * ups
        attn = attn + ring_seconds(comm, link, model, problem.speed, gather=problem.kv_gather) * ups
    return [linear, attn, uly], route


def rank_times(problem: PlanProblem, groups, seq_group: np.ndarray, chunks: np.ndarray, ring=None) -> np.ndarray:
    """(S,) predicted busy time of each rank under a chunk table: compute / speed, plus the
    Ulysses, ring and route exchanges (:func:`rank_segments` summed)."""
    segments, route = rank_segments(problem, groups, seq_group, chunks, ring)
    return sum(segments) + route


def step_times(problem: PlanProblem, groups, seq_group: np.ndarray, chunks: np.ndarray, ring=None):
    """((S,) busy time, (S,) finish time) of each rank: the finish time adds what it waits at
    its exchanges for the slowest rank of its synchronised set (:mod:`knapformer.plan.sync`)."""
    segments, route = rank_segments(problem, groups, seq_group, chunks, ring)
    sets = sync_sets(groups, seq_group, problem.num_ranks)
    return sum(segments) + route, synced_times(sets, segments, route)


def build_plan(
    problem: PlanProblem, seq_group: np.ndarray, *, solver: str, plan_seconds: float = 0.0, groups=None, ring=None
) -> Plan:
    """Chunk ``seq_group`` into a full :class:`Plan` and check the memory cap. ``groups``
    defaults to the problem's bags (per-sequence solvers pass the groups they chose); ``ring``
    (per group) to the problem's choice for each group size (:meth:`PlanProblem.ring_of`)."""
    seq_group = np.ascontiguousarray(seq_group, dtype=np.int64)
    groups = problem.bags if groups is None else tuple(tuple(int(r) for r in g) for g in groups)
    if ring is None:
        of_size = {k: problem.ring_of(k) for k in {len(g) for g in groups}}
        ring = tuple(of_size[len(g)] for g in groups)
    ring = tuple(int(r) for r in ring) if any(r != 1 for r in ring) else None
    chunks = chunk_table(problem.index, groups, seq_group, ring)
    time_after, step_after = step_times(problem, groups, seq_group, chunks, ring)
    moved = int(chunks[chunks[:, SRC] != chunks[:, DST], LEN].sum())
    plan = Plan(
        seq_lens=problem.seq_lens,
        groups=groups,
        seq_group=seq_group,
        chunks=chunks,
        time_before=problem.time_before,
        time_after=time_after,
        step_after=step_after,
        lower_bound=problem.lower_bound,
        tokens_moved=moved,
        plan_seconds=plan_seconds,
        solver=solver,
        max_tokens_per_rank=problem.max_tokens_per_rank,
        cost_model=problem.model,
        ring=ring,
        kv_gather=problem.kv_gather,
        link=problem.link,
    )
    plan.__dict__["index"] = problem.index  # share the numbering (fills the cached_property)
    cap = problem.max_tokens_per_rank
    if cap is not None:
        tok = plan.memory_per_rank()
        worst = int(np.argmax(tok)) if tok.size else 0
        if tok.size and tok[worst] > cap:
            routed = tok[worst] == plan.tokens_per_rank()[worst]
            what = "tokens" if routed else "token-equivalents (gathered K/V included)"
            raise ValueError(
                f"solver {solver!r} put {int(tok[worst])} {what} on rank {worst}, over max_tokens_per_rank={cap}"
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
    ring=None,
    kv_gather: bool = False,
) -> Plan:
    """A plan with the groups you choose: sequence ``g`` runs on ``groups[seq_group[g]]``
    (ordered, distinct ranks; groups may overlap). Chunking, costs and the lower bound are the
    planner's own (the bound allows every group size up to the whole group), so the result
    validates and runs with ``SequenceBalancer.use_plan``. ``ring`` (per group, dividing its
    size) runs a group as that many ring sub-groups; by default a group runs as a ring only
    when the model's heads cannot split it (:meth:`PlanProblem.ring_of`). ``kv_gather``: made
    for the ``pre_attn`` path (see :attr:`Plan.kv_gather`)."""
    S = len(seq_lens)
    layout = f"g1n{S}"
    problem = PlanProblem(
        seq_lens=seq_lens,
        layout=layout,
        model=model,
        rank_speed=rank_speed,
        max_tokens_per_rank=max_tokens_per_rank,
        kv_gather=kv_gather,
    )
    plan = build_plan(problem, np.asarray(seq_group, dtype=np.int64), solver=solver, groups=groups, ring=ring)
    object.__setattr__(plan, "lower_bound", moldable_lower_bound(problem, range(1, S + 1)))
    return plan
