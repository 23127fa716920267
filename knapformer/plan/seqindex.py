"""Sequence numbering, derived once from per-rank lengths and shared by every layer.

Sequences are numbered globally in rank-major order: sequence ``g`` is the ``seq_index[g]``-th
sequence of rank ``src_rank[g]``, and its tokens sit at ``local_start[g]`` in that rank's local
tensor. The problem, the plan, the route spec, the cluster model and ``gather_sequences`` all
read these arrays from one :class:`SeqIndex` instead of re-deriving them.

Legend: ``n`` sequences, ``S`` ranks.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from functools import cached_property

import numpy as np

__all__ = [
    "DST",
    "IDX",
    "LEN",
    "SRC",
    "START",
    "SeqIndex",
    "concat_ranges",
    "group_arrays",
    "largest_group",
    "spread_over_groups",
    "stable_order",
    "sum_by",
]

SRC, IDX, START, LEN, DST = range(5)
"""Columns of a chunk table row ``[src_rank, seq_index, start, length, dst_rank]``."""


@dataclass(frozen=True, eq=False)
class SeqIndex:
    """Global numbering of the sequences of one balancing group (validated lengths only)."""

    seq_lens: tuple[tuple[int, ...], ...]

    @property
    def num_ranks(self) -> int:
        return len(self.seq_lens)

    @cached_property
    def counts(self) -> np.ndarray:
        """(S,) sequences per rank."""
        return np.fromiter((len(r) for r in self.seq_lens), dtype=np.int64, count=self.num_ranks)

    @cached_property
    def first(self) -> np.ndarray:
        """(S + 1,) global id of each rank's first sequence (and n at the end)."""
        return np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)

    @property
    def num_seqs(self) -> int:
        return int(self.first[-1])

    @cached_property
    def lengths(self) -> np.ndarray:
        """(n,) lengths in global order."""
        return np.fromiter(itertools.chain.from_iterable(self.seq_lens), dtype=np.int64, count=self.num_seqs)

    @cached_property
    def src_rank(self) -> np.ndarray:
        """(n,) source rank of each sequence."""
        return np.repeat(np.arange(self.num_ranks, dtype=np.int64), self.counts)

    @cached_property
    def seq_index(self) -> np.ndarray:
        """(n,) index of each sequence on its source rank."""
        return np.arange(self.num_seqs, dtype=np.int64) - self.first[:-1][self.src_rank]

    @cached_property
    def rank_tokens(self) -> np.ndarray:
        """(S,) tokens each rank contributes."""
        return np.bincount(self.src_rank, weights=self.lengths, minlength=self.num_ranks).astype(np.int64)

    @cached_property
    def local_start(self) -> np.ndarray:
        """(n,) offset of each sequence inside its source rank's local tensor."""
        start = np.cumsum(self.lengths) - self.lengths
        rank_start = np.cumsum(self.rank_tokens) - self.rank_tokens
        return start - rank_start[self.src_rank]

    def gid(self, src_rank: np.ndarray, seq_index: np.ndarray) -> np.ndarray:
        """Global ids of ``(src_rank, seq_index)`` pairs (e.g. the rows of a chunk table)."""
        return self.first[:-1][src_rank] + seq_index


def sum_by(index: np.ndarray, weights: np.ndarray, n: int) -> np.ndarray:
    """(n,) float64 sums of ``weights`` grouped by ``index`` (``np.bincount`` returns int64
    for empty input, which then silently truncates or overflows float costs written into it)."""
    return np.bincount(index, weights=weights, minlength=n).astype(np.float64, copy=False)


def spread_over_groups(groups, seq_group: np.ndarray, per_seq: np.ndarray, num_ranks: int) -> np.ndarray:
    """(S,) for each rank, the sum of ``per_seq`` over the sequences whose group it is in:
    what every member pays for each of its groups' sequences (e.g. its share of attention).
    Groups may overlap: a rank in several groups pays for each."""
    per_group = sum_by(seq_group, per_seq, len(groups))
    members, owner = group_members(groups)
    return sum_by(members, per_group[owner], num_ranks)


def _cached(build):
    """``build(groups)`` memoised for hashable tuples of tuples (a plan's groups), its arrays
    read-only then; other inputs are built afresh."""
    cached = functools.lru_cache(maxsize=16)(lambda groups: tuple(_frozen(a) for a in build(groups)))

    def get(groups):
        if isinstance(groups, tuple):
            try:
                return cached(groups)
            except TypeError:  # unhashable members
                pass
        return build(groups)

    get.__doc__ = build.__doc__
    return get


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def _flatten(groups) -> tuple[np.ndarray, np.ndarray]:
    members = np.fromiter((r for g in groups for r in g), dtype=np.int64)
    owner = np.repeat(np.arange(len(groups)), [len(g) for g in groups])
    return members, owner


def _arrays(groups) -> tuple[np.ndarray, np.ndarray]:
    sizes = np.fromiter((len(g) for g in groups), dtype=np.int64, count=len(groups))
    mat = np.full((len(groups), int(sizes.max()) if len(groups) else 1), -1, dtype=np.int64)
    for i, g in enumerate(groups):
        mat[i, : len(g)] = g
    return sizes, mat


group_members = _cached(_flatten)
"""Every group's ranks concatenated, and the group of each: cached for tuples of tuples (a
plan's groups; the cost functions ask for them a dozen times per candidate plan)."""
group_arrays = _cached(_arrays)
"""(G,) group sizes and (G, max size) group ranks padded with -1 (cached for tuples of tuples;
read-only then)."""


def largest_group(groups, seq_group: np.ndarray, num_ranks: int) -> np.ndarray:
    """(S,) the size of the largest group holding sequences each rank is in (1 if none)."""
    sizes, _ = group_arrays(groups)
    members, owner = group_members(groups)
    used = np.zeros(len(groups), dtype=bool)
    used[np.unique(seq_group)] = True
    out = np.ones(num_ranks, dtype=np.int64)
    keep = used[owner]
    np.maximum.at(out, members[keep], sizes[owner[keep]])
    return out


def stable_order(keys: np.ndarray, bound: int | None = None) -> np.ndarray:
    """``np.argsort(keys, kind="stable")`` for non-negative integer keys below ``bound``
    (default: their max + 1): least-significant-digit radix over 16-bit digits, each a stable
    sort numpy does by counting (a 16-bit pass over 131k keys takes ~1 ms; int64's merge sort
    ~8 ms). Negative keys fall back to the plain sort."""
    keys = np.asarray(keys)
    if keys.size == 0:
        return np.zeros(0, dtype=np.int64)
    if int(keys.min()) < 0:
        return np.argsort(keys, kind="stable")
    top = int(keys.max()) + 1 if bound is None else int(bound)
    keys = keys.astype(np.int64, copy=False)
    order = np.argsort((keys & 0xFFFF).astype(np.uint16), kind="stable")
    shift = 16
    while (top - 1) >> shift:
        digit = ((keys[order] >> shift) & 0xFFFF).astype(np.uint16)
        order = order[np.argsort(digit, kind="stable")]
        shift += 16
    return order


def concat_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenate ``arange(s, s + l)`` for each pair, vectorised."""
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
    return np.arange(total, dtype=np.int64) + offsets
