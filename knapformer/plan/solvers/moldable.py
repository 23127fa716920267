"""Moldable planner (layout ``auto``): every step, each sequence's parallel degree and ranks.

A sequence of length L on a k-rank group costs each member ``lin(L/k) + quad(L)/k + per_seq``
plus its share of the Ulysses exchanges (:func:`~knapformer.plan.member_comm.member_comm_estimate`),
so sharding is free only when communication is. The planner:

1. **Degrees.** For a target makespan T (a multiple α of the moldable lower bound), each
   sequence takes the *smallest* allowed degree whose per-member cost fits under T (else the
   degree with the lowest per-member cost): short sequences stay whole, long ones are split
   just enough. Up to 2,048 sequences, also the fitting degree whose members' total is least:
   a group wider than a node run as one Ulysses group pays all its exchange at the slower
   link and can cost more in all than a wider ring (Wan's 40 heads on 40 ranks against 6
   rings of 8 on 48); when either choice wants a ring, the ring candidates below are tried.
2. **Groups.** Multi-rank sequences, largest per-member cost first, go to the block of k
   ranks (aligned inside a node; beyond a node any k/n consecutive whole nodes, so 176 ranks
   fit anywhere on 1,024; any k consecutive ranks when k does not divide a small group
   without a link model) with the earliest finish of its busiest member (ties: a block
   holding the sequence's source rank, then the lowest). The source rank of each split
   sequence is first charged for sending what leaves it (route and reverse,
   :func:`~knapformer.plan.member_comm.route_home_estimate`): a 250k-token video's source sends
   ~1.5 GB, and without the charge the images filled it up like any other rank.
3. **Whole sequences** fill the ranks around them by earliest-finish LPT (exact insertion for
   the largest and smallest, vectorised rounds for the middle) and a local search moves and
   swaps them off the critical rank.

Candidates, all priced by the same cost function (exchanges and sync waits included); the
best wins, ties going to fewer tokens moved but never above the best bag-layout plan:

- α = 1: the degree picks at the bound (steps 1–3), and, when that packs the ranks more than
  :data:`_LOOSE` unevenly, α = 1/8 ("split more", Ulysses degrees only) up to 2,048 sequences;
- when that packs the ranks more than :data:`_LOOSE` unevenly: without rings, the menu
  layouts whose bag shares match the α = 1 degrees (:func:`matched_layouts`), and then, if
  the best is still more than :data:`_FINE_ABOVE` above the bound, the *fine* candidate —
  inside a node, split every sequence whose whole cost exceeds :data:`_FINE` of the bound,
  keep the rest whole. On realistic image + video steps the α = 1 picks left split
  chunks of 50–95% of the target (two cannot share a rank; whole sequences near the target
  then found no empty rank, and local search moves only whole sequences): 1.1–1.36× the
  bound where static Ulysses-8 reached 1.04×. The fine candidate splits what must be split
  finely enough to pack, and keeps the small sequences off the exchanges;
- when a sequence needs a ring: its Ulysses-only twin, rings as wide as α = 1/8 pays, a finer
  split of the sequences inside nodes (while the best is over :data:`_FINE_ABOVE` above the
  bound), and the published hybrid-CP allotment (up to 2,048 sequences);
- the uniform layouts a team configures by hand (``g{k}n{S/k}``, :mod:`.uniform`), each
  planned by the default solver only while its lower bound says it can still beat the best
  plan by more than 0.3% — so ``auto`` is never predicted more than that (and the quicker
  LPT's difference, under 0.1% on the benchmark mixes) above any of them; up to 16 ranks every
  bag layout of the allowed sizes (uniform and mixed);
- every sequence at home, when that can win;
- up to 2,048 sequences, the runs above again with the least-total degrees that fit, where
  they differ from the smallest (step 1);
- when the best is still more than :data:`_UNSTACK_ABOVE` above the bound and a moldable
  candidate: that one placed again with its split sequences moved off the busiest ranks
  (:mod:`~knapformer.plan.solvers.unstack`; long-tailed 512-GPU steps stacked two 300k-token
  rings on one block: 1.13× the bound, 1.04× after).

Cost: sequences are priced only at the degrees a target can pick (:class:`MemberCosts`) and
every degree in one broadcast, so a step of 131k sequences on 4,096 ranks (515 allowed
degrees) plans in ~130 ms on the 2-core development machine (``benchmarks/planner_scale.py``).

``time_budget_s`` buys more candidates (more α, then the uniform layouts' plans at any size),
turned into a *count* at a fixed rate (:data:`CANDIDATES_PER_SECOND`, measured on the
development machine) so that every rank plans the same candidates whatever its clock says: a
plan always returns (the first candidate at once), and more budget can only improve it.
"""

