"""Moldable planner (layout ``auto``): every step, each sequence's parallel degree and ranks.

A sequence of length L on a k-rank group costs each member ``lin(L/k) + quad(L)/k + per_seq``
plus its share of the Ulysses exchanges (:func:`~knapformer.plan.cost.member_comm_estimate`),
so sharding is free only when communication is. The planner:

1. **Degrees.** For a target makespan T (a multiple α of the moldable lower bound), each
   sequence takes the *smallest* allowed degree whose per-member cost fits under T (else the
   degree with the lowest per-member cost): short sequences stay whole, long ones are split
   just enough.
2. **Groups.** Multi-rank sequences, largest per-member cost first, go to the aligned block of
   k ranks (inside a node, or whole nodes when k exceeds a node; any k consecutive ranks when
   k does not divide a small group) with the earliest finish of its busiest member (ties: a
   block holding the sequence's source rank, then the lowest).
3. **Whole sequences** fill the ranks around them by earliest-finish LPT (exact insertion for
   the largest and smallest, vectorised rounds for the middle) and a local search moves and
   swaps them off the critical rank.

Candidates: α = 1 (and α = 1/8, "split more", for up to 2,048 sequences), and — so that
``auto`` is never worse than a fixed layout the user could have chosen — up to 16 ranks every
bag layout of the allowed sizes (uniform and mixed) planned by the default solver. All are
priced by the same cost function (communication included); the best wins, ties going to
fewer tokens moved but never above the best fixed-layout plan.

``time_budget_s`` buys more candidates (more α, then the uniform layouts' plans at any size),
turned into a *count* at a fixed rate (:data:`CANDIDATES_PER_SECOND`, measured on the
development machine) so that every rank plans the same candidates whatever its clock says: a
plan always returns (the first candidate at once), and more budget can only improve it.
"""

from __future__ import annotations

import itertools
import time

import numpy as np

from knapformer.layout import BagLayout
from knapformer.plan.cost import jitter_factor, member_comm_estimate
from knapformer.plan.plan import Plan, build_plan
from knapformer.plan.problem import PlanProblem
from knapformer.plan.solvers.blocks import Blocks as _Blocks
from knapformer.plan.solvers.common import stamp
from knapformer.plan.solvers.lpt import lpt_fill, solve_lpt
from knapformer.plan.solvers.refine import local_search, settle_home

__all__ = ["CANDIDATES_PER_SECOND", "fixed_layouts", "layout_menu", "solve_moldable"]

ALPHAS = (1.0, 0.125, 0.5, 0.7, 0.25, 1.4, 2.0, 1e-9)
"""Targets tried, as multiples of the lower bound, in this order (1e-9: split as far as the
per-member cost falls)."""
CANDIDATES_PER_SECOND = 40
"""How many α candidates a second of ``time_budget_s`` buys (a 1,024-rank step plans one in
~25 ms on the 2-core development machine)."""
_FIXED_ALL_UP_TO = 16
_FAST_BLOCKS = True
"""Choose blocks from maintained block maxima when every rank is equally fast (:class:`_Blocks`);
False gathers every rank's load per sequence (the general path; tests compare the two)."""
"""Up to this many ranks every fixed bag layout is a candidate; above, the uniform ones."""


