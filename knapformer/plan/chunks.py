"""Cutting sequences into chunks: the one rule every solver's plan follows.

A solver only decides which group each sequence runs on; :func:`chunk_table` cuts every
sequence in its group (see :mod:`knapformer.plan.plan` for the rule), and for a ring group in
zigzag order (:func:`zigzag_slots`).
"""

from __future__ import annotations

import numpy as np

from knapformer.plan.seqindex import SeqIndex, group_arrays, stable_order

__all__ = ["chunk_table", "slot_arrays", "zigzag_slots"]


def zigzag_slots(k: int, r: int) -> np.ndarray:
    """(2k,) the member position of each chunk position of a ring group of ``k`` members as
    ``r`` sub-groups of u = k/r: half-block b (u positions) goes to sub-group b for b < r and
    to sub-group 2r − 1 − b after, chunk t of a half-block to the sub-group's member t."""
    u = k // r
    p = np.arange(2 * k, dtype=np.int64)
    half, t = p // u, p % u
    return np.where(half < r, half, 2 * r - 1 - half) * u + t


def slot_arrays(groups, ring=None) -> tuple[np.ndarray, np.ndarray]:
    """(G,) chunk positions per group and (G, max) the rank of each position (padded with
    -1): a group's members in order, or for a ring group (``ring[g]`` > 1) its zigzag slots."""
    sizes, mat = group_arrays(groups)
    if ring is None or not any(int(r) > 1 for r in ring):
        return sizes, mat
    rings = np.asarray(ring, dtype=np.int64)
    slots = np.where(rings > 1, 2 * sizes, sizes)
    out = np.full((len(groups), int(slots.max())), -1, dtype=np.int64)
    out[:, : mat.shape[1]] = mat
    for g in np.flatnonzero(rings > 1).tolist():
        out[g, : slots[g]] = mat[g, zigzag_slots(int(sizes[g]), int(rings[g]))]
    return slots, out


def chunk_table(index: SeqIndex, groups, seq_group: np.ndarray, ring=None) -> np.ndarray:
    """Vectorised chunking of every sequence in its group (see module docstring); ``ring``
    (per group) cuts ring groups' sequences in zigzag order.

    A sequence is cut into *units* — k of one chunk each, or for a ring group 2r half-blocks
    of u chunks each — evenly (the leftover tokens rotate over the group's units from one
    sequence to the next, and over a half-block's chunks), so half-blocks differ by at most
    one token and the zigzag work stays even."""
    n = index.num_seqs
    if n == 0:
        return np.zeros((0, 5), dtype=np.int64)
    slots, mat = slot_arrays(groups, ring)
    k_all = slots[seq_group]
    whole = k_all == 1
    if whole.all():  # every sequence on one rank: one row each
        return _whole_rows(index, mat[seq_group, 0])
    if whole.any():  # the whole ones as one row each, the split ones cut below; rows in id order
        split_ids = np.flatnonzero(~whole)
        cut, counts = _cut(index, groups, seq_group, ring, slots, mat, split_ids)
        per_seq = whole.astype(np.int64)
        per_seq[split_ids] = counts
        at = np.cumsum(per_seq) - per_seq  # each sequence's first row
        rows = np.empty((int(per_seq.sum()), 5), dtype=np.int64)
        w_ids = np.flatnonzero(whole)
        rows[at[w_ids]] = _whole_rows(index, mat[seq_group[w_ids], 0], w_ids)
        rows[np.repeat(at[split_ids], counts) + _ranks_within(counts)] = cut
        return rows
    return _cut(index, groups, seq_group, ring, slots, mat, np.arange(n))[0]


def _whole_rows(index: SeqIndex, dst: np.ndarray, ids: np.ndarray | None = None) -> np.ndarray:
    src, idx, ln = index.src_rank, index.seq_index, index.lengths
    if ids is not None:
        src, idx, ln = src[ids], idx[ids], ln[ids]
    return np.stack([src, idx, np.zeros_like(ln), ln, dst], axis=1).astype(np.int64)


def _ranks_within(counts: np.ndarray) -> np.ndarray:
    """0, 1, …, c − 1 for each count c, concatenated."""
    starts = np.cumsum(counts) - counts
    return np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(starts, counts)


def _cut(index: SeqIndex, groups, seq_group_all: np.ndarray, ring, slots, mat, ids: np.ndarray):
    """Chunk rows of the sequences ``ids`` (ascending), in id order (see :func:`chunk_table`),
    and how many rows each has."""
    n = ids.size
    lengths = index.lengths[ids]
    seq_group = seq_group_all[ids]
    sizes = group_arrays(groups)[0]
    rings = np.ones(len(groups), dtype=np.int64) if ring is None else np.asarray(ring, dtype=np.int64)
    units_g = np.where(rings > 1, 2 * rings, sizes)
    units, split, k = units_g[seq_group], (slots // units_g)[seq_group], slots[seq_group]
    base, rem = lengths // units, lengths % units
    # Rotation offset: leftovers of earlier sequences in the same group, in global id order.
    order = stable_order(seq_group, len(groups))
    rem_sorted = rem[order]
    csum = np.cumsum(rem_sorted) - rem_sorted
    group_sorted = seq_group[order]
    first = np.searchsorted(group_sorted, group_sorted, side="left")
    offset = np.empty(n, dtype=np.int64)
    offset[order] = csum - csum[first]
    # One row per (sequence, chunk position); position p is chunk p % split of unit p // split.
    seq_of_row = np.repeat(np.arange(n), k)
    row_start = np.cumsum(k) - k
    pos = _ranks_within(k)
    sp, off = split[seq_of_row], offset[seq_of_row]
    unit, t = pos // sp, pos % sp
    unit_len = base[seq_of_row] + (((unit - off) % units[seq_of_row]) < rem[seq_of_row]).astype(np.int64)
    length = unit_len // sp + (((t - off) % sp) < unit_len % sp).astype(np.int64)
    csum_len = np.cumsum(length)
    seq_first = np.repeat(csum_len[row_start] - length[row_start], k)
    start = csum_len - length - seq_first
    dst = mat[seq_group[seq_of_row], pos]
    keep = length > 0
    gid = ids[seq_of_row]
    table = np.stack([index.src_rank[gid], index.seq_index[gid], start, length, dst], axis=1)[keep]
    return np.ascontiguousarray(table, dtype=np.int64), np.bincount(seq_of_row[keep], minlength=n)
