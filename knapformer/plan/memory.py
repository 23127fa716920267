"""What a rank holds under a plan, in the unit ``max_tokens_per_rank`` caps: routed tokens,
plus on the ``pre_attn`` path the keys and values its ring groups gather.

Ring attention (``bal.attention``) keeps a member's attention memory at a few blocks of L/r
tokens. The custom-kernel path (``pre_attn``, :mod:`knapformer.distributed.kv_gather`)
gathers, per layer, the keys and values of the sequence that a member's queries may see: its
own block plus ``extra`` rows of its kv heads (not causal: the other sub-groups' blocks, about
(r − 1)/r·L; causal: the key prefix of each query run, about (2r − 1)/(2r)·L). The rule that
turns them into tokens: a gathered row of one member holds h_kv/u kv heads (one when u does
not divide h_kv) of keys and values, which is ``2·kv_u / (h + 2·h_kv)`` of the q, k and v a
routed token carries into attention (head dims taken equal). Since a routed token keeps at
least its q, k and v per layer (and in practice much more: its MLP and norm activations), this
*over*-counts the gathered rows against the cap, never under.

Pure numpy.
"""

from __future__ import annotations

import numpy as np

from knapformer.plan.seqindex import DST, LEN, START, sum_by

__all__ = ["gather_extra_estimate", "gather_share", "gathered_memory", "gathered_rows"]


def gather_share(u, h: int | None, h_kv: int | None = None):
    """Tokens one gathered key/value row of a u-way Ulysses member counts as (module
    docstring); without a head count (``h`` None) kv heads split like the query heads: 2/(3u).
    ``u`` may be an array."""
    u = np.maximum(np.asarray(u, dtype=np.float64), 1.0)
    if h is None:
        return 2.0 / (3.0 * u)
    h_kv = h_kv or h
    kv = np.where(np.mod(h_kv, u) == 0, h_kv / u, 1.0)
    return 2.0 * kv / (h + 2.0 * h_kv)


def gather_extra_estimate(L, r, causal: bool):
    """An upper bound on the key rows beyond its own block that a member of a ring of ``r``
    sub-groups gathers for a sequence of L tokens cut in zigzag order (half-blocks of
    ⌊L/2r⌋ or ⌈L/2r⌉ tokens): (r − 1)/r·L + 2, causal (2r − 1)/(2r)·L + 2r + 3; 0 for r = 1.
    Arrays broadcast."""
    L = np.asarray(L, dtype=np.float64)
    r = np.asarray(r, dtype=np.float64)
    if causal:  # two prefixes of at most L keys each
        extra = np.minimum((2 * r - 1) / (2 * r) * L + 2 * r + 3, 2 * L)
    else:
        extra = np.minimum((r - 1) / r * L + 2, L)
    return np.where(r > 1, extra, 0.0)


def gathered_rows(plan, causal: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per (ring sequence, sub-group) with queries: the group, the sub-group and the key rows
    its members gather beyond their block — exactly what
    :func:`knapformer.distributed.kv_gather.entry_keys` lays out (causal: the sum of its
    query runs' ends; else the whole sequence)."""
    rings = np.asarray(plan.rings, dtype=np.int64)
    empty = np.zeros(0, dtype=np.int64)
    if not (rings > 1).any() or plan.chunks.shape[0] == 0:
        return empty, empty, empty
    seq_group = np.asarray(plan.seq_group, dtype=np.int64)
    gid = plan.chunk_gid
    g_of = seq_group[gid]
    sel = np.flatnonzero(rings[g_of] > 1)
    if sel.size == 0:
        return empty, empty, empty
    ch, gid, g_of = plan.chunks[sel], gid[sel], g_of[sel]
    pos = np.empty(sel.size, dtype=np.int64)
    for g in np.unique(g_of).tolist():  # the member position of each chunk's holder
        members = plan.groups[g]
        where = {m: i for i, m in enumerate(members)}
        at = np.flatnonzero(g_of == g)
        pos[at] = [where[int(d)] for d in ch[at, DST]]
    u = np.fromiter((len(plan.groups[g]) for g in g_of.tolist()), dtype=np.int64, count=sel.size) // rings[g_of]
    sub = pos // u
    order = np.lexsort((ch[:, START], sub, gid))
    gid, sub, g_of = gid[order], sub[order], g_of[order]
    start, n = ch[order, START], ch[order, LEN]
    end = start + n
    key = gid * (int(rings.max()) + 1) + sub
    last = np.ones(key.size, dtype=bool)  # a chunk that ends its run: the next starts elsewhere
    last[:-1] = (key[1:] != key[:-1]) | (start[1:] != end[:-1])
    first = np.ones(key.size, dtype=bool)
    first[1:] = key[1:] != key[:-1]
    idx = np.cumsum(first) - 1
    block = np.bincount(idx, weights=n).astype(np.int64)
    if causal:
        keys = np.bincount(idx, weights=np.where(last, end, 0)).astype(np.int64)
    else:
        keys = plan.index.lengths[gid[first]].astype(np.int64)
    has = block > 0
    return g_of[first][has], sub[first][has], (keys - block)[has]


def gathered_memory(plan, h: int | None, h_kv: int | None, causal: bool) -> np.ndarray:
    """(S,) what each rank holds on the ``pre_attn`` path, in tokens: its routed tokens plus
    its gathered key/value rows at :func:`gather_share` each (rounded up)."""
    S = plan.num_ranks
    tokens = sum_by(plan.chunks[:, DST], plan.chunks[:, LEN], S)
    extra = np.zeros(S)
    groups, subs, rows = gathered_rows(plan, causal)
    rings = plan.rings
    for g, s, x in zip(groups.tolist(), subs.tolist(), rows.tolist()):
        u = len(plan.groups[g]) // rings[g]
        members = list(plan.groups[g][s * u : (s + 1) * u])
        extra[members] += x * float(gather_share(u, h, h_kv))
    return (tokens + np.ceil(extra - 1e-9)).astype(np.int64)
