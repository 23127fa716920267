"""Default solver: several starts, local search, the best plan wins.

Starts (each polished by :func:`~knapformer.plan.solvers.refine.local_search`):

- **LPT**: sequences by decreasing work, each to the bag where it would *finish* earliest
  (``(load + work) / capacity``), skipping bags that would break the memory cap — the classic
  rule for machines of different speeds (a k-rank bag is a k× faster machine). Above
  ``EXACT_ITEMS`` sequences only the largest and the smallest go through the heap loop; the
  middle is placed in vectorised rounds of batched LPT (:func:`_rounds`).
- **home**: each bag keeps its own ranks' sequences (largest first) up to the fluid level; the
  overflow is inserted LPT-style. Few tokens move when the input is nearly balanced.
- **paper**: the paper's rule, so the result is never worse than the baseline.

Inputs of at most 40 sequences whose best plan is still above ``stop_gap`` then go through a
node-bounded branch and bound (:mod:`~knapformer.plan.solvers.bnb`), which proves the optimum
on most of them.

The winner has the lowest exact makespan; plans within ``tie_tolerance`` (default 1e-4
relative — below what anyone can measure) count as tied (never above the paper's makespan).
Local search stops once within ``stop_gap`` of the lower bound (5e-5 up to 2,048 sequences,
5e-4 above: enough for the 0.2% target at a fraction of the time) and the one moving fewer tokens wins.
Bag contents are finally permuted among interchangeable bags to keep tokens at home.
"""

from __future__ import annotations

import heapq
import time

import numpy as np

from knapformer.plan.plan import Plan, build_plan
from knapformer.plan.problem import PlanProblem, sum_by
from knapformer.plan.solvers.bnb import branch_and_bound
from knapformer.plan.solvers.common import fits_cap, stamp
from knapformer.plan.solvers.fit import best_fit_decreasing, exhaustive_fit, home_fit
from knapformer.plan.solvers.paper import paper_assignment
from knapformer.plan.solvers.refine import local_search, relabel_for_locality, settle_home

__all__ = ["home_assignment", "lpt_assignment", "lpt_fill", "solve_lpt"]

HEAP_ITEMS = 8192  # beyond this many sequences: no paper start, no home start
EXACT_ITEMS = 16_384
"""Up to this many sequences every one goes through the exact earliest-finish insertion (~3 µs
each); beyond, the middle ones are water-filled in rounds. The rounds left the paper's joint
mix on 4,096 ranks (11k sequences, 2–3 per rank) 1.18× the bound before local search and
1.07× after 2,000 iterations, where exact insertion gives 1.066× in half the time."""
_SLOT_PASSES = 4  # slots per bag rank in one round of the batched LPT


