"""Local search on an assignment: move or swap sequences off the busiest bag.

The objective is the *fluid* makespan ``max_b load_b / capacity_b`` (chunk rounding changes
rank times by at most one token's linear cost, which the final plan accounts for exactly).
Each iteration looks only at the critical bag ``c``:

1. best **move** of one of its sequences to another bag, if the larger of the two new bag
   times is below the current makespan (ties: the sequence's home bag, then lower bag id);
2. otherwise the best **swap** of one of its sequences with a lighter one elsewhere.

It stops when neither helps or after ``max_iters`` iterations. Iteration counts, not clocks,
bound it so every rank stops at the same point (determinism).
"""

from __future__ import annotations

import numpy as np

from knapformer.plan.problem import PlanProblem, sum_by
from knapformer.plan.solvers.common import fits_cap

__all__ = ["local_search", "relabel_for_locality"]

_EPS = 1e-12
_SWAP_BAGS_PER_CLASS = 4  # swap partners come from this many least loaded bags per class
_SWAP_CELLS = 16_384  # bound on the (critical items × partners) matrix of one swap search


def local_search(
    problem: PlanProblem, seq_bag: np.ndarray, *, max_iters: int | None = None, stop_at: float = 0.0
) -> np.ndarray:
    """Improve ``seq_bag`` (a copy is returned) by critical-bag moves and swaps; stop early
    once the fluid makespan is at or below ``stop_at`` (e.g. just above the lower bound)."""
    seq_bag = seq_bag.copy()
    B, n = len(problem.bags), problem.num_seqs
    if n == 0 or B < 2:
        return seq_bag
    w, L = problem.work, problem.lengths
    kap, k = problem.bag_capacity, problem.bag_size
    cap = problem.max_tokens_per_rank
    home = problem.bag_of_rank[problem.src_rank]
    load = sum_by(seq_bag, w, B)
    tok = sum_by(seq_bag, L, B).astype(np.int64)
    cls, num_cls = problem.bag_class
    bag_ids = np.arange(B)
    cls_start = np.searchsorted(np.sort(cls), np.arange(num_cls))  # first slot of each class
    cls_count = np.bincount(cls, minlength=num_cls)
    light_slots = np.concatenate([cls_start + r for r in range(_SWAP_BAGS_PER_CLASS)])
    light_valid = np.concatenate([cls_count > r for r in range(_SWAP_BAGS_PER_CLASS)])
    light_slots = light_slots[light_valid]
    if max_iters is None:
        max_iters = problem.options.max_iters
        if max_iters is None:
            max_iters = 2 * len(problem.bags) + 200
    for _ in range(max_iters):
        t = load / kap
        c = int(np.argmax(t))
        M = t[c]
        if M <= stop_at:
            break
        items = np.flatnonzero(seq_bag == c)
        if items.size == 0:
            break
        wi, Li = w[items], L[items]
        # -- moves: to the lightest bag of each class, or to the item's home bag
        by_class = np.lexsort((bag_ids, t, cls))
        dest = np.unique(np.concatenate([by_class[cls_start], home[items]]))
        dest = dest[dest != c]
        if dest.size:
            new_c = (load[c] - wi) / kap[c]
            new_b = (load[dest][None, :] + wi[:, None]) / kap[dest][None, :]
            pair = np.maximum(new_c[:, None], new_b)
            if cap is not None:
                pair[~fits_cap(tok[dest][None, :] + Li[:, None], k[dest][None, :], cap)] = np.inf
            best = pair.min()
            if best < M * (1 - _EPS):
                close = pair <= best * (1 + _EPS)
                # prefer the sequence's home bag, then the smallest pair time, then ids
                prefer_home = close & (dest[None, :] == home[items][:, None])
                cand = prefer_home if prefer_home.any() else close
                i, j = np.argwhere(cand & (pair == pair[cand].min()))[0]
                g, b = items[i], dest[j]
                load[c] -= w[g]
                load[b] += w[g]
                tok[c] -= L[g]
                tok[b] += L[g]
                seq_bag[g] = b
                continue
        # -- swaps: critical item s <-> lighter item u in one of the least loaded bags
        mask = np.zeros(B, dtype=bool)
        mask[by_class[light_slots]] = True
        mask[c] = False
        others = np.flatnonzero(mask[seq_bag])
        if others.size == 0:
            break
        if items.size * others.size > _SWAP_CELLS:
            others = others[: max(1, _SWAP_CELLS // items.size)]
        bo = seq_bag[others]
        d = wi[:, None] - w[others][None, :]
        valid = d > 0
        new_c = (load[c] - d) / kap[c]
        new_b = (load[bo][None, :] + d) / kap[bo][None, :]
        pair = np.where(valid, np.maximum(new_c, new_b), np.inf)
        if cap is not None:
            dl = Li[:, None] - L[others][None, :]
            ok = fits_cap(tok[c] - dl, k[c], cap) & fits_cap(tok[bo][None, :] + dl, k[bo][None, :], cap)
            pair[~ok] = np.inf
        best = pair.min()
        if not best < M * (1 - _EPS):
            break
        i, j = np.argwhere(pair == best)[0]
        g, u = items[i], others[j]
        b = seq_bag[u]
        load[c] += w[u] - w[g]
        load[b] += w[g] - w[u]
        tok[c] += L[u] - L[g]
        tok[b] += L[g] - L[u]
        seq_bag[g], seq_bag[u] = b, c
    return seq_bag


def relabel_for_locality(problem: PlanProblem, seq_bag: np.ndarray) -> np.ndarray:
    """Permute whole bag contents among interchangeable bags (same size, same member speeds)
    so that as many tokens as possible stay on their source rank. Predicted times are
    unchanged; only tokens moved drop. Greedy matching on (content, bag) gains."""
    n, B = problem.num_seqs, len(problem.bags)
    if n == 0 or B < 2:
        return seq_bag
    speed = problem.speed
    if (speed == speed[0]).all():
        cls_id, _ = problem.bag_class
    else:  # interchangeable only if every member's speed matches, position by position
        keys = {(len(b), tuple(speed[list(b)].tolist())) for b in problem.bags}
        index = {key: i for i, key in enumerate(sorted(keys))}
        cls_id = np.asarray([index[(len(b), tuple(speed[list(b)].tolist()))] for b in problem.bags])
    home = problem.bag_of_rank[problem.src_rank]
    same = cls_id[seq_bag] == cls_id[home]
    gain_w = problem.lengths[same] / problem.bag_size[seq_bag[same]]
    pair_key = seq_bag[same] * B + home[same]
    keys, inv = np.unique(pair_key, return_inverse=True)
    gains = np.bincount(inv, weights=gain_w)
    order = np.lexsort((keys, -gains))
    perm = np.full(B, -1, dtype=np.int64)  # content bag -> new bag
    taken = np.zeros(B, dtype=bool)
    for e in order.tolist():
        j, i = divmod(int(keys[e]), B)
        if perm[j] < 0 and not taken[i]:
            perm[j], taken[i] = i, True
    for cid in np.unique(cls_id).tolist():
        free = [b for b in np.flatnonzero(cls_id == cid).tolist() if not taken[b]]
        for j in np.flatnonzero((cls_id == cid) & (perm < 0)).tolist():
            perm[j] = free.pop(0)
    return perm[seq_bag]
