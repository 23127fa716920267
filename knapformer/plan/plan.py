"""The ``Plan`` value: where every chunk of every sequence goes, and what that predicts.

A solver only decides ``seq_bag`` (the bag of each sequence); :func:`build_plan` turns that into
the chunk table the executor follows, so every solver cuts sequences the same way:

- a sequence of length L in a bag of k ranks is cut into k contiguous chunks of ⌊L/k⌋ tokens;
  the ``L mod k`` leftover tokens go one each to chunk positions ``offset, offset+1, ...``
  (mod k), and the bag's ``offset`` advances by ``L mod k`` after each sequence (global id
  order). Token counts of a bag's ranks therefore differ by at most one.
- chunk position i lives on the bag's i-th rank; positions with zero tokens get no row.

Chunk table rows: ``[src_rank, seq_index, start, length, dst_rank]`` sorted by
``(src_rank, seq_index, start)``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from knapformer.plan.problem import PlanProblem

__all__ = ["Plan", "build_plan", "chunk_table", "spread_over_bags"]

SRC, IDX, START, LEN, DST = range(5)


def chunk_table(problem: PlanProblem, seq_bag: np.ndarray) -> np.ndarray:
    """Vectorised chunking of every sequence in its bag (see module docstring)."""
    n = problem.num_seqs
    if n == 0:
        return np.zeros((0, 5), dtype=np.int64)
    lengths = problem.lengths
    k = problem.bag_size[seq_bag]
    base, rem = lengths // k, lengths % k
    # Rotation offset: leftovers of earlier sequences in the same bag, in global id order.
    order = np.argsort(seq_bag, kind="stable")
    rem_sorted = rem[order]
    csum = np.cumsum(rem_sorted) - rem_sorted
    bag_sorted = seq_bag[order]
    first = np.searchsorted(bag_sorted, bag_sorted, side="left")
    offset = np.empty(n, dtype=np.int64)
    offset[order] = csum - csum[first]
    offset %= k
    # One row per (sequence, bag position).
    seq_of_row = np.repeat(np.arange(n), k)
    row_start = np.cumsum(k) - k
    pos = np.arange(seq_of_row.shape[0]) - np.repeat(row_start, k)
    kr = k[seq_of_row]
    extra = ((pos - offset[seq_of_row]) % kr) < rem[seq_of_row]
    length = base[seq_of_row] + extra.astype(np.int64)
    csum_len = np.cumsum(length)
    seq_first = np.repeat(csum_len[row_start] - length[row_start], k)
    start = csum_len - length - seq_first
    dst = problem.bag_rank_matrix[seq_bag[seq_of_row], pos]
    keep = length > 0
    table = np.stack([problem.src_rank[seq_of_row], problem.seq_index[seq_of_row], start, length, dst], axis=1)[keep]
    return np.ascontiguousarray(table, dtype=np.int64)


def spread_over_bags(bags, seq_bag: np.ndarray, per_seq: np.ndarray, num_ranks: int) -> np.ndarray:
    """(S,) for each rank, the sum of ``per_seq`` over the sequences of its bag(s): what every
    member of a bag pays for each of the bag's sequences (e.g. its share of attention)."""
    per_bag = np.bincount(seq_bag, weights=per_seq, minlength=len(bags))
    members = np.fromiter((r for b in bags for r in b), dtype=np.int64)
    owner = np.repeat(np.arange(len(bags)), [len(b) for b in bags])
    return np.bincount(members, weights=per_bag[owner], minlength=num_ranks)


def rank_work(problem: PlanProblem, seq_bag: np.ndarray, chunks: np.ndarray) -> np.ndarray:
    """(S,) predicted work per rank: linear part of its tokens + its share of each bag
    sequence's attention + the per-sequence cost (ranks holding zero tokens of a sequence
    still run its heads)."""
    S = problem.num_ranks
    lin = problem.model.lin(np.bincount(chunks[:, DST], weights=chunks[:, LEN], minlength=S))
    quad_share = problem.model.quad(problem.lengths) / problem.bag_size[seq_bag] + problem.model.per_seq
    return lin + spread_over_bags(problem.bags, seq_bag, quad_share, S)


