"""Unstack split sequences: move the split sequences off the busiest rank of a placement, to
another block or another degree, while that lowers the rank's load.

Why: the moldable placement puts split sequences on blocks greedily, costliest first, each on
the block whose busiest member finishes earliest *then*. On long-tailed steps (a 970k-token
clip on 96 ranks, 72-, 64- and 32-rank groups for the next ones, 24- and 16-rank rings and a
hundred 8-rank groups on 512 GPUs) the last rings found every block half full and two
300k-token sequences shared one 16-rank ring: its members held 1.13× the lower bound before
any whole sequence was placed, and no move of whole sequences can undo that. A move here
takes a sequence on the busiest rank, tries it at every degree up to a node and about two per
doubling beyond (:func:`_ladder`), each on the block that finishes earliest without it, and
keeps the best when that block ends below the rank's load. Greedy and bounded
(:data:`MAX_MOVES`); the moldable planner runs it only where its best plan is far from the
bound (:mod:`~knapformer.plan.solvers.moldable`).
"""

from __future__ import annotations

import numpy as np

from knapformer.plan.member_comm import route_home_estimate
from knapformer.plan.problem import PlanProblem
from knapformer.plan.solvers.blocks import block_members
from knapformer.plan.solvers.member_costs import MemberCosts

__all__ = ["MAX_MOVES", "unstack"]

MAX_MOVES = 48
"""Moves per placement at most (each costs O(S) per degree tried)."""
_TRIED = 4
"""The costliest split sequences on the busiest rank tried per move."""


def unstack(
    problem: PlanProblem,
    costs: MemberCosts,
    degree: np.ndarray,
    c: np.ndarray,
    load: np.ndarray,
    tok: np.ndarray,
    first: np.ndarray,
    target: float,
) -> int:
    """Move split sequences (``degree > 1``) off the busiest rank until no rank's time exceeds
    ``target`` or no move lowers it (module docstring). In place: each sequence's ``degree``,
    member cost ``c`` and block (``first``: its first rank; groups are consecutive ranks), and
    the ranks' ``load``/``tok``. Returns the number of moves."""
    S, speed, cap = problem.num_ranks, problem.speed, problem.max_tokens_per_rank
    link = problem.link
    node = link.gpus_per_node if link is not None else None
    L, home = problem.lengths, problem.src_rank

    def need(g: int, k: int) -> int:  # tokens (and gathered K/V) a member holds, as _split counts
        extra = int(problem.gather_need(L[g : g + 1], k)[0]) if problem.kv_gather and cap is not None else 0
        return -(-int(L[g]) // k) + extra

    def route(g: int, k: int) -> float:  # what the source sends (placement's charge)
        return float(route_home_estimate(L[g], k, problem.model, link)) if link is not None else 0.0

    D = np.asarray(costs.D, dtype=np.int64)
    col = np.full(problem.num_seqs, -1, dtype=np.int64)
    col[costs.cols] = np.arange(costs.cols.size)
    wide = np.full(problem.num_seqs, -1, dtype=np.int64)
    wide[costs.wide_cols] = np.arange(costs.wide_cols.size)
    multi = np.flatnonzero(degree > 1)
    ladder = _ladder(D, node)
    uniform = bool((speed == speed[0]).all()) and node is not None and S % node == 0
    blocks: dict[int, np.ndarray] = {}

    def earliest(k: int, cost: float, tokens: int) -> tuple[float, int]:
        """(finish, first rank) of the block of size k that finishes earliest with ``cost`` more."""
        if uniform and cap is None and (S % k == 0 or k % node == 0):
            if S % k == 0:
                top_of = load.reshape(-1, k).max(axis=1)
                starts = np.arange(0, S, k)
            else:  # windows of whole nodes, from the per-node maxima
                top_of = np.lib.stride_tricks.sliding_window_view(load.reshape(-1, node).max(axis=1), k // node)
                top_of = top_of.max(axis=1)
                starts = np.arange(top_of.size) * node
            b = int(np.argmin(top_of))
            return float((top_of[b] + cost) / speed[0]), int(starts[b])
        B = blocks.get(k)
        if B is None:
            B = blocks[k] = block_members(S, k, node)
        finish = ((load[B] + cost) / speed[B]).max(axis=1)
        if cap is not None:
            finish = np.where((tok[B] + tokens <= cap).all(axis=1), finish, np.inf)
        b = int(np.argmin(finish))
        return float(finish[b]), int(B[b, 0])

    moves = 0
    while moves < MAX_MOVES:
        t = load / speed
        r = int(np.argmax(t))
        top = float(t[r])
        if top <= target:
            break
        on = multi[(first[multi] <= r) & (r < first[multi] + degree[multi])]
        best = None
        for g in on[np.argsort(-c[on], kind="stable")][:_TRIED].tolist():
            if col[g] < 0:  # priced whole only (never split by a pick): nothing to try
                continue
            row = costs.wide[:, wide[g]] if wide[g] >= 0 else costs.near[:, col[g]]
            lo, k0 = int(first[g]), int(degree[g])
            load[lo : lo + k0] -= c[g]
            tok[lo : lo + k0] -= need(g, k0)
            for j in ladder[ladder < row.size].tolist():
                finish, start = earliest(int(D[j]), float(row[j]), need(g, int(D[j])))
                if finish < top * (1 - 1e-9) and (best is None or finish < best[0]):
                    best = (finish, g, int(D[j]), start, float(row[j]))
            load[lo : lo + k0] += c[g]
            tok[lo : lo + k0] += need(g, k0)
        if best is None:
            break
        _, g, k, start, cost = best
        lo, k0 = int(first[g]), int(degree[g])
        load[lo : lo + k0] -= c[g]
        tok[lo : lo + k0] -= need(g, k0)
        load[start : start + k] += cost
        tok[start : start + k] += need(g, k)
        load[home[g]] += route(g, k) - route(g, k0)
        degree[g], c[g], first[g] = k, cost, start
        moves += 1
    return moves


def _ladder(D: np.ndarray, node: int | None) -> np.ndarray:
    """Indices into D of the degrees a move tries: every degree above 1 up to a node, and beyond
    it about two per doubling (hundreds of degrees on thousands of ranks; a move needs a block
    that is free enough, not the exact size)."""
    small = np.flatnonzero((D > 1) & ((D <= node) if node is not None else True))
    if node is None or D[-1] <= node:
        return small
    wide = np.flatnonzero(D > node)
    want = np.unique(np.round(np.log2(D[wide].astype(np.float64)) * 2))
    picks = [int(wide[np.argmin(np.abs(np.log2(D[wide].astype(np.float64)) * 2 - w))]) for w in want]
    return np.unique(np.concatenate([small, np.asarray(picks, dtype=np.int64)]))
