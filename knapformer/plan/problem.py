"""The planning problem: one step's sequence lengths, the bags, the cost model, the limits.

A ``PlanProblem`` is validated once at the boundary (bad user input raises ``ValueError``
naming the culprit) and then exposes flat numpy arrays every solver shares. Sequences are
numbered globally in rank-major order (:class:`~knapformer.plan.seqindex.SeqIndex`): sequence
``g`` is ``(src_rank[g], seq_index[g])``.

Legend: ``n`` sequences, ``B`` bags, ``S`` ranks in the group.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from knapformer.layout import AutoLayout, BagLayout, parse_layout
from knapformer.plan.bound import moldable_lower_bound, moldable_lower_bounds
from knapformer.plan.cost import LinkModel
from knapformer.plan.memory import gather_extra_estimate, gather_share
from knapformer.plan.seqindex import SeqIndex, spread_over_groups, stable_order, sum_by
from knapformer.workload import WorkloadModel

__all__ = [
    "MAX_SEQ_LEN",
    "MAX_TOTAL_TOKENS",
    "PlanProblem",
    "SolverOptions",
    "UNALIGNED_UP_TO",
    "moldable_lower_bound",
    "spread_over_groups",
    "sum_by",
    "ulysses_size",
    "validate_lengths",
    "validate_seq_lens",
]

MAX_SEQ_LEN = 2**31 - 1
"""Longest sequence accepted: attention kernels index tokens with int32 ``cu_seqlens``."""
MAX_TOTAL_TOKENS = 2**53
"""Most tokens one group may hold in a step: costs are float64, exact for integers below this."""
UNALIGNED_UP_TO = 8
"""``auto`` also uses group sizes that do not divide the group up to this many ranks (and no
link model): small odd groups have few dividing sizes, large ones enough aligned blocks."""


def _is_int(v: object) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def validate_seq_lens(
    seq_lens: object, num_ranks: int | None = None, *, name: str = "seq_lens"
) -> tuple[tuple[int, ...], ...]:
    """Check ``[[len, ...] per rank]`` and return it as tuples of ints; errors name the entry
    (as ``name[r][i]``). Lengths are positive ints (never bools) of at most :data:`MAX_SEQ_LEN`
    tokens, and all of them together at most :data:`MAX_TOTAL_TOKENS`."""
    if isinstance(seq_lens, ValidLens):
        if num_ranks is not None and len(seq_lens) != num_ranks:
            raise ValueError(f"{name} has {len(seq_lens)} ranks but the bag layout's group has {num_ranks}")
        return seq_lens
    if not isinstance(seq_lens, Sequence) or isinstance(seq_lens, (str, bytes)):
        raise ValueError(f"{name} must be a list of per-rank lists, got {type(seq_lens).__name__}")
    fast = _clean(seq_lens, num_ranks)
    if fast is not None:
        return fast
    out = []
    total = 0
    for r, lens in enumerate(seq_lens):
        row = validate_lengths(lens, f"{name}[{r}]")
        total += sum(row)
        out.append(row)
    if total > MAX_TOTAL_TOKENS:
        raise ValueError(f"{name} holds {total} tokens in all, more than the {MAX_TOTAL_TOKENS} one group can plan")
    if num_ranks is not None and len(out) != num_ranks:
        raise ValueError(f"{name} has {len(out)} ranks but the bag layout's group has {num_ranks}")
    return ValidLens(out)


def _clean(seq_lens: Sequence, num_ranks: int | None) -> ValidLens | None:
    """The common case checked in one pass over all lengths (a per-rank check costs ~5 µs a rank:
    20 ms at 4,096 ranks): lists or tuples of plain ints in range. None: check rank by rank
    (which names the culprit)."""
    if num_ranks is not None and len(seq_lens) != num_ranks:
        return None
    if not all(type(r) in (list, tuple) for r in seq_lens):
        return None
    rows = [tuple(r) for r in seq_lens]
    flat = tuple(itertools.chain.from_iterable(rows))
    if flat and not (set(map(type, flat)) == {int} and 0 < min(flat) and max(flat) <= MAX_SEQ_LEN):
        return None
    if sum(flat) > MAX_TOTAL_TOKENS:
        return None
    return ValidLens(rows)


class ValidLens(tuple):
    """Per-rank lengths that :func:`validate_seq_lens` accepted (a tuple of tuples of ints);
    passing one on validates nothing twice."""


def validate_lengths(lens: object, name: str = "lengths") -> tuple[int, ...]:
    """One rank's lengths as a tuple of ints; errors name the entry as ``name[i]``."""
    if isinstance(lens, np.ndarray):
        if lens.ndim != 1:
            raise ValueError(f"{name} must be a 1-D list of lengths, got an array of shape {lens.shape}")
        if lens.dtype.kind not in "iu" and lens.size:
            raise ValueError(f"{name} has dtype {lens.dtype}; lengths must be integers")
        lens = lens.tolist()
    if not isinstance(lens, Sequence) or isinstance(lens, (str, bytes)):
        raise ValueError(f"{name} must be a list of lengths, got {type(lens).__name__}")
    row = tuple(lens)
    # fast path: clean Python ints (type checks in C via map), range checked once per row
    if row and not (set(map(type, row)) == {int} and 0 < min(row) and max(row) <= MAX_SEQ_LEN):
        row = tuple(_checked_length(v, f"{name}[{i}]") for i, v in enumerate(row))
    return row