from __future__ import annotations

import time

import numpy as np

from knapformer.plan.plan import Plan, build_plan
from knapformer.plan.problem import PlanProblem
from knapformer.plan.solvers.common import stamp
from knapformer.plan.solvers.lpt import EXACT_ITEMS, HEAP_ITEMS
from knapformer.plan.solvers.member_costs import MemberCosts, balanced_target, member_costs
from knapformer.plan.solvers.menu import (
    FIXED_ALL_UP_TO,
    fits_nodes,
    fixed_layouts,
    layout_menu,
    matched_layouts,
)
from knapformer.plan.solvers.placement import SplitStage, place
from knapformer.plan.solvers.uniform import QUICK_ITERS, solve_bags, uniform_candidates

__all__ = [
    "CANDIDATES_PER_SECOND",
    "MemberCosts",
    "fixed_layouts",
    "layout_menu",
    "matched_layouts",
    "member_costs",
    "solve_moldable",
]

ALPHAS = (1.0, 0.125, 0.5, 0.7, 0.25, 1.4, 2.0, 1e-9)
"""Targets tried, as multiples of the lower bound, in this order (1e-9: split as far as the
per-member cost falls, within a node)."""
CANDIDATES_PER_SECOND = 40
"""How many α candidates a second of ``time_budget_s`` buys (a 1,024-rank step plans one in
~25 ms on the 2-core development machine)."""
_LOOSE = 0.02
"""Above this imbalance (max/mean − 1 of predicted rank times) of the best moldable candidate,
the bag layouts matching its shares (:func:`matched_layouts`) are planned too: coarse mixes
leave the whole-sequence packing slack a bag layout avoids (paper-joint: 6%); fine-grained
steps balance within 1% and skip the extra solve (≥ 100 ms at 32k sequences). When a
sequence needs a ring (no bag layout holds it), the loose candidate is planned again with the
sequences that run inside a node split as for a target of :data:`_FINER` × the bound."""
_FINER = 0.25
"""Images of 4k tokens (~⅓ of the bound each) beside videos on ring groups of 1,024 ranks left
ranks with three of them at 1.10× the bound; split for a quarter of it: 1.08×."""
_UNSTACK_ABOVE = 0.04
"""When the best candidate is more than this above the bound, the best moldable one is placed
again with its split sequences unstacked (:mod:`~knapformer.plan.solvers.unstack`)."""
_FINE_ABOVE = 0.045
"""The fine candidate (and, beside rings, the finer split inside nodes) is planned only while
the best so far (the matched layouts included) is more than this above the bound: on the
paper's joint mix the matched layout reached 1.041–1.045× and the fine one lost (1.06×) in
13% of the planning time; on the realistic mix skipping it moved one step of twelve by 0.09%;
on long-tailed 4,096-GPU steps the fine one reached 1.02× and the finer split lost (1.15–1.2×)
in a third of the time."""
_FINE = 1 / 32
"""The fine candidate splits, inside a node, every sequence whose whole cost exceeds this share
of the bound (module docstring)."""


