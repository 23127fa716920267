"""Bag layouts as candidates of ``auto``: the uniform ones a team would configure by hand.

A team that does not balance per sequence runs every rank in k-rank groups (``g{k}n{S/k}``,
Ulysses inside a node, a ring of Ulysses sub-groups beyond). ``auto`` may run any such plan,
so it must never be predicted slower than the best of them: :func:`uniform_candidates` plans
them with the default bag solver (``lpt``), priced by the same cost function as every other
candidate.

Planning every uniform layout each step would cost more than ``auto``'s own candidates at
thousands of ranks. Each layout first gets a lower bound of what any plan of it can reach
(:func:`uniform_bound`, O(n)): its busiest possible chunk, and all the work its groups must do
— compute, the sync jitter every member of a k-rank group waits, the least Ulysses and ring
exchanges — over the ranks. Layouts are planned cheapest bound first, and only while the bound
is below the best makespan found so far: what a layout cannot beat is not planned, and
``auto`` stays no slower than every uniform layout either way.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from knapformer.layout import BagLayout
from knapformer.plan.bound import size_costs
from knapformer.plan.cost import jitter_factor
from knapformer.plan.member_comm import split_total_lower, ulysses_member
from knapformer.plan.plan import Plan, build_plan
from knapformer.plan.problem import PlanProblem
from knapformer.plan.solvers.lpt import lpt_assignment, solve_lpt
from knapformer.plan.solvers.menu import spec_terms
from knapformer.plan.solvers.refine import local_search, relabel_for_locality, settle_home

__all__ = [
    "QUICK_ITERS",
    "UNIFORM_NODES",
    "UNIFORM_SLACK",
    "solve_bags",
    "uniform_bound",
    "uniform_candidates",
    "uniform_sizes",
]

UNIFORM_NODES = 8
"""The widest uniform layout tried: rings over up to this many nodes (a team's static context
parallelism; every sequence cut into 2k zigzag chunks on a 512-rank ring took 14 s and then
the memory of a 4,096-rank plan)."""
UNIFORM_SLACK = 0.003
"""A uniform layout whose bound is within this of the best plan so far is not planned: no plan
of it can beat that one by more (``auto`` promises at most 0.5% above every uniform layout:
this, the quick LPT's difference from ``lpt``'s full one — under 0.1% on the benchmark mixes
— and the tie tolerance). 0.2% planned g4 on the paper's joint mix at 4,096 ranks, whose
bound is 0.25% under the best plan and whose plan 1.2% above it: 77 of 290 ms."""
QUICK_ITERS = 300
"""Local-search iterations of a quick uniform plan (the default is the bags + 100: 4,196 on
4,096 one-rank bags, ~0.3 ms each)."""


def uniform_sizes(problem: PlanProblem) -> list[int]:
    """Group sizes k whose uniform layout ``g{k}n{S/k}`` ``auto`` may run: its allowed degrees
    (heads, nodes, ``max_degree``) that divide the group, bags inside a node or on up to
    :data:`UNIFORM_NODES` whole nodes."""
    S = problem.num_ranks
    node = problem.link.gpus_per_node if problem.link is not None else S
    widest = max(node, UNIFORM_NODES * node)
    # bags inside a node, or of whole nodes (consecutive from rank 0, so never part of one):
    # ``fits_nodes`` refuses any bag wider than a node, which left the ring layouts out
    return [k for k in problem.degrees if S % k == 0 and k <= widest and (node % k == 0 or k % node == 0)]


def uniform_bound(problem: PlanProblem, k: int, ceiling: float = np.inf) -> float:
    """A makespan no plan of the layout ``g{k}n{S/k}`` can beat under the problem's cost function
    (module docstring): the longest sequence's busiest member, all members' work over the
    ranks (:func:`_total_work`), and :func:`_pigeonhole` over the costliest sequences. Stops
    early (returning at least ``ceiling``) once one part reaches it. O(n) in a few reductions
    plus O(S/k): 131k sequences on 4,096 ranks bound five layouts in a few ms."""
    L = problem.lengths
    if L.size == 0:
        return 0.0
    S, capacity, fastest = problem.num_ranks, float(problem.speed.sum()), float(problem.speed.max())
    exposed = problem.ring_of(k) == 1  # (a ring's per-sequence exposure is no bound of a plan's)
    order = problem.by_work  # costliest first (the per-sequence parts all grow with L)
    per, _ = size_costs(problem, [k], L[order[:1]], fastest, exposed=exposed)
    best = float(per.max())
    if best >= ceiling:
        return best
    best = max(best, _total_work(problem, k) / capacity + _latency_floor(problem, k))
    if best >= ceiling:
        return best
    B = S // k
    top = order[: min(L.size, 3 * B + 1)]
    if top.size > B:
        _, total = size_costs(problem, [k], L[top], fastest, exposed=exposed)
        best = max(best, _pigeonhole(total[0] / k, B) / fastest)
    return best


def _pigeonhole(share: np.ndarray, bags: int) -> float:
    """Among the j·B + 1 costliest sequences some bag of B holds j + 1, so its members' mean load
    is at least (j + 1) × the (j·B + 1)-th largest mean share (j = 1, 2, 3): coarse sequences
    (4 images of 2,048² per rank) pack no better than that, however the fluid level looks."""
    top = min(share.size, 3 * bags + 1)
    if top <= bags:
        return 0.0
    s = -np.sort(-share[:top])
    return max((j + 1) * float(s[j * bags]) for j in range(1, 4) if j * bags < top)


def _latency_floor(problem: PlanProblem, k: int) -> float:
    """What every rank of a bag holding anything pays per layer in its Ulysses exchanges'
    latency (cost units): in ``g{k}n{S/k}`` each member of a non-empty bag sends or receives
    in every pass of both exchanges, at the slower link's latency when its sub-group crosses
    nodes (how the cost model prices it). An empty bag's ranks do nothing, so with
    Σ_busy speed·(T − floor) ≥ all work, T ≥ floor + all work / all speed holds either way;
    the per-sequence volumes leave latency out (:func:`_total_work`). On the paper's joint mix
    it is 0.2% of the step: what the bound of g4 lacked to prove it cannot win."""
    link = problem.link
    u = k // problem.ring_of(k)
    if link is None or u == 1:
        return 0.0
    gpn = link.gpus_per_node
    if u > gpn:  # a sub-group wider than a node crosses nodes: priced at the slower link
        latency = link.inter_latency
    elif gpn % u == 0:  # aligned inside a node
        latency = link.intra_latency
    else:  # some sub-groups straddle two nodes: the lesser latency is what all pay at least
        latency = min(link.intra_latency, link.inter_latency)
    return 2 * link.exchange_passes * latency * link.units_per_second


def _total_work(problem: PlanProblem, k: int) -> float:
    """A lower bound on Σ over sequences of :func:`~knapformer.plan.bound.size_costs`' total at
    size k (ring exposure left out), from ΣL, Σ⌈L/k⌉ and Σwork: the exchanges' lower figures are
    linear in L − ⌈L/k⌉ and L (a ring block's L/r − ⌈L/k⌉ for its sub-group), so their
    coefficients come from the per-sequence functions at two lengths."""
    model, link = problem.model, problem.link
    n, work = problem.num_seqs, float(problem.work.sum())
    if k == 1:
        return work
    work += (k - 1) * model.per_seq_coef * n
    if link is None:
        return work
    r = problem.ring_of(k)
    u = k // r
    L = problem.lengths
    s1, s2 = float(L.sum()), float((-(-L // k)).sum())
    big = float(k) * 1e6  # a multiple of k and u: no rounding in the coefficients
    slope = ulysses_member(np.array([big / r]), u, model, link, u > link.gpus_per_node, lower=True)[0]
    ulysses = k * slope / (big / r - big / k) * (s1 / r - s2) if u > 1 else 0.0
    one, far = split_total_lower(np.array([1.0, big]), k, model, link, ring=r)
    split = (far - one * big) / (big - big / k) * (s1 - s2) + one * s1
    wait = 1.0 + link.sync_jitter * float(jitter_factor(k))
    return work * wait + (max(ulysses, 0.0) + split) * float(problem.speed.min())


def solve_bags(problem: PlanProblem, spec: str, *, quick: bool = False, max_iters: int | None = None) -> Plan | None:
    """The default bag solver's plan of ``problem``'s sequences under the bag layout ``spec``
    (None if the cap cannot be met), with the ``auto`` problem's bound and the name
    ``moldable``. ``quick``: its LPT start alone (:func:`_lpt_once`, without a memory cap);
    ``max_iters``: local-search iterations when the options name none (on the paper's joint
    mix at 4,096 ranks a matched layout reached 1.0652× the bound in 139 ms with 100 where the
    default 2,148 reach 1.0637× in 216 ms)."""
    options = problem.options
    if max_iters is not None and options.max_iters is None:
        options = dataclasses.replace(options, max_iters=max_iters)
    sub = PlanProblem(
        seq_lens=problem.seq_lens,
        layout=BagLayout(tuple(spec_terms(spec))),
        model=problem.model,
        max_tokens_per_rank=problem.max_tokens_per_rank,
        rank_speed=problem.rank_speed,
        options=options,
        link=problem.link,
        kv_gather=problem.kv_gather,
    )
    try:
        plan = _lpt_once(sub) if quick and sub.max_tokens_per_rank is None else solve_lpt(sub)
    except ValueError:  # the cap cannot be met under this layout
        return None
    object.__setattr__(plan, "lower_bound", problem.lower_bound)
    object.__setattr__(plan, "solver", "moldable")
    return plan


def _lpt_once(problem: PlanProblem) -> Plan:
    """``lpt``'s plan from its LPT start alone (no "home" or paper start, no branch and bound):
    on uniform layouts of hundreds of ranks the other starts cost two thirds of its time and
    left the makespan within 0.1% of it on the benchmark mixes."""
    opts = problem.options
    iters = opts.max_iters if opts.max_iters is not None else len(problem.bags) + 100
    gap = opts.stop_gap if opts.stop_gap is not None else (5e-5 if problem.num_seqs <= 2048 else 5e-4)
    start = lpt_assignment(problem)
    polished = local_search(problem, start, stop_at=problem.lower_bound * (1 + gap), max_iters=iters)
    polished = settle_home(problem, relabel_for_locality(problem, polished))
    return build_plan(problem, polished, solver="lpt")


def uniform_candidates(problem: PlanProblem, best: float, *, quick: bool = False, skip=()) -> list[Plan]:
    """The plans of the uniform layouts that can beat ``best`` by more than
    :data:`UNIFORM_SLACK` (module docstring), cheapest bound first; a plan that beats it lowers
    the bar for the next. ``quick``: the LPT start alone, at most :data:`QUICK_ITERS`
    local-search iterations; ``skip``: sizes already planned."""
    S = problem.num_ranks
    bar = best / (1 + UNIFORM_SLACK)  # a bound at or above this prunes: stop computing it there
    bounds = sorted((uniform_bound(problem, k, bar), k) for k in uniform_sizes(problem) if k not in skip)
    out = []
    for bound, k in bounds:
        if bound * (1 + UNIFORM_SLACK) >= best:
            break
        plan = solve_bags(problem, f"g{k}n{S // k}", quick=quick, max_iters=QUICK_ITERS if quick else None)
        if plan is not None:
            out.append(plan)
            best = min(best, plan.makespan)
    return out
