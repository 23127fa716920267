"""One moldable candidate: given each sequence's degree, place the split sequences on blocks of
ranks and fill the ranks around them with the whole ones (the ``auto`` planner's building block).

1. **Split sequences** (degree > 1), largest per-member cost first, go to the block of k
   ranks (aligned inside a node; beyond a node any k/n consecutive whole nodes; any k
   consecutive ranks when k does not divide a small group without a link model) with the
   earliest finish of its busiest member (ties: a block holding the sequence's source rank,
   then the lowest). The source rank of each is first charged for sending what leaves it
   (route and reverse, :func:`~knapformer.plan.member_comm.route_home_estimate`).
2. **Whole sequences** fill the ranks by earliest-finish LPT (exact insertion for the largest
   and smallest, vectorised rounds for the middle), then a local search moves and swaps them
   off the critical rank. (A rank in a k-rank group waits at its exchanges on all its compute,
   whole sequences included; filling such ranks as slower ones changed the makespan by under
   0.3% either way on 36 realistic 64-GPU steps, and cost a speed class per group size.)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from knapformer.plan.member_comm import route_home_estimate
from knapformer.plan.plan import Plan, build_plan
from knapformer.plan.problem import PlanProblem, sum_by
from knapformer.plan.solvers.blocks import Blocks, block_members
from knapformer.plan.solvers.lpt import lpt_fill
from knapformer.plan.solvers.member_costs import MemberCosts
from knapformer.plan.solvers.refine import local_search, settle_home
from knapformer.plan.solvers.unstack import unstack

__all__ = ["FAST_BLOCKS", "ROUNDS_FROM", "SplitStage", "place"]

FAST_BLOCKS = True
"""Choose blocks from maintained block maxima when every rank is equally fast (:class:`Blocks`);
False gathers every rank's load per sequence (the general path; tests compare the two)."""


ROUNDS_FROM = 512
"""Split sequences beyond this many (costliest first) are placed in batched rounds
(:func:`_rounds`) when every rank is equally fast and no memory cap holds, those whose degree
divides the group; the first ones, and windows of whole nodes, block by block."""


_SLOTS = 4  # slots per block and round of the batched placement


