"""Cutting sequences into chunks: the one rule every solver's plan follows.

A solver only decides which group each sequence runs on; :func:`chunk_table` cuts every
sequence in its group (see :mod:`knapformer.plan.plan` for the rule), and for a ring group in
zigzag order (:func:`zigzag_slots`).
"""

from __future__ import annotations

import numpy as np

from knapformer.plan.seqindex import SeqIndex, group_arrays

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
    lengths = index.lengths
    slots, mat = slot_arrays(groups, ring)
    sizes = group_arrays(groups)[0]
    rings = np.ones(len(groups), dtype=np.int64) if ring is None else np.asarray(ring, dtype=np.int64)
    units_g = np.where(rings > 1, 2 * rings, sizes)
    units, split, k = units_g[seq_group], (slots // units_g)[seq_group], slots[seq_group]
    base, rem = lengths // units, lengths % units
    # Rotation offset: leftovers of earlier sequences in the same group, in global id order.
    order = np.argsort(seq_group, kind="stable")
    rem_sorted = rem[order]
    csum = np.cumsum(rem_sorted) - rem_sorted
    group_sorted = seq_group[order]
    first = np.searchsorted(group_sorted, group_sorted, side="left")
    offset = np.empty(n, dtype=np.int64)
    offset[order] = csum - csum[first]
    # One row per (sequence, chunk position); position p is chunk p % split of unit p // split.
    seq_of_row = np.repeat(np.arange(n), k)
    row_start = np.cumsum(k) - k
    pos = np.arange(seq_of_row.shape[0]) - np.repeat(row_start, k)
    sp, off = split[seq_of_row], offset[seq_of_row]
    unit, t = pos // sp, pos % sp
    unit_len = base[seq_of_row] + (((unit - off) % units[seq_of_row]) < rem[seq_of_row]).astype(np.int64)
    length = unit_len // sp + (((t - off) % sp) < unit_len % sp).astype(np.int64)
    csum_len = np.cumsum(length)
    seq_first = np.repeat(csum_len[row_start] - length[row_start], k)
    start = csum_len - length - seq_first
    dst = mat[seq_group[seq_of_row], pos]
    keep = length > 0
    table = np.stack([index.src_rank[seq_of_row], index.seq_index[seq_of_row], start, length, dst], axis=1)[keep]
    return np.ascontiguousarray(table, dtype=np.int64)