def member_costs(problem: PlanProblem) -> tuple[tuple[int, ...], np.ndarray]:
    """(degrees, (|D|, n) per-member cost of each sequence at each degree, in cost units)."""
    D = problem.degrees
    L = problem.lengths
    model, link = problem.model, problem.link
    rows = []
    for k in D:
        r = problem.ring_of(k)
        c = model.chunk_cost(-(-L // k), L, k)
        if link is not None and k > 1:
            c = c * (1.0 + link.sync_jitter * float(jitter_factor(k)))
            c = c + member_comm_estimate(L, k, model, link, cross=k > link.gpus_per_node, ring=r)
        rows.append(np.asarray(c, dtype=np.float64))
    return D, np.stack(rows) if rows else np.zeros((0, problem.num_seqs))


def _blocks(S: int, k: int) -> np.ndarray:
    """(S/k, k) aligned blocks of k consecutive ranks; when k does not divide S (small groups,
    see ``PlanProblem.degrees``) every window of k consecutive ranks, (S - k + 1, k)."""
    if S % k:
        return np.arange(S - k + 1, dtype=np.int64)[:, None] + np.arange(k, dtype=np.int64)
    return np.arange(S, dtype=np.int64).reshape(S // k, k)


def _picks(cost: np.ndarray, target: float) -> np.ndarray:
    """Each sequence's degree (row of ``cost``) for a target makespan: the smallest whose
    per-member cost fits under it, else the cheapest."""
    fits = cost <= target
    return np.where(fits.any(axis=0), fits.argmax(axis=0), cost.argmin(axis=0))


def _balanced_target(problem: PlanProblem, D, cost: np.ndarray, lo: float, hi: float) -> float:
    """The least target T in [lo, hi] at which every sequence's degree (:func:`_picks`) keeps
    the members' total work within what the ranks do in T (bisection; at most ``hi``)."""
    work = cost * np.asarray(D, dtype=np.float64)[:, None]
    cols = np.arange(cost.shape[1])
    capacity = float(problem.speed.sum())

    def fits(t: float) -> bool:
        return float(work[_picks(cost, t), cols].sum()) <= capacity * t

    if fits(lo):
        return lo
    for _ in range(24):
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


def _candidate(problem: PlanProblem, D, cost: np.ndarray, target: float, pick: np.ndarray | None = None) -> Plan | None:
    S, n = problem.num_ranks, problem.num_seqs
    speed = problem.speed
    cap = problem.max_tokens_per_rank
    L = problem.lengths
    pick = _picks(cost, target) if pick is None else pick
    degree = np.asarray(D, dtype=np.int64)[pick]
    if not (degree > 1).any():  # every sequence whole: exactly the one-rank-bags problem
        return _solve_bags(problem, f"g1n{S}")
    c = cost[pick, np.arange(n)]
    load = np.zeros(S)  # work units per rank (time = load / speed)
    tok = np.zeros(S, dtype=np.int64)
    groups: list[tuple[int, ...]] = [(r,) for r in range(S)]
    index_of = {}
    seq_group = np.zeros(n, dtype=np.int64)
    multi = np.flatnonzero(degree > 1)
    multi = multi[np.argsort(-c[multi], kind="stable")]
    home = problem.src_rank
    used = sorted(set(degree[multi].tolist()))
    fast = _FAST_BLOCKS and (speed == speed[0]).all() and all(S % k == 0 for k in used)
    place = _Blocks(S, used, cap) if fast else None
    blocks = {k: _blocks(S, k) for k in used} if place is None else None
    for g in multi.tolist():
        k = int(degree[g])
        need = -(-int(L[g]) // k)
        if place is not None:  # aligned blocks, one speed: block maxima kept up to date
            b = place.best(k, c[g], need, int(home[g]))
            if b < 0:
                return None
            members = tuple(range(b * k, (b + 1) * k))
            place.add(k, b, c[g], need)
        else:
            B = blocks[k]
            finish = ((load[B] + c[g]) / speed[B]).max(axis=1)
            if cap is not None:
                finish = np.where((tok[B] + need <= cap).all(axis=1), finish, np.inf)
            best = finish.min()
            if not np.isfinite(best):
                return None
            near = np.flatnonzero(finish <= best * (1 + 1e-12))
            at_home = near[(B[near] == home[g]).any(axis=1)]
            b = int(at_home[0] if at_home.size else near[0])
            members = tuple(int(r) for r in B[b])
        load[list(members)] += c[g]
        tok[list(members)] += need
        if members not in index_of:
            index_of[members] = len(groups)
            groups.append(members)
        seq_group[g] = index_of[members]
    # whole sequences: LPT over single ranks (the problem's bags are the ranks), then local search
    single = np.flatnonzero(degree == 1)
    single = single[np.argsort(-problem.work[single], kind="stable")]
    base_load, base_tok = load.copy(), tok.copy()
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
        stop_at=max(problem.lower_bound, float(load.sum() / speed.sum())) * (1 + gap),  # balance beats no mean
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


def layout_menu(S: int, sizes) -> list[str]:
    """Uniform layouts, then mixed ones of two or three sizes sharing the ranks in equal shares
    and 3:1 / 1:3 (2:1:1 / 1:1:2): the menu a user picks from (the cluster search uses it too)."""
    specs = [f"g{k}n{S // k}" for k in sizes if S % k == 0]
    shares = {2: [(1, 1), (3, 1), (1, 3)], 3: [(1, 1, 1), (2, 1, 1), (1, 1, 2)]}
    for m in (2, 3):
        for combo in itertools.combinations(sizes, m):
            for share in shares[m]:
                total = sum(share)
                if S % total:
                    continue
                ranks = [S // total * s for s in share]
                if any(r % k for r, k in zip(ranks, combo)):
                    continue
                specs.append("+".join(f"g{k}n{r // k}" for k, r in zip(combo, ranks)))
    return list(dict.fromkeys(specs))


def fixed_layouts(problem: PlanProblem) -> list[str]:
    """Bag layouts of the allowed sizes that divide the group, the layouts a user picks from:
    all of them (uniform and mixed, sizes ascending over contiguous ranks) up to
    ``_FIXED_ALL_UP_TO`` ranks, else the uniform ones. (Mixed layouts with other sizes, e.g.
    g3n1+g4n1 on 7 ranks, would multiply the candidates of a small group's step: measured
    5 -> 72 ms on 7 ranks with 24 heads.)"""
    S = problem.num_ranks
    D = [k for k in problem.degrees if S % k == 0]  # (sizes that do not divide S: α candidates only)
    uniform = [f"g{k}n{S // k}" for k in D]
    if S > _FIXED_ALL_UP_TO:
        return uniform
    out = []
    for counts in itertools.product(*[range(S // k + 1) for k in D]):
        if sum(k * c for k, c in zip(D, counts)) == S:
            out.append("+".join(f"g{k}n{c}" for k, c in zip(D, counts) if c))
    return out


def _solve_bags(problem: PlanProblem, spec: str) -> Plan | None:
    """The default solver's plan of ``problem`` under the bag layout ``spec`` (None if the cap
    cannot be met), with the moldable problem's bound and name."""
    sub = PlanProblem(
        seq_lens=problem.seq_lens,
        layout=BagLayout(tuple((k, n) for k, n in _terms(spec))),
        model=problem.model,
        max_tokens_per_rank=problem.max_tokens_per_rank,
        rank_speed=problem.rank_speed,
        options=problem.options,
        link=problem.link,
    )
    try:
        plan = solve_lpt(sub)
    except ValueError:  # the cap cannot be met under this layout
        return None
    object.__setattr__(plan, "lower_bound", problem.lower_bound)
    object.__setattr__(plan, "solver", "moldable")
    return plan


def _fixed_candidates(problem: PlanProblem, specs: list[str]) -> list[Plan]:
    return [p for spec in specs if (p := _solve_bags(problem, spec)) is not None]


def _fits(problem: PlanProblem, spec: str) -> bool:
    """No bag of ``spec`` straddles a node (with a link model; bags are contiguous)."""
    if problem.link is None:
        return True
    gpn, start = problem.link.gpus_per_node, 0
    for k, n in _terms(spec):
        for _ in range(n):
            if start // gpn != (start + k - 1) // gpn:
                return False
            start += k
    return True


def _terms(spec: str):
    for term in spec.split("+"):
        g, n = term[1:].split("n")
        yield int(g), int(n)


def solve_moldable(problem: PlanProblem, *, time_budget_s: float | None = None) -> Plan:
    """Best of the moldable candidates and the fixed-layout plans (module docstring)."""
    t0 = time.perf_counter()
    if not problem.auto:
        raise ValueError("the moldable solver plans layout 'auto'; bag layouts use 'lpt', 'paper' or 'exact'")
    problem.check_capacity()
    n = problem.num_seqs
    if n == 0:
        return stamp(build_plan(problem, np.zeros(0, dtype=np.int64), solver="moldable"), t0)
    D, cost = member_costs(problem)
    lb = problem.lower_bound
    # the work to do, as a count (identical on every rank): α candidates, then uniform layouts
    extra = 0 if time_budget_s is None else int(time_budget_s * CANDIDATES_PER_SECOND)
    n_alpha = min(len(ALPHAS), (2 if n <= 2048 else 1) + extra)
    fixed = fixed_layouts(problem) if problem.num_ranks <= _FIXED_ALL_UP_TO else []
    if extra and problem.num_ranks > _FIXED_ALL_UP_TO:  # budget left after the α: the layout menu
        menu = [s for s in layout_menu(problem.num_ranks, [k for k in D]) if _fits(problem, s)]
        fixed += menu[: max(0, extra - (n_alpha - 1))]
    # degrees Ulysses runs alone (no ring): the "split more" α candidates stay within them (a
    # ring's estimate is the least certain), and when α = 1 chose a ring, its Ulysses-only twin
    plain = [i for i, k in enumerate(D) if problem.ring_of(k) == 1]
    Dp, cost_p = tuple(D[i] for i in plain), cost[plain]
    first = _picks(cost, lb * ALPHAS[0])
    runs = [(D, cost, lb * ALPHAS[0])] + [(Dp, cost_p, lb * a) for a in ALPHAS[1:n_alpha]]
    ringed = len(plain) < len(D) and not np.isin(first, plain).all()
    if ringed and n <= 2048:  # a sequence wants a ring: its Ulysses-only twin, and rings as wide as pays
        runs += [(Dp, cost_p, lb * ALPHAS[0]), (D, cost, lb * ALPHAS[1])]
    candidates = [p for d, c, t in runs if (p := _candidate(problem, d, c, t)) is not None]
    candidates += _fixed_candidates(problem, fixed)
    reached = min((p.makespan for p in candidates), default=np.inf)
    unfit = not (cost <= lb * ALPHAS[0]).any(axis=0).all()
    if unfit and np.isfinite(reached) and reached > lb * (1 + problem.options.tie_tolerance):
        # a sequence no degree fitted under the bound took its cheapest, often the widest: split
        # each only as far as a makespan needs — the least whose members' total work fits the
        # ranks (the allotment of moldable scheduling), and the makespan already reached
        tried = [first]
        for target in (_balanced_target(problem, D, cost, lb, reached), reached):
            picks = _picks(cost, target)
            if any((picks == t).all() for t in tried):
                continue
            tried.append(picks)
            if (p := _candidate(problem, D, cost, target)) is not None:
                candidates.append(p)
    if ringed:  # the published hybrid-CP allotment at caps around the longest sequence's degree
        from knapformer.plan.solvers.hybrid_cp import hybrid_cp_caps, hybrid_cp_plan

        widest = int(np.asarray(D)[first[int(np.argmax(problem.lengths))]])
        for c in hybrid_cp_caps(problem, widest)[: 3 if n <= 2048 else 1]:
            if (p := hybrid_cp_plan(problem, c)) is not None:
                object.__setattr__(p, "solver", "moldable")
                candidates.append(p)
        reached = min((p.makespan for p in candidates), default=np.inf)
    # every sequence whole at home (nothing moves, nothing priced but compute: its makespan is
    # the unbalanced time): auto is never predicted slower than that; built only when it can win
    if float(problem.time_before.max()) <= reached * (1 + 2 * problem.options.tie_tolerance):
        try:
            candidates.append(build_plan(problem, np.arange(problem.num_ranks)[problem.src_rank], solver="moldable"))
        except ValueError:  # home breaks the memory cap
            pass
    if not candidates:
        raise ValueError(
            f"no plan found under max_tokens_per_rank={problem.max_tokens_per_rank} with groups of sizes {list(D)}"
        )
    tol = problem.options.tie_tolerance
    best = min(p.makespan for p in candidates)
    ceiling = min((p.makespan for p in candidates if p.is_partition and p is not None), default=np.inf)
    tied = [p for p in candidates if p.makespan <= min(best * (1 + tol), ceiling)]  # never above a fixed layout
    return stamp(min(tied, key=lambda p: (p.tokens_moved, p.makespan)), t0)