def _checked_length(v: object, where: str) -> int:
    if not _is_int(v):
        raise ValueError(f"{where} = {v!r} is not an integer")
    if v <= 0:
        raise ValueError(f"{where} = {v} must be a positive length")
    if v > MAX_SEQ_LEN:
        raise ValueError(f"{where} = {v} is longer than the {MAX_SEQ_LEN} tokens a sequence may have")
    return int(v)


@dataclass(frozen=True, kw_only=True)
class SolverOptions:
    """Typed knobs of the solvers (each solver reads the ones it knows; defaults are tuned)."""

    max_iters: int | None = None
    """Local-search iterations per start; None = the solver's default (grows with the bags)."""
    stop_gap: float | None = None
    """Stop improving once makespan ≤ lower bound × (1 + stop_gap); None = the solver's default."""
    tie_tolerance: float = 1e-4
    """Plans within this relative makespan count as tied; the one moving fewer tokens wins."""
    bnb_nodes: int = 20_000
    """Node budget of the branch and bound on small inputs (a count, not a clock: all ranks agree)."""
    peak_tolerance: float | None = 0.005
    """Layout ``auto`` without ``max_tokens_per_rank`` (a cap set takes its place): among plans
    within this relative makespan of the fastest, the one holding the fewest tokens on its
    busiest rank wins, and no plan holds more than the most tokens any rank loaded or than the
    fastest fixed-layout plan considered holds (whichever is more; ``plan/solvers/moldable.py``),
    so that balancing does not buy speed with activation memory. None = time only (before 0.3.0:
    the busiest rank could hold 2× the mean tokens where static Ulysses held 1.2×)."""

    def __post_init__(self) -> None:
        for name in ("max_iters", "bnb_nodes"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v < 0):
                raise ValueError(f"SolverOptions.{name} must be an int >= 0, got {v!r}")
        for name in ("stop_gap", "tie_tolerance", "peak_tolerance"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"SolverOptions.{name} must be a finite number >= 0, got {v!r}")