def _candidate(
    problem: PlanProblem,
    costs: MemberCosts,
    pick: np.ndarray | None,
    stages: dict | None = None,
    from_stage: SplitStage | None = None,
    unstack_to: float | None = None,
) -> Plan | None:
    """The plan of ``pick`` (:func:`~knapformer.plan.solvers.placement.place`); ``stages``
    records its split placement under the plan's id, for :data:`_UNSTACK_ABOVE`, which
    starts ``from_stage``."""
    if problem.num_seqs > EXACT_ITEMS:  # every sequence whole, many: one-rank bags, quickly
        whole = lambda p: solve_bags(p, f"g1n{p.num_ranks}", quick=True, max_iters=QUICK_ITERS)  # noqa: E731
    else:
        whole = lambda p: solve_bags(p, f"g1n{p.num_ranks}")  # noqa: E731
    return place(problem, costs, pick, whole_plan=whole, stages=stages, from_stage=from_stage, unstack_to=unstack_to)


def _fixed_candidates(problem: PlanProblem, specs: list[str], **kw) -> list[Plan]:
    return [p for spec in specs if (p := solve_bags(problem, spec, **kw)) is not None]


def _fine_picks(problem: PlanProblem, costs: MemberCosts, lb: float, first: np.ndarray, node: int) -> np.ndarray:
    """Each sequence's degree for the fine candidate: the smallest Ulysses degree inside a node
    whose per-member cost fits :data:`_FINE` × the bound (else the cheapest inside a node), and
    the plain α = 1 pick (``first``) for a sequence no degree inside a node fits under the bound."""
    D = np.asarray(costs.D)
    inside = (D <= node) & np.array([problem.ring_of(int(k)) == 1 for k in D])
    fine = costs.picks(lb * _FINE, inside)
    return np.where(costs.member(fine) <= lb, fine, first)


