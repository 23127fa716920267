"""The token-cap allotment of hybrid (dynamic) context parallelism, as Megatron-Core publishes
it: a sequence of L tokens runs on the smallest group size whose chunks stay under a token cap
per rank (⌈L / cap⌉ rounded up to an allowed size), and sequences, costliest first, go to the
aligned block of that size whose busiest member is least loaded.

``auto`` tries it at a few caps when some sequence needs a ring (a video beyond a node) and the
step has at most 2,048 sequences: its placement packs whole images around the ring groups
differently from the moldable planner's LPT and local search. Above that it never won on the
benchmark mixes and cost most of the planning time (every image through block maxima).
``benchmarks/giant_mix.py`` sweeps more caps as the baseline.
"""

from __future__ import annotations

import heapq

import numpy as np

from knapformer.plan.plan import Plan, build_plan
from knapformer.plan.problem import PlanProblem
from knapformer.plan.solvers.blocks import Blocks as _Blocks

__all__ = ["hybrid_cp_caps", "hybrid_cp_plan"]


def hybrid_cp_plan(problem: PlanProblem, cap: int, degrees=None) -> Plan | None:
    """The hybrid-CP plan of an ``auto`` problem at ``cap`` tokens per rank and sequence
    (None when a sequence needs more ranks than any allowed size gives, or the problem's own
    memory cap is broken). ``degrees``: the allowed group sizes (default: the problem's)."""
    S, L = problem.num_ranks, problem.lengths
    D = np.asarray(problem.degrees if degrees is None else degrees, dtype=np.int64)
    D = D[S % D == 0]  # aligned blocks
    need = -(-L // int(cap))
    ok = D[:, None] >= need[None, :]
    if not ok.any(axis=0).all():
        return None
    k = D[ok.argmax(axis=0)]
    model = problem.model
    total = model.cost(L)
    share = model.chunk_cost(-(-L // k), L, k)
    groups: list[tuple[int, ...]] = [(r,) for r in range(S)]
    index: dict[tuple[int, ...], int] = {}
    seq_group = np.zeros(L.size, dtype=np.int64)
    speed = problem.speed
    uniform = bool((speed == speed[0]).all())
    place = _Blocks(S, sorted(set(k.tolist())), None) if uniform else None
    load = np.zeros(S)
    order = np.argsort(-total, kind="stable")
    if place is not None:  # the one-rank tail (cheapest last, all of size 1): a heap of rank loads
        tail = int(np.flatnonzero(k[order] > 1)[-1]) + 1 if (k > 1).any() else 0
        order, whole = order[:tail], order[tail:]
    for g in order.tolist():
        size = int(k[g])
        if place is not None:  # the least loaded aligned block, from maintained block maxima
            b = place.best(size, float(share[g]), 0)
            place.add(size, b, float(share[g]), 0)
            members = tuple(range(b * size, (b + 1) * size))
        else:
            blocks = np.arange(S).reshape(S // size, size)
            b = int(np.argmin(((load[blocks] + share[g]) / speed[blocks]).max(axis=1)))
            members = tuple(int(r) for r in blocks[b])
            load[list(members)] += share[g]
        if size == 1:
            seq_group[g] = members[0]
            continue
        if members not in index:
            index[members] = len(groups)
            groups.append(members)
        seq_group[g] = index[members]
    if place is not None and whole.size:
        _least_loaded(place.load[1], share[whole], whole, seq_group)
    try:
        return build_plan(problem, seq_group, solver="hybrid-cp", groups=groups)
    except ValueError:  # the problem's max_tokens_per_rank
        return None


def _least_loaded(load: np.ndarray, cost: np.ndarray, items: np.ndarray, seq_group: np.ndarray) -> None:
    """Each item in turn on the least loaded rank (ties: the lowest), through a heap: thousands
    of images per plan at ~1 µs each instead of a block-maxima update each. Ties are exact,
    where :class:`_Blocks` treats loads within 1e-12 of each other as tied: two ranks loaded
    equally up to a rounding step may swap an item (the makespan moves by that step at most;
    the benchmarks' 108 plans came out identical)."""
    heap = [(float(v), r) for r, v in enumerate(load)]
    heapq.heapify(heap)
    for g, c in zip(items.tolist(), cost.tolist()):
        v, r = heap[0]
        seq_group[g] = r
        heapq.heapreplace(heap, (v + c, r))


def hybrid_cp_caps(problem: PlanProblem, widest: int) -> list[int]:
    """The caps ``auto`` tries, best guess first: the power of two that gives the longest
    sequence ``widest`` ranks (its moldable degree), then half and twice it."""
    c = 1 << max(int(np.ceil(np.log2(max(float(problem.lengths.max()) / widest, 1.0)))), 0)
    return [c, c // 2, 2 * c] if c > 1 else [c, 2 * c]