@dataclass(frozen=True, eq=False)
class PlanProblem:
    """Everything a solver needs; immutable, validated in ``__post_init__``."""

    seq_lens: tuple[tuple[int, ...], ...]
    """Lengths of the sequences on each rank of the group (ranks may be empty)."""
    layout: BagLayout | AutoLayout
    """Bag layout of the group, or ``auto`` (the moldable solver picks each sequence's group)."""
    model: WorkloadModel
    """Cost model."""
    max_tokens_per_rank: int | None = None
    """Memory cap: no rank may hold more routed tokens. None = unlimited."""
    rank_speed: tuple[float, ...] | None = None
    """Relative throughput per rank (work/speed = time). None = all 1.0."""
    options: SolverOptions = field(default_factory=SolverOptions)
    """Solver knobs (iteration counts, tie tolerance)."""
    link: LinkModel | None = None
    """Links between the ranks: prices Ulysses exchanges in the plan's times (None = free)."""
    kv_gather: bool = False
    """Ring groups run on the ``pre_attn`` path (one custom kernel call after a K/V all-gather
    over the ring, :mod:`knapformer.distributed.kv_gather`): priced so, and the gathered keys
    and values counted against ``max_tokens_per_rank`` (:mod:`knapformer.plan.memory`).
    False: ring rounds (``bal.attention``)."""

    def __post_init__(self) -> None:
        layout = parse_layout(self.layout)
        if isinstance(layout, AutoLayout) and isinstance(self.seq_lens, Sequence):
            layout = layout.resolved(len(self.seq_lens))
        object.__setattr__(self, "layout", layout)
        object.__setattr__(self, "seq_lens", validate_seq_lens(self.seq_lens, layout.group_size))
        if self.link is not None and not isinstance(self.link, LinkModel):
            raise TypeError(f"link must be a LinkModel, got {type(self.link).__name__}")
        if not isinstance(self.model, WorkloadModel):
            raise TypeError(f"model must be a WorkloadModel, got {type(self.model).__name__}")
        if not isinstance(self.options, SolverOptions):
            raise TypeError(f"options must be SolverOptions, got {type(self.options).__name__}")
        cap = self.max_tokens_per_rank
        if cap is not None and (not _is_int(cap) or cap <= 0):
            raise ValueError(f"max_tokens_per_rank must be a positive int, got {cap!r}")
        if self.rank_speed is not None:
            object.__setattr__(self, "rank_speed", validate_rank_speed(self.rank_speed, layout.group_size))
        if not isinstance(self.kv_gather, bool):
            raise TypeError(f"kv_gather must be a bool, got {self.kv_gather!r}")

    # -- sequences ------------------------------------------------------------------------
    @property
    def num_ranks(self) -> int:
        return self.layout.group_size

    @cached_property
    def index(self) -> SeqIndex:
        """Global sequence numbering (shared with the plan built from this problem)."""
        return SeqIndex(self.seq_lens)

    @property
    def lengths(self) -> np.ndarray:
        """(n,) int64 lengths in global (rank-major) order."""
        return self.index.lengths

    @property
    def src_rank(self) -> np.ndarray:
        """(n,) source rank of each sequence."""
        return self.index.src_rank

    @property
    def seq_index(self) -> np.ndarray:
        """(n,) index of each sequence on its source rank."""
        return self.index.seq_index

    @cached_property
    def work(self) -> np.ndarray:
        """(n,) float64 cost of each whole sequence."""
        return np.asarray(self.model.cost(self.lengths), dtype=np.float64)

    @cached_property
    def by_work(self) -> np.ndarray:
        """(n,) sequence ids by decreasing work, ties by id (the order every LPT pass uses;
        sorted once per problem however many candidates a solver builds)."""
        # work strictly grows with length (WorkloadModel: coefficients >= 0, not both 0), so
        # longest first by a radix sort of the lengths (4x faster than sorting the floats)
        L = self.lengths
        return stable_order(int(L.max()) - L) if L.size else np.zeros(0, dtype=np.int64)

    @property
    def num_seqs(self) -> int:
        return self.index.num_seqs

    @cached_property
    def speed(self) -> np.ndarray:
        """(S,) rank speeds."""
        if self.rank_speed is None:
            return np.ones(self.num_ranks)
        return np.asarray(self.rank_speed, dtype=np.float64)

    @property
    def auto(self) -> bool:
        """The planner chooses every sequence's group (layout ``auto``)."""
        return isinstance(self.layout, AutoLayout)

    @cached_property
    def bags(self) -> tuple[tuple[int, ...], ...]:
        """The layout's bags; for ``auto`` every rank alone (what degree-1 placement uses)."""
        if self.auto:
            return tuple((r,) for r in range(self.num_ranks))
        return self.layout.bags

    @cached_property
    def bag_size(self) -> np.ndarray:
        """(B,) ranks per bag."""
        if self.auto:
            return np.ones(self.num_ranks, dtype=np.int64)
        return np.fromiter((len(b) for b in self.bags), dtype=np.int64, count=len(self.bags))

    @cached_property
    def degrees(self) -> tuple[int, ...]:
        """Group sizes a sequence may run on: the bag sizes, or for ``auto`` every k that
        respects ``max_degree`` and either divides the group (aligned blocks) and stays inside
        a node or spans whole ones (with a link model), or — in groups of up to
        :data:`UNALIGNED_UP_TO` ranks without a link model — does not divide it (then any k
        consecutive ranks): 3 ranks with 8 heads may still split a long sequence in 2. A k
        the heads cannot split (k | h, and k | h_kv or h_kv | k) runs as a ring of Ulysses
        sub-groups (:meth:`ring_of`); with ``AutoLayout(ring=False)`` such k are left out.
        Without a head count: powers of two, as rings of sub-groups of at most 8 beyond 8.
        With a link model a group beyond a node may take any number of whole nodes, dividing
        the group or not (176 = 22 nodes of 8 on 1,024 ranks): the planner places such a
        group on consecutive whole nodes."""
        if not self.auto:
            return tuple(sorted({len(b) for b in self.bags}))
        S, kmax = self.num_ranks, self.layout.max_degree or self.num_ranks
        h, h_kv = self.model.num_heads, self.model.num_kv_heads or self.model.num_heads
        ring = self.layout.ring
        gpn = self.link.gpus_per_node if self.link is not None else None
        out = []
        for k in range(1, min(S, kmax) + 1):
            if gpn is not None:  # inside a node: k divides it (and the group); beyond: whole nodes
                if (k <= gpn and (gpn % k or S % k)) or (k > gpn and k % gpn):
                    continue
            elif S % k and S > UNALIGNED_UP_TO:
                continue
            if h is None and (k & (k - 1) or (k > 8 and not ring)):
                continue
            if h is not None and not ring and (h % k or (h_kv % k and k % h_kv)):
                continue
            out.append(k)
        return tuple(out)

    def gather_need(self, L, k) -> np.ndarray:
        """Token-equivalents a member of a k-group holds for a sequence of L tokens beyond its
        ⌈L/k⌉ routed ones: on the ``pre_attn`` path (:attr:`kv_gather`) a ring group's
        gathered keys and values (an upper bound, :func:`~knapformer.plan.memory.gather_extra_estimate`),
        else nothing. Arrays broadcast (``k`` an int)."""
        L = np.asarray(L, dtype=np.float64)
        r = self.ring_of(int(k))
        if not self.kv_gather or r == 1:
            return np.zeros(L.shape, dtype=np.int64)
        m = self.model
        share = gather_share(int(k) // r, m.num_heads, m.num_kv_heads)
        return np.ceil(share * gather_extra_estimate(L, r, m.causal)).astype(np.int64)

    def ring_of(self, k: int) -> int:
        """How many ring sub-groups a k-rank group of this problem runs as: 1 (Ulysses over all
        k) whenever the heads allow it — and for a bag layout whose model names no heads (the
        executor checks them) — else k over the largest Ulysses size :func:`ulysses_size`
        allows."""
        if self.model.num_heads is None and not self.auto:
            return 1
        return k // _ulysses_size(k, self.model.num_heads, self.model.num_kv_heads)

    @cached_property
    def bag_capacity(self) -> np.ndarray:
        """(B,) work a bag completes per unit time: size × slowest member's speed
        (Ulysses splits a sequence evenly, so the slowest rank sets the bag's pace)."""
        if self.auto:  # every rank alone
            return self.speed.copy()
        return np.asarray([len(b) * self.speed[list(b)].min() for b in self.bags])

    @cached_property
    def bag_classes(self) -> tuple[tuple[int, float, tuple[int, ...]], ...]:
        """Interchangeable bags for the fluid objective: ``(size, capacity, bag ids)``, sorted
        by size then capacity. The one place bags are grouped (solvers, heaps, search)."""
        if self.auto:  # every rank alone: one class per distinct speed
            speeds, inv = np.unique(self.speed, return_inverse=True)
            return tuple((1, float(v), tuple(np.flatnonzero(inv == i).tolist())) for i, v in enumerate(speeds))
        classes: dict[tuple[int, float], list[int]] = {}
        for b in range(len(self.bags)):
            classes.setdefault((int(self.bag_size[b]), float(self.bag_capacity[b])), []).append(b)
        return tuple((k, c, tuple(ids)) for (k, c), ids in sorted(classes.items()))

    @cached_property
    def bag_class(self) -> tuple[np.ndarray, int]:
        """(B,) class id of each bag (index into :attr:`bag_classes`) and the number of classes."""
        out = np.empty(len(self.bags), dtype=np.int64)
        for c, (_, _, ids) in enumerate(self.bag_classes):
            out[list(ids)] = c
        return out, len(self.bag_classes)

    @cached_property
    def bag_of_rank(self) -> np.ndarray:
        """(S,) bag index of each rank."""
        out = np.empty(self.num_ranks, dtype=np.int64)
        for b, ranks in enumerate(self.bags):
            out[list(ranks)] = b
        return out

    @cached_property
    def time_before(self) -> np.ndarray:
        """(S,) per-rank time when every rank processes its own sequences alone."""
        return sum_by(self.src_rank, self.work, self.num_ranks) / self.speed

    @cached_property
    def lower_bound(self) -> float:
        """A makespan no plan can beat: for bag layouts the max of the fluid bound (total work
        over total speed) and, per sequence, its cheapest placement's busiest chunk; for
        ``auto`` the allotment bound over every allowed group size, with the least
        communication each size pays (:func:`~knapformer.plan.bound.moldable_lower_bound`)."""
        if self.num_seqs == 0:
            return 0.0
        if self.auto:
            return self._bounds[0]
        fluid = float(self.work.sum() / self.speed.sum())
        best = np.full(self.num_seqs, np.inf)
        options = sorted({(len(r), float(self.speed[list(r)].max())) for r in self.bags})
        for k, fastest in options:
            largest_chunk = -(-self.lengths // k)
            t = self.model.chunk_cost(largest_chunk, self.lengths, k) / fastest
            np.minimum(best, t, out=best)
        return max(fluid, float(best.max()))

    @cached_property
    def steady_bound(self) -> float:
        """:attr:`lower_bound` without the sync jitter: ``auto``'s degree targets (aimed at the
        higher bound, giant-mix video steps planned up to 1.7% slower)."""
        return self._bounds[1] if self.auto and self.num_seqs else self.lower_bound

    _bounds = cached_property(lambda self: moldable_lower_bounds(self, self.degrees))

    def check_capacity(self) -> None:
        """Fail fast when no plan can satisfy the memory cap (necessary conditions)."""
        if (cap := self.max_tokens_per_rank) is None or self.num_seqs == 0:
            return
        total = int(self.lengths.sum())
        if total > cap * self.num_ranks:
            raise ValueError(
                f"max_tokens_per_rank={cap} is infeasible: {total} tokens over {self.num_ranks} ranks "
                f"need at least {-(-total // self.num_ranks)} per rank"
            )
        kmax = max(self.degrees)
        g = int(np.argmax(self.lengths))
        if -(-int(self.lengths[g]) // kmax) > cap:
            raise ValueError(
                f"sequence {int(self.seq_index[g])} on rank {int(self.src_rank[g])} has "
                f"{int(self.lengths[g])} tokens: even the largest bag ({kmax} ranks) puts more than "
                f"max_tokens_per_rank={cap} on one rank"
            )


@functools.lru_cache(maxsize=4096)
def _ulysses_size(k: int, num_heads: int | None, num_kv_heads: int | None) -> int:
    return ulysses_size(k, num_heads, num_kv_heads)


def ulysses_size(k: int, num_heads: int | None, num_kv_heads: int | None = None) -> int:
    """The Ulysses part u of a k-rank group, the rest (k/u sub-groups) being a ring: the largest
    divisor of k that splits h query heads (u | h) and h_kv kv heads (u | h_kv, or h_kv | u:
    replicated); without a head count, the largest power of two ≤ 8 dividing k."""
    h_kv = num_kv_heads or num_heads
    best = 1
    for u in range(1, k + 1):
        if k % u:
            continue
        if num_heads is None:
            ok = not u & (u - 1) and u <= 8
        else:
            ok = num_heads % u == 0 and (h_kv % u == 0 or u % h_kv == 0)
        if ok:
            best = u
    return best


def validate_rank_speed(rank_speed: object, num_ranks: int) -> tuple[float, ...]:
    """Per-rank relative speeds: ``num_ranks`` finite numbers > 0 (errors name the entry)."""
    if not isinstance(rank_speed, Sequence) or isinstance(rank_speed, (str, bytes)):
        raise ValueError(f"rank_speed must be a list of numbers, got {type(rank_speed).__name__}")
    out = []
    for i, s in enumerate(rank_speed):
        if isinstance(s, (bool, np.bool_)) or not isinstance(s, (int, float, np.integer, np.floating)):
            raise ValueError(f"rank_speed[{i}] = {s!r} is not a number")
        if not (math.isfinite(s) and s > 0):
            raise ValueError(f"rank_speed[{i}] = {float(s)} must be finite and > 0")
        out.append(float(s))
    if len(out) != num_ranks:
        raise ValueError(f"rank_speed has {len(out)} entries for {num_ranks} ranks")
    return tuple(out)
