"""The planning problem: one step's sequence lengths, the bags, the cost model, the limits.

A ``PlanProblem`` is validated once at the boundary (bad user input raises ``ValueError``
naming the culprit) and then exposes flat numpy arrays every solver shares. Sequences are
numbered globally in rank-major order: sequence ``g`` is ``(src_rank[g], seq_index[g])``.

Legend: ``n`` sequences, ``B`` bags, ``S`` ranks in the group.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from knapformer.layout import BagLayout, parse_layout
from knapformer.workload import WorkloadModel

__all__ = ["PlanProblem", "validate_seq_lens"]


def validate_seq_lens(seq_lens: object, num_ranks: int | None = None) -> tuple[tuple[int, ...], ...]:
    """Check ``[[len, ...] per rank]`` and return it as tuples of ints; errors name the entry."""
    if not isinstance(seq_lens, Sequence) or isinstance(seq_lens, (str, bytes)):
        raise ValueError(f"seq_lens must be a list of per-rank lists, got {type(seq_lens).__name__}")
    out = []
    for r, lens in enumerate(seq_lens):
        if isinstance(lens, (list, tuple, np.ndarray)):  # fast path: a clean integer row
            arr = np.asarray(lens)
            if arr.ndim == 1 and (arr.size == 0 or (arr.dtype.kind in "iu" and arr.min() > 0)):
                out.append(tuple(arr.tolist()))
                continue
        if isinstance(lens, np.ndarray):
            lens = lens.tolist()
        if not isinstance(lens, Sequence) or isinstance(lens, (str, bytes)):
            raise ValueError(f"seq_lens[{r}] must be a list of lengths, got {type(lens).__name__}")
        row = []
        for i, v in enumerate(lens):
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
                raise ValueError(f"seq_lens[{r}][{i}] = {v!r} is not an integer")
            if v <= 0:
                raise ValueError(f"seq_lens[{r}][{i}] = {v} must be a positive length")
            row.append(int(v))
        out.append(tuple(row))
    if num_ranks is not None and len(out) != num_ranks:
        raise ValueError(f"seq_lens has {len(out)} ranks but the bag layout's group has {num_ranks}")
    return tuple(out)


@dataclass(frozen=True, eq=False)
class PlanProblem:
    """Everything a solver needs; immutable, validated in ``__post_init__``."""

    seq_lens: tuple[tuple[int, ...], ...]
    """Lengths of the sequences on each rank of the group (ranks may be empty)."""
    layout: BagLayout
    """Bag layout of the group."""
    model: WorkloadModel
    """Cost model."""
    max_tokens_per_rank: int | None = None
    """Memory cap: no rank may hold more routed tokens. None = unlimited."""
    rank_speed: tuple[float, ...] | None = None
    """Relative throughput per rank (work/speed = time). None = all 1.0."""
    extra: dict = field(default_factory=dict)
    """Solver-specific knobs (e.g. ``max_iters``); ignored by solvers that do not know them."""

    def __post_init__(self) -> None:
        layout = parse_layout(self.layout)
        object.__setattr__(self, "layout", layout)
        object.__setattr__(self, "seq_lens", validate_seq_lens(self.seq_lens, layout.group_size))
        cap = self.max_tokens_per_rank
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, np.integer)) or cap <= 0):
            raise ValueError(f"max_tokens_per_rank must be a positive int, got {cap!r}")
        if self.rank_speed is not None:
            speed = tuple(float(s) for s in self.rank_speed)
            if len(speed) != layout.group_size:
                raise ValueError(f"rank_speed has {len(speed)} entries for {layout.group_size} ranks")
            bad = [i for i, s in enumerate(speed) if not (math.isfinite(s) and s > 0)]
            if bad:
                raise ValueError(f"rank_speed[{bad[0]}] = {speed[bad[0]]} must be finite and > 0")
            object.__setattr__(self, "rank_speed", speed)

    # -- sequences ------------------------------------------------------------------------
    @property
    def num_ranks(self) -> int:
        return self.layout.group_size

    @cached_property
    def lengths(self) -> np.ndarray:
        """(n,) int64 lengths in global (rank-major) order."""
        flat = [v for row in self.seq_lens for v in row]
        return np.asarray(flat, dtype=np.int64)

    @cached_property
    def src_rank(self) -> np.ndarray:
        """(n,) source rank of each sequence."""
        counts = [len(row) for row in self.seq_lens]
        return np.repeat(np.arange(self.num_ranks, dtype=np.int64), counts)

    @cached_property
    def seq_index(self) -> np.ndarray:
        """(n,) index of each sequence on its source rank."""
        return np.concatenate([np.arange(len(r), dtype=np.int64) for r in self.seq_lens] or [np.zeros(0, np.int64)])

    @cached_property
    def work(self) -> np.ndarray:
        """(n,) cost of each whole sequence."""
        return self.model.cost(self.lengths)

    @property
    def num_seqs(self) -> int:
        return int(self.lengths.shape[0])

    # -- ranks and bags ----------------------------------------------------------------------
    @cached_property
    def speed(self) -> np.ndarray:
        """(S,) rank speeds."""
        if self.rank_speed is None:
            return np.ones(self.num_ranks)
        return np.asarray(self.rank_speed, dtype=np.float64)

    @cached_property
    def bags(self) -> tuple[tuple[int, ...], ...]:
        return self.layout.bags

    @cached_property
    def bag_size(self) -> np.ndarray:
        """(B,) ranks per bag."""
        return np.asarray(self.layout.bag_sizes, dtype=np.int64)

    @cached_property
    def bag_capacity(self) -> np.ndarray:
        """(B,) work a bag completes per unit time: size × slowest member's speed
        (Ulysses splits a sequence evenly, so the slowest rank sets the bag's pace)."""
        return np.asarray([len(b) * self.speed[list(b)].min() for b in self.bags])

    @cached_property
    def bag_class(self) -> tuple[np.ndarray, int]:
        """(B,) class id of each bag (same size and capacity: interchangeable for the fluid
        objective) and the number of classes."""
        keys = np.stack([self.bag_size.astype(np.float64), self.bag_capacity], axis=1)
        _, inv = np.unique(keys, axis=0, return_inverse=True)
        inv = inv.reshape(-1)
        return inv, int(inv.max()) + 1

    @cached_property
    def bag_of_rank(self) -> np.ndarray:
        """(S,) bag index of each rank."""
        out = np.empty(self.num_ranks, dtype=np.int64)
        for b, ranks in enumerate(self.bags):
            out[list(ranks)] = b
        return out

    @cached_property
    def bag_rank_matrix(self) -> np.ndarray:
        """(B, max bag size) ranks of each bag, padded with -1."""
        mat = np.full((len(self.bags), self.layout.max_bag_size), -1, dtype=np.int64)
        for b, ranks in enumerate(self.bags):
            mat[b, : len(ranks)] = ranks
        return mat

    # -- baselines ---------------------------------------------------------------------------
    @cached_property
    def time_before(self) -> np.ndarray:
        """(S,) per-rank time when every rank processes its own sequences alone."""
        work = np.bincount(self.src_rank, weights=self.work, minlength=self.num_ranks)
        return work / self.speed

    @cached_property
    def lower_bound(self) -> float:
        """A makespan no plan can beat: max of the fluid bound (total work over total speed)
        and, per sequence, its cheapest placement's busiest chunk."""
        if self.num_seqs == 0:
            return 0.0
        fluid = float(self.work.sum() / self.speed.sum())
        best = np.full(self.num_seqs, np.inf)
        options = sorted({(len(r), float(self.speed[list(r)].max())) for r in self.bags})
        for k, fastest in options:
            largest_chunk = -(-self.lengths // k)
            t = self.model.chunk_cost(largest_chunk, self.lengths, k) / fastest
            np.minimum(best, t, out=best)
        return max(fluid, float(best.max()))

    def check_capacity(self) -> None:
        """Fail fast when no plan can satisfy the memory cap (necessary conditions)."""
        cap = self.max_tokens_per_rank
        if cap is None or self.num_seqs == 0:
            return
        total = int(self.lengths.sum())
        if total > cap * self.num_ranks:
            raise ValueError(
                f"max_tokens_per_rank={cap} is infeasible: {total} tokens over {self.num_ranks} ranks "
                f"need at least {-(-total // self.num_ranks)} per rank"
            )
        kmax = self.layout.max_bag_size
        g = int(np.argmax(self.lengths))
        if -(-int(self.lengths[g]) // kmax) > cap:
            raise ValueError(
                f"sequence {int(self.seq_index[g])} on rank {int(self.src_rank[g])} has "
                f"{int(self.lengths[g])} tokens: even the largest bag ({kmax} ranks) puts more than "
                f"max_tokens_per_rank={cap} on one rank"
            )