def _insert(problem: PlanProblem, items: list[int], seq_bag: np.ndarray, load: np.ndarray, tok: np.ndarray) -> None:
    """Earliest-finish insertion of ``items`` (in the given order), in place."""
    if not items:
        return
    work, lengths = problem.work.tolist(), problem.lengths.tolist()
    cap = problem.max_tokens_per_rank
    classes = problem.bag_classes
    heaps = []
    for _, _, ids in classes:
        h = [(float(load[b]), b) for b in ids]
        heapq.heapify(h)
        heaps.append(h)
    meta = [(k, kap, ids) for k, kap, ids in classes]
    load_l, tok_l = load.tolist(), tok.tolist()
    if cap is None and len(heaps) == 1:  # one class, no cap: the earliest bag is the heap's top
        h, kap = heaps[0], meta[0][1]
        for g in items:
            assigned, b = h[0]
            heapq.heapreplace(h, (assigned + work[g], b))
            seq_bag[g] = b
        for assigned, b in h:
            load_l[b] = assigned
        load[:] = load_l
        tok += sum_by(seq_bag[items], problem.lengths[items], len(load)).astype(np.int64)
        return
    for g in items:
        w, L = work[g], lengths[g]
        best_key, best = None, None
        for i, (k, kap, ids) in enumerate(meta):
            assigned, b = heaps[i][0]
            if cap is not None and -(-(tok_l[b] + L) // k) > cap:
                fit = [x for x in ids if -(-(tok_l[x] + L) // k) <= cap]
                if not fit:
                    continue
                b = min(fit, key=lambda x: (load_l[x], x))
                assigned = load_l[b]
            key = ((assigned + w) / kap, k, b)
            if best_key is None or key < best_key:
                best_key, best = key, (i, b)
        if best is None:
            raise ValueError(
                f"sequence {int(problem.seq_index[g])} on rank {int(problem.src_rank[g])} "
                f"({L} tokens) fits in no bag under max_tokens_per_rank={cap}"
            )
        i, b = best
        load_l[b] += w
        tok_l[b] += L
        if heaps[i][0][1] == b:
            heapq.heapreplace(heaps[i], (load_l[b], b))
        else:  # rare cap path: rebuild this class's heap
            heaps[i] = [(load_l[x], x) for x in meta[i][2]]
            heapq.heapify(heaps[i])
        seq_bag[g] = b
    load[:] = load_l
    tok[:] = tok_l


def _rounds(problem: PlanProblem, items: np.ndarray, seq_bag: np.ndarray, load: np.ndarray) -> None:
    """Batched LPT for many items, in place: a k-rank bag is k slots per pass that fill
    together; each round takes the next S items (S = ranks) and gives them, largest first, to
    the S slots with the earliest projected finish ``(load + (j + ½)·mean item) / capacity``
    (slot j of its bag, up to ``_SLOT_PASSES`` passes, so a bag far behind takes several items
    in one round and one far ahead — e.g. holding a big multi-rank sequence — takes none).
    O(rounds · S log S) numpy instead of a Python step per item."""
    kap = problem.bag_capacity
    size = problem.bag_size * _SLOT_PASSES
    slots_bag = np.repeat(np.arange(len(kap)), size)
    slots_j = np.arange(slots_bag.size) - np.repeat(np.cumsum(size) - size, size)
    S = int(problem.bag_size.sum())
    w_all = problem.work
    for start in range(0, items.size, S):
        chunk = items[start : start + S]
        w = w_all[chunk]
        finish = (load[slots_bag] + (slots_j + 0.5) * w.mean()) / kap[slots_bag]
        if chunk.size < finish.size:  # the chunk.size earliest slots by (finish, slot id), in
            # O(slots): every slot up to the cut-off value, then sorted (a partition's choice
            # among ties at the cut-off is not the lowest ids, nor the same on every CPU)
            cut = np.partition(finish, chunk.size - 1)[chunk.size - 1]
            near = np.flatnonzero(finish <= cut)
            best = near[np.lexsort((near, finish[near]))][: chunk.size]
        else:
            best = np.argsort(finish, kind="stable")[: chunk.size]
        target = slots_bag[best]
        seq_bag[chunk] = target
        load += sum_by(target, w, len(kap))


def lpt_fill(problem: PlanProblem, order: np.ndarray, seq_bag: np.ndarray, load: np.ndarray, tok: np.ndarray) -> None:
    """Earliest-finish LPT of the sequences ``order`` (by decreasing work) on top of the bags'
    current ``load``/``tok``, in place. For many items the big head and the small tail go
    through the exact insertion and only the middle is water-filled."""
    B = len(problem.bags)
    if order.size <= EXACT_ITEMS or problem.max_tokens_per_rank is not None:
        _insert(problem, order.tolist(), seq_bag, load, tok)
        return
    h = t = min(2 * B, EXACT_ITEMS // 4)
    head, middle, tail = order[:h], order[h:-t], order[-t:]
    _insert(problem, head.tolist(), seq_bag, load, tok)
    _rounds(problem, middle, seq_bag, load)
    tok += sum_by(seq_bag[middle], problem.lengths[middle], B).astype(np.int64)
    _insert(problem, tail.tolist(), seq_bag, load, tok)


def lpt_assignment(problem: PlanProblem) -> np.ndarray:
    """(n,) bags by earliest-finish LPT (:func:`lpt_fill` from empty bags)."""
    n, B = problem.num_seqs, len(problem.bags)
    seq_bag = np.zeros(n, dtype=np.int64)
    order = problem.by_work
    lpt_fill(problem, order, seq_bag, np.zeros(B), np.zeros(B, dtype=np.int64))
    return seq_bag


def home_assignment(problem: PlanProblem) -> np.ndarray:
    """(n,) keep sequences on their own bag up to the fluid level, insert the overflow."""
    n, B = problem.num_seqs, len(problem.bags)
    home = problem.bag_of_rank[problem.src_rank]
    level = float(problem.work.sum() / problem.bag_capacity.sum())
    order = np.lexsort((np.arange(n), -problem.work, home))  # by home bag, largest first
    w_sorted = problem.work[order]
    csum = np.cumsum(w_sorted)
    first = np.searchsorted(home[order], home[order], side="left")
    within = csum - (csum[first] - w_sorted[first])
    keep_sorted = within <= level * problem.bag_capacity[home[order]] * (1 + 1e-12)
    if problem.max_tokens_per_rank is not None:
        l_sorted = problem.lengths[order]
        lc = np.cumsum(l_sorted)
        tok_within = lc - (lc[first] - l_sorted[first])
        keep_sorted &= fits_cap(tok_within, problem.bag_size[home[order]], problem.max_tokens_per_rank)
    keep = np.zeros(n, dtype=bool)
    keep[order] = keep_sorted
    seq_bag = np.where(keep, home, 0).astype(np.int64)
    load = sum_by(home[keep], problem.work[keep], B)
    tok = sum_by(home[keep], problem.lengths[keep], B).astype(np.int64)
    spill = np.flatnonzero(~keep)
    spill = spill[np.argsort(-problem.work[spill], kind="stable")]
    _insert(problem, spill.tolist(), seq_bag, load, tok)
    return seq_bag


def _cap_starts(problem: PlanProblem, *, have_start: bool) -> list[np.ndarray]:
    """Token-only starts that meet the memory cap (see :mod:`.fit`); raises when none exists,
    saying why."""
    found = [a for a in (home_fit(problem), best_fit_decreasing(problem)) if a is not None]
    if found or have_start:
        return found
    exact, proven = exhaustive_fit(problem)
    if exact is not None:
        return [exact]
    cap = problem.max_tokens_per_rank
    if proven:
        raise ValueError(
            f"max_tokens_per_rank={cap} is infeasible: an exhaustive search found no way to pack the "
            f"{problem.num_seqs} sequences into bags of at most {cap} tokens per rank"
        )
    raise ValueError(
        f"no plan found under max_tokens_per_rank={cap}: earliest-finish and best-fit-decreasing packing "
        f"both failed for {problem.num_seqs} sequences (total {int(problem.lengths.sum())} tokens, room "
        f"{cap * problem.num_ranks}); a cap that leaves more room will work"
    )


def solve_lpt(problem: PlanProblem, *, time_budget_s: float | None = None) -> Plan:
    """Best of LPT / home / paper starts after local search (bounded by iteration counts,
    not clocks, so all ranks agree; it takes no time budget and the registry refuses one)."""
    t0 = time.perf_counter()
    problem.check_capacity()
    opts = problem.options
    tol = opts.tie_tolerance
    candidates: list[Plan] = []
    starts: list[np.ndarray] = []
    # above HEAP_ITEMS sequences the home start's long local search costs more than it saves;
    # locality then comes from relabelling interchangeable bags
    makers = (lpt_assignment, home_assignment) if problem.num_seqs <= HEAP_ITEMS else (lpt_assignment,)
    for make in makers:
        try:
            starts.append(make(problem))
        except ValueError:  # earliest-finish insertion found no bag under the cap for a sequence
            pass
    if problem.max_tokens_per_rank is not None:
        starts += _cap_starts(problem, have_start=bool(starts))
    ceiling = np.inf  # never worse than the paper's plan (checked up to HEAP_ITEMS sequences)
    try:
        if problem.num_seqs > HEAP_ITEMS:
            raise ValueError("too many sequences to run the paper's rule within budget")
        paper_plan = build_plan(problem, paper_assignment(problem), solver="lpt")
        candidates.append(paper_plan)
        ceiling = paper_plan.makespan
    except ValueError:  # the paper's plan breaks the memory cap: not a candidate
        pass
    iters = opts.max_iters if opts.max_iters is not None else len(problem.bags) + 100
    default_gap = 5e-5 if problem.num_seqs <= 2048 else 5e-4
    stop_at = problem.lower_bound * (1 + (opts.stop_gap if opts.stop_gap is not None else default_gap))
    if bool((problem.bag_size == 1).all()):  # every sequence at home is a plan of this layout: never worse
        try:
            home_plan = build_plan(problem, problem.bag_of_rank[problem.src_rank], solver="lpt")
            candidates.append(home_plan)
            ceiling = min(ceiling, home_plan.makespan)
        except ValueError:  # home breaks the memory cap
            pass
    settled: set[int] = set()  # candidates already brought home (no second plan to build)
    for start in starts:
        polished = relabel_for_locality(problem, local_search(problem, start, stop_at=stop_at, max_iters=iters))
        # moves that do not lower the makespan should cost no exchange: bring what can come home
        polished = settle_home(problem, polished)
        try:
            candidates.append(build_plan(problem, polished, solver="lpt"))
            settled.add(id(candidates[-1]))
        except ValueError:
            continue
    if not candidates:  # the token-only starts met the cap; the pre_attn path's gathered K/V do not
        raise ValueError(
            f"no plan of layout {problem.layout.spec()} keeps max_tokens_per_rank={problem.max_tokens_per_rank} "
            "once its ring bags' gathered keys and values (attn_path 'pre_attn') are counted"
        )
    best = min(candidates, key=lambda p: p.makespan)
    if best.makespan > stop_at:  # small inputs: search exactly from the best plan so far
        exact = branch_and_bound(problem, best.seq_group, max_nodes=opts.bnb_nodes)
        if exact is not best.seq_group:
            candidates.append(build_plan(problem, relabel_for_locality(problem, exact), solver="lpt"))
            best = min(candidates, key=lambda p: p.makespan)
    tied = [p for p in candidates if p.makespan <= min(best.makespan * (1 + tol), ceiling)]
    chosen = min(tied, key=lambda p: (p.tokens_moved, p.makespan))
    homed = chosen.seq_group if id(chosen) in settled else settle_home(problem, chosen.seq_group)
    if (homed != chosen.seq_group).any():
        plan = build_plan(problem, homed, solver="lpt")
        if plan.makespan <= min(chosen.makespan * (1 + tol), ceiling) and plan.tokens_moved < chosen.tokens_moved:
            chosen = plan
    return stamp(chosen, t0)