@dataclass(frozen=True, eq=False)
class Plan:
    """One step's plan for one balancing group. Frozen; build with :func:`build_plan`."""

    seq_lens: tuple[tuple[int, ...], ...]
    """Input lengths per rank."""
    bags: tuple[tuple[int, ...], ...]
    """Group ranks of each bag (bag i's chunk position j lives on ``bags[i][j]``)."""
    seq_bag: np.ndarray
    """(n,) bag of each sequence, global rank-major order."""
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

    # -- derived ---------------------------------------------------------------------------
    @property
    def num_ranks(self) -> int:
        return len(self.seq_lens)

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
        return np.bincount(self.chunks[:, DST], weights=self.chunks[:, LEN], minlength=self.num_ranks).astype(np.int64)

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
        """Hash of what the executor depends on (bags, seq_bag, chunks): equal across ranks."""
        h = hashlib.sha256()
        h.update(json.dumps(self.bags).encode())
        h.update(np.ascontiguousarray(self.seq_bag, dtype=np.int64).tobytes())
        h.update(np.ascontiguousarray(self.chunks, dtype=np.int64).tobytes())
        return h.hexdigest()

    # -- checks ----------------------------------------------------------------------------
    def validate(self) -> None:
        """Check the invariants of ARCHITECTURE.md; raise ``AssertionError`` naming the breach."""
        lens = self.seq_lens
        n = sum(len(r) for r in lens)
        assert self.seq_bag.shape == (n,), f"seq_bag has shape {self.seq_bag.shape}, expected ({n},)"
        ch = self.chunks
        assert ch.ndim == 2 and ch.shape[1] == 5, f"chunk table shape {ch.shape}"
        assert (ch[:, LEN] > 0).all(), "chunk with non-positive length"
        key = ch[:, SRC] * (1 << 32) + ch[:, IDX]
        assert (np.diff(key) >= 0).all(), "chunk table is not sorted by (src, seq_index)"
        first = np.concatenate([[0], np.cumsum([len(r) for r in lens])])
        gid = first[ch[:, SRC]] + ch[:, IDX]
        seen = np.zeros(n, dtype=np.int64)
        for g, rows in _groups(gid):
            src, idx = int(ch[rows[0], SRC]), int(ch[rows[0], IDX])
            bag = self.bags[int(self.seq_bag[g])]
            starts, lengths, dsts = ch[rows, START], ch[rows, LEN], ch[rows, DST]
            assert starts[0] == 0, f"sequence ({src},{idx}) does not start at token 0"
            assert (starts[1:] == starts[:-1] + lengths[:-1]).all(), f"sequence ({src},{idx}) chunks not contiguous"
            assert starts[-1] + lengths[-1] == lens[src][idx], f"sequence ({src},{idx}) not covered exactly"
            pos = [bag.index(int(d)) if int(d) in bag else -1 for d in dsts]
            assert min(pos) >= 0, f"sequence ({src},{idx}) has a chunk outside its bag {bag}"
            assert pos == sorted(set(pos)), f"sequence ({src},{idx}) chunks not in bag order / one per rank"
            seen[g] += 1
        assert (seen == 1).all(), f"sequences without chunks: {np.flatnonzero(seen != 1)[:5].tolist()}"
        if self.max_tokens_per_rank is not None:
            tok = self.tokens_per_rank()
            worst = int(np.argmax(tok))
            assert tok[worst] <= self.max_tokens_per_rank, (
                f"rank {worst} holds {tok[worst]} tokens > max_tokens_per_rank={self.max_tokens_per_rank}"
            )
        assert self.makespan >= self.lower_bound * (1 - 1e-9), "plan beats its lower bound"

    # -- JSON ------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "solver": self.solver,
            "seq_lens": [list(r) for r in self.seq_lens],
            "bags": [list(b) for b in self.bags],
            "seq_bag": self.seq_bag.tolist(),
            "chunks": self.chunks.tolist(),
            "work_before": self.time_before.tolist(),
            "work_after": self.time_after.tolist(),
            "lower_bound": self.lower_bound,
            "tokens_moved": self.tokens_moved,
            "plan_seconds": self.plan_seconds,
            "max_tokens_per_rank": self.max_tokens_per_rank,
            "stats": self.stats(),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        return cls(
            seq_lens=tuple(tuple(int(v) for v in r) for r in d["seq_lens"]),
            bags=tuple(tuple(int(v) for v in b) for b in d["bags"]),
            seq_bag=np.asarray(d["seq_bag"], dtype=np.int64),
            chunks=np.asarray(d["chunks"], dtype=np.int64).reshape(-1, 5),
            time_before=np.asarray(d["work_before"], dtype=np.float64),
            time_after=np.asarray(d["work_after"], dtype=np.float64),
            lower_bound=float(d["lower_bound"]),
            tokens_moved=int(d["tokens_moved"]),
            plan_seconds=float(d["plan_seconds"]),
            solver=str(d["solver"]),
            max_tokens_per_rank=d.get("max_tokens_per_rank"),
        )

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))


def _imbalance(t: np.ndarray) -> float:
    mean = float(t.mean()) if t.size else 0.0
    return float(t.max()) / mean - 1.0 if mean > 0 else 0.0


def _groups(keys: np.ndarray):
    """Yield (key, row indices) for runs of equal consecutive keys."""
    if keys.size == 0:
        return
    cuts = np.flatnonzero(np.diff(keys)) + 1
    for rows in np.split(np.arange(keys.size), cuts):
        yield int(keys[rows[0]]), rows


def build_plan(problem: PlanProblem, seq_bag: np.ndarray, *, solver: str, plan_seconds: float = 0.0) -> Plan:
    """Chunk ``seq_bag`` into a full :class:`Plan` and check the memory cap."""
    seq_bag = np.ascontiguousarray(seq_bag, dtype=np.int64)
    chunks = chunk_table(problem, seq_bag)
    time_after = rank_work(problem, seq_bag, chunks) / problem.speed
    moved = int(chunks[chunks[:, SRC] != chunks[:, DST], LEN].sum())
    plan = Plan(
        seq_lens=problem.seq_lens,
        bags=problem.bags,
        seq_bag=seq_bag,
        chunks=chunks,
        time_before=problem.time_before,
        time_after=time_after,
        lower_bound=problem.lower_bound,
        tokens_moved=moved,
        plan_seconds=plan_seconds,
        solver=solver,
        max_tokens_per_rank=problem.max_tokens_per_rank,
    )
    cap = problem.max_tokens_per_rank
    if cap is not None:
        tok = plan.tokens_per_rank()
        worst = int(np.argmax(tok)) if tok.size else 0
        if tok.size and tok[worst] > cap:
            raise ValueError(
                f"solver {solver!r} put {int(tok[worst])} tokens on rank {worst}, over max_tokens_per_rank={cap}"
            )
    return plan