def _split(problem: PlanProblem, degree: np.ndarray, c: np.ndarray, load: np.ndarray, tok: np.ndarray):
    """Step 1 (module docstring), in place on ``load``/``tok``; returns each split sequence's
    first rank (its group: ``degree`` consecutive ranks from there; -1 for whole sequences)
    and the split sequences in the order they were placed, or None when the memory cap leaves
    no block for some sequence."""
    S, n = problem.num_ranks, problem.num_seqs
    speed, cap, L = problem.speed, problem.max_tokens_per_rank, problem.lengths
    first_rank = np.full(n, -1, dtype=np.int64)
    multi = np.flatnonzero(degree > 1)
    multi = multi[np.argsort(-c[multi], kind="stable")]
    home = problem.src_rank
    used = sorted(set(degree[multi].tolist()))
    node = problem.link.gpus_per_node if problem.link is not None else None
    # block maxima need every size to divide the group, or whole nodes of a group of whole nodes
    whole_nodes = node is not None and S % node == 0
    fast = FAST_BLOCKS and (speed == speed[0]).all() and all(S % k == 0 or whole_nodes for k in used)
    blocks = Blocks(S, [1, *used], cap, node) if fast else None
    members_of = {k: block_members(S, k, node) for k in used} if blocks is None else None
    if problem.link is not None:  # the source of a split sequence sends what leaves it
        route = sum_by(home[multi], route_home_estimate(L[multi], degree[multi], problem.model, problem.link), S)
        load += route
        if blocks is not None:
            blocks.add_ranks(route)
    extra = np.zeros(n, dtype=np.int64)  # the pre_attn path's gathered K/V, as tokens
    if problem.kv_gather and cap is not None:
        for k in used:
            at = multi[degree[multi] == k]
            extra[at] = problem.gather_need(L[at], k)
    bulk = np.zeros(0, dtype=np.int64)
    if multi.size > ROUNDS_FROM and cap is None and fast:  # the rest of the aligned ones in rounds
        rest = multi[ROUNDS_FROM:]
        aligned = S % degree[rest] == 0
        multi, bulk = np.concatenate([multi[:ROUNDS_FROM], rest[~aligned]]), rest[aligned]
    for g in multi.tolist():
        k = int(degree[g])
        need = -(-int(L[g]) // k) + int(extra[g])
        if blocks is not None:  # one speed: block maxima kept up to date
            b = blocks.best(k, c[g], need, int(home[g]))
            if b < 0:
                return None
            lo = blocks.first_rank(k, b)
            blocks.add(k, b, c[g], need)
        else:
            B = members_of[k]
            finish = ((load[B] + c[g]) / speed[B]).max(axis=1)
            if cap is not None:
                finish = np.where((tok[B] + need <= cap).all(axis=1), finish, np.inf)
            best = finish.min()
            if not np.isfinite(best):
                return None
            near = np.flatnonzero(finish <= best * (1 + 1e-12))
            at_home = near[(B[near] == home[g]).any(axis=1)]
            b = int(at_home[0] if at_home.size else near[0])
            lo = int(B[b, 0])
        load[lo : lo + k] += c[g]
        tok[lo : lo + k] += need
        first_rank[g] = lo
    if bulk.size:
        _rounds(bulk, degree, c, load, first_rank)
    # (groups are listed in placing order: the rounds place the widest degree first)
    return first_rank, np.concatenate([multi, bulk[np.argsort(-degree[bulk], kind="stable")]])


def _groups(S: int, degree: np.ndarray, first_rank: np.ndarray, order) -> tuple[list[tuple[int, ...]], np.ndarray]:
    """(groups, seq_group) of a placement: every rank alone (whole sequences), then each block
    some split sequence runs on, once, in the order of ``order`` (the split sequences)."""
    groups: list[tuple[int, ...]] = [(r,) for r in range(S)]
    index_of: dict[tuple[int, int], int] = {}
    seq_group = np.zeros(degree.size, dtype=np.int64)
    for g in order.tolist():
        key = (int(first_rank[g]), int(degree[g]))
        if key not in index_of:
            index_of[key] = len(groups)
            groups.append(tuple(range(key[0], key[0] + key[1])))
        seq_group[g] = index_of[key]
    return groups, seq_group


def _rounds(items, degree, c, load, first_rank) -> None:
    """Batched LPT of many split sequences onto aligned blocks, in place: widest degree first;
    per degree, rounds of as many sequences as it has blocks. A block offers ``_SLOTS`` slots
    per round at its busiest member's load plus (j + ½) mean sequences, and the costliest
    sequences take the earliest slots, so a block far behind takes several and one far ahead
    (a video's) none, as :func:`~knapformer.plan.solvers.lpt.lpt_fill` does for whole
    sequences. One sort per round instead of a block search per sequence (8,000 split images
    at 4,096 ranks: 0.3 s -> a few ms); which tokens stay home is left to chance."""
    S = load.size
    for k in sorted(set(degree[items].tolist()), reverse=True):
        mine = items[degree[items] == k]  # (items arrive costliest first)
        blocks = S // k
        view = load.reshape(blocks, k)
        slot_block = np.repeat(np.arange(blocks), _SLOTS)
        slot_j = np.tile(np.arange(_SLOTS) + 0.5, blocks)
        for start in range(0, mine.size, blocks):
            batch = mine[start : start + blocks]
            finish = view.max(axis=1)[slot_block] + slot_j * float(c[batch].mean())
            order = np.lexsort((np.arange(finish.size), finish))[: batch.size]  # earliest slots
            target = slot_block[order]
            np.add.at(view, target, c[batch][:, None])
            first_rank[batch] = target * k


@dataclass(frozen=True)
class SplitStage:
    """A placement after step 1: each sequence's degree and per-member cost, the split ones'
    first ranks and placing order, the ranks' load and tokens. Kept so that the moldable
    planner can unstack its best candidate (:func:`place`'s ``from_stage``) without placing
    the split sequences again."""

    degree: np.ndarray
    c: np.ndarray
    load: np.ndarray
    tok: np.ndarray
    first_rank: np.ndarray
    order: np.ndarray

    def copy(self) -> SplitStage:
        return SplitStage(*(np.array(a, copy=True) for a in dataclasses.astuple(self)))


def place(
    problem: PlanProblem,
    costs: MemberCosts,
    pick: np.ndarray,
    *,
    whole_plan,
    stages: dict | None = None,
    from_stage: SplitStage | None = None,
    unstack_to: float | None = None,
) -> Plan | None:
    """The plan of ``pick`` (each sequence's degree, an index into ``costs.D``; module
    docstring), or None when the memory cap leaves no room. ``whole_plan(problem)``: the plan
    when every sequence stays whole (the one-rank-bags problem, solved by the caller).
    ``stages``: records the step-1 placement (:class:`SplitStage`) under the plan's id.
    ``from_stage`` and ``unstack_to``: start from that stage and move split sequences off
    ranks above this time (:func:`~knapformer.plan.solvers.unstack.unstack`; their degrees
    may change); None when no move was made."""
    S = problem.num_ranks
    if from_stage is not None:
        st = from_stage.copy()
        if unstack_to is None or not unstack(
            problem, costs, st.degree, st.c, st.load, st.tok, st.first_rank, unstack_to
        ):
            return None  # nothing moved: the plan without unstacking, which the caller has
    else:
        degree = np.asarray(costs.D, dtype=np.int64)[pick]
        if not (degree > 1).any():  # every sequence whole: exactly the one-rank-bags problem
            return whole_plan(problem)
        c = costs.member(pick)
        load = np.zeros(S)  # work units per rank (time = load / speed)
        tok = np.zeros(S, dtype=np.int64)
        split = _split(problem, degree, c, load, tok)
        if split is None:
            return None
        st = SplitStage(degree, c, load, tok, *split)
        stage = st.copy() if stages is not None else None
    plan = _finish(problem, st)
    if from_stage is None and plan is not None and stages is not None:
        stages[id(plan)] = stage
    return plan


def _finish(problem: PlanProblem, st: SplitStage) -> Plan | None:
    """Steps 2 and 3 (module docstring) after the split sequences' placement ``st`` (its
    load and tokens are filled in place)."""
    S, n = problem.num_ranks, problem.num_seqs
    degree, load, tok = st.degree, st.load, st.tok
    groups, seq_group = _groups(S, degree, st.first_rank, st.order)
    # whole sequences: LPT over single ranks (the problem's bags are the ranks), then local search
    base_load, base_tok = load.copy(), tok.copy()
    order = problem.by_work
    single = order[degree[order] == 1]  # by decreasing work
    try:
        lpt_fill(problem, single, seq_group, load, tok)
    except ValueError:  # no rank has room under the cap for some sequence
        return None
    movable = degree == 1
    opts = problem.options
    gap = opts.stop_gap if opts.stop_gap is not None else (5e-5 if n <= 2048 else 1e-3)
    iters = opts.max_iters if opts.max_iters is not None else min(2 * S + 200, 1000)
    seq_group = local_search(
        problem,
        seq_group,
        movable=movable,
        base_load=base_load,
        base_tok=base_tok,
        stop_at=max(problem.lower_bound, float(load.sum() / problem.speed.sum())) * (1 + gap),  # balance beats no mean
        max_iters=iters,
    )
    homed = settle_home(problem, seq_group, movable=movable, base_load=base_load, base_tok=base_tok)
    plans = []
    for assignment in (homed, seq_group) if (homed != seq_group).any() else (seq_group,):
        try:
            plans.append(build_plan(problem, assignment, solver="moldable", groups=groups))
        except ValueError:
            continue
        if plans[0].makespan <= plans[-1].makespan * (1 + problem.options.tie_tolerance):
            break  # the homed plan is as fast: no need for the other
    return min(plans, key=lambda p: p.makespan) if plans else None