def solve_moldable(problem: PlanProblem, *, time_budget_s: float | None = None) -> Plan:
    """Best of the moldable candidates and the fixed-layout plans (module docstring)."""
    t0 = time.perf_counter()
    if not problem.auto:
        raise ValueError("the moldable solver plans layout 'auto'; bag layouts use 'lpt', 'paper' or 'exact'")
    problem.check_capacity()
    n = problem.num_seqs
    if n == 0:
        return stamp(build_plan(problem, np.zeros(0, dtype=np.int64), solver="moldable"), t0)
    lb = problem.steady_bound  # the degree targets' base (PlanProblem.steady_bound)
    # the work to do, as a count (identical on every rank): α candidates, then uniform layouts
    extra = 0 if time_budget_s is None else int(time_budget_s * CANDIDATES_PER_SECOND)
    n_alpha = min(len(ALPHAS), (2 if n <= 2048 else 1) + extra)
    # price each sequence only at the degrees a target the runs below try can pick (targets
    # with every degree: the α, 1/8 when a ring is wanted, then at least the bound; inside a
    # node: _FINER, _FINE)
    floor = lb * min(*ALPHAS[:n_alpha], _FINER, _FINE)
    costs = member_costs(problem, floor, lb * min(ALPHAS[:n_alpha]))
    D = costs.D
    fixed = fixed_layouts(problem) if problem.num_ranks <= FIXED_ALL_UP_TO else []
    if extra and problem.num_ranks > FIXED_ALL_UP_TO:  # budget left after the α: the layout menu
        sizes = [k for k in D if problem.num_ranks % k == 0]
        menu = [s for s in layout_menu(problem.num_ranks, sizes) if fits_nodes(problem, s)]
        fixed += menu[: max(0, extra - (n_alpha - 1))]
    # degrees Ulysses runs alone (no ring): the "split more" α candidates stay within them (a
    # ring's estimate is the least certain), and when α = 1 chose a ring, its Ulysses-only twin
    plain = np.array([problem.ring_of(k) == 1 for k in D])
    node = problem.link.gpus_per_node if problem.link is not None else problem.num_ranks
    # targets below 1/8 of the bound keep inside a node: beyond it only sequences above that
    # are priced (MemberCosts), so wider picks there would differ from a dense pricing
    in_node = plain & (np.asarray(D) <= node)
    first = costs.picks(lb * ALPHAS[0])
    # α = 1/8 by default only when α = 1 packs loosely (a fine-grained step does not need it)
    later = n_alpha == 2 and not extra
    alphas = ALPHAS[1 : 1 if later else n_alpha]
    runs = [(None, lb * ALPHAS[0])] + [(plain if a >= ALPHAS[1] else in_node, lb * a) for a in alphas]
    # (the least-total degrees can want a ring where the smallest do not: Wan-14B's 40-rank
    # Ulysses group against 6 rings of 8 on 48 ranks)
    lean = n <= 2048  # (on more sequences each candidate costs ~0.1 s at 4,096 ranks)
    least_first = costs.picks(lb * ALPHAS[0], least_total=True) if lean else first
    ringed = not bool(plain[first].all() and plain[least_first].all())
    if ringed and n_alpha < 2:  # the ring runs below pick beyond a node for targets down to α = 1/8
        costs = member_costs(problem, floor, lb * min(ALPHAS[:2]))
    if ringed and n <= 2048:  # a sequence wants a ring: its Ulysses-only twin, and rings as wide as pays
        runs += [(plain, lb * ALPHAS[0]), (None, lb * ALPHAS[1])]
    picks = [costs.picks(t, allow) for allow, t in runs]
    stages: dict[int, SplitStage] = {}  # each moldable candidate's split placement, by plan id
    # where a wider degree costs less in all than the smallest that fits (a group wider than a
    # node run as one Ulysses group, beside a wider ring): the runs again with the least-total
    # degrees, up to 2,048 sequences
    for i, (allow, t) in enumerate(runs if lean else ()):
        # (the α = 1 run's: priced above; lean means at most 2,048 sequences, so costs were not re-priced)
        least = least_first if i == 0 else costs.picks(t, allow, least_total=True)
        if not any((least == q).all() for q in picks):
            picks.append(least)
    candidates = [p for pick in picks if (p := _candidate(problem, costs, pick, stages)) is not None]
    loose = bool(candidates) and min(candidates, key=lambda p: p.makespan).imbalance_after > _LOOSE
    if later and (loose or not candidates):
        picks.append(costs.picks(lb * ALPHAS[1], plain))
        if not any((picks[-1] == q).all() for q in picks[:-1]):
            if (p := _candidate(problem, costs, picks[-1], stages)) is not None:
                candidates.append(p)
        loose = bool(candidates) and min(candidates, key=lambda p: p.makespan).imbalance_after > _LOOSE
    candidates += _fixed_candidates(problem, fixed)
    if loose and not ringed and problem.num_ranks > FIXED_ALL_UP_TO:  # the layout a user would pick
        matched = [s for s in matched_layouts(problem, costs, first, 2 if n <= 2048 else 1) if s not in fixed]
        candidates += _fixed_candidates(problem, matched, quick=n > 2048, max_iters=100 if n > HEAP_ITEMS else None)
    far = min((p.makespan for p in candidates), default=np.inf) > problem.lower_bound * (1 + _FINE_ABOVE)
    fine = _fine_picks(problem, costs, lb, first, node) if loose and far else None
    if fine is not None and not any((fine == p).all() for p in picks):
        if (p := _candidate(problem, costs, fine, stages)) is not None:
            candidates.append(p)
    far = min((p.makespan for p in candidates), default=np.inf) > problem.lower_bound * (1 + _FINE_ABOVE)
    if loose and ringed and far:  # coarse whole sequences beside ring groups: split them finer inside nodes
        Darr = np.asarray(D)
        finer = costs.picks(lb * _FINER)
        mixed = np.where((Darr[first] <= node) & (Darr[finer] <= node), finer, first)
        if (mixed != first).any() and (p := _candidate(problem, costs, mixed, stages)) is not None:
            candidates.append(p)
    reached = min((p.makespan for p in candidates), default=np.inf)
    unfit = not costs.all_fit(lb * ALPHAS[0])
    if unfit and np.isfinite(reached) and reached > lb * (1 + problem.options.tie_tolerance):
        # a sequence no degree fitted under the bound took its cheapest, often the widest: split
        # each only as far as a makespan needs — the least whose members' total work fits the
        # ranks (the allotment of moldable scheduling), and the makespan already reached
        tried = [first]
        for target in (balanced_target(problem, costs, lb, reached), reached):
            picks = costs.picks(target)
            if any((picks == t).all() for t in tried):
                continue
            tried.append(picks)
            if (p := _candidate(problem, costs, picks, stages)) is not None:
                candidates.append(p)
    if ringed and n <= 2048:  # the published hybrid-CP allotment at caps around the longest's degree
        from knapformer.plan.solvers.hybrid_cp import hybrid_cp_caps, hybrid_cp_plan

        widest = int(np.asarray(D)[first[int(np.argmax(problem.lengths))]])
        for c in hybrid_cp_caps(problem, widest):
            if (p := hybrid_cp_plan(problem, c)) is not None:
                object.__setattr__(p, "solver", "moldable")
                candidates.append(p)
    reached = min((p.makespan for p in candidates), default=np.inf)
    moldable = [p for p in candidates if id(p) in stages]  # (the candidates hold their plans alive)
    mine = min(moldable, key=lambda p: p.makespan) if moldable else None
    if mine is not None and mine.makespan <= reached and reached > problem.lower_bound * (1 + _UNSTACK_ABOVE):
        # far from the bound, and no bag layout did better: the best moldable candidate again,
        # its split sequences unstacked
        if (
            p := _candidate(problem, costs, None, from_stage=stages[id(mine)], unstack_to=problem.lower_bound)
        ) is not None:
            candidates.append(p)
            reached = min(reached, p.makespan)
    if problem.num_ranks > FIXED_ALL_UP_TO:  # the uniform layouts that can still win (their bounds)
        done = {len(p.groups[0]) for p in candidates if p.is_partition and len({len(g) for g in p.groups}) == 1}
        candidates += uniform_candidates(problem, reached, quick=n > 256, skip=done)
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
    peak_tol = problem.options.peak_tolerance if problem.max_tokens_per_rank is None else None
    if peak_tol is not None:
        peak = {id(p): int(p.memory_per_rank().max(initial=0)) for p in candidates}  # (once each)
        candidates = _within_peak(problem, candidates, peak)
    best = min(p.makespan for p in candidates)
    ceiling = min((p.makespan for p in candidates if p.is_partition and p is not None), default=np.inf)
    if peak_tol is not None and peak_tol > tol:
        near = [p for p in candidates if p.makespan <= min(best * (1 + peak_tol), ceiling)]
        least = min(peak[id(p)] for p in near)
        candidates = [p for p in near if peak[id(p)] == least]
        best = min(p.makespan for p in candidates)
    tied = [p for p in candidates if p.makespan <= min(best * (1 + tol), ceiling)]  # never above a fixed layout
    return stamp(min(tied, key=lambda p: (p.tokens_moved, p.makespan)), t0)


def _within_peak(problem: PlanProblem, candidates: list[Plan], peak: dict[int, int]) -> list[Plan]:
    """The candidates that hold on no rank more than the most any rank loaded, or than the
    fastest fixed-layout candidate holds (``SolverOptions.peak_tolerance``): time alone
    concentrates tokens (short sequences cost less per token, so a fast rank fills with them),
    and the activation memory of the busiest rank is what a GPU must fit. The fastest fixed
    layout is within its own bound, so some candidate always is when one was planned.
    ``peak``: each candidate's busiest rank's tokens, by ``id``."""
    loaded = max((sum(r) for r in problem.seq_lens), default=0)
    fixed = [p for p in candidates if p.is_partition]
    ref = loaded
    if fixed:
        fastest = min(fixed, key=lambda p: (p.makespan, p.tokens_moved))
        ref = max(ref, peak[id(fastest)])
    kept = [p for p in candidates if peak[id(p)] <= ref]
    return kept or candidates
