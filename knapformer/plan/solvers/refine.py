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
from knapformer.plan.seqindex import stable_order
from knapformer.plan.solvers.common import fits_cap

__all__ = ["home_among_equals", "local_search", "relabel_for_locality", "return_home", "settle_home"]

_EPS = 1e-12
_SWAP_BAGS_PER_CLASS = 4  # swap partners come from at least this many least loaded bags per class
_SWAP_BAGS_MAX = 64
"""... and up to this many in all classes together when the bags hold few items each (the swap matrix stays within
``_SWAP_CELLS``): with 3–5 coarse items per rank (images of 4k tokens beside ring groups on
1,024 ranks) four partner bags held too few items to swap with — 1.112× the bound where 64
reach 1.095×."""
_SWAP_CELLS = 16_384  # bound on the (critical items × partners) matrix of one swap search
_BATCH_MIN_BAGS = 256  # from this many bags, local search starts with batched moves
_BATCH = 512  # overloaded bags handled per batched round
EQUALS_UP_TO = 32_768
"""Beyond this many sequences :func:`settle_home` only returns sequences home: on 4,096 ranks
× 32 long-tailed sequences (131k) swapping equal lengths home cut the tokens moved by 0.3%
for a quarter of the moldable planner's time (38 of 165 ms)."""


def local_search(
    problem: PlanProblem,
    seq_bag: np.ndarray,
    *,
    max_iters: int | None = None,
    stop_at: float = 0.0,
    movable: np.ndarray | None = None,
    base_load: np.ndarray | None = None,
    base_tok: np.ndarray | None = None,
) -> np.ndarray:
    """Improve ``seq_bag`` (a copy is returned) by critical-bag moves and swaps; stop early
    once the fluid makespan is at or below ``stop_at`` (e.g. just above the lower bound).
    ``movable`` restricts the search to some sequences (the others' entries are ignored) on
    top of fixed ``base_load``/``base_tok`` per bag (the moldable solver's multi-rank groups)."""
    seq_bag = seq_bag.copy()
    B, n = len(problem.bags), problem.num_seqs
    if n == 0 or B < 2:
        return seq_bag
    w, L = problem.work, problem.lengths
    kap, k = problem.bag_capacity, problem.bag_size
    cap = problem.max_tokens_per_rank
    home = problem.bag_of_rank[problem.src_rank]
    ids = np.arange(n) if movable is None else np.flatnonzero(movable)
    load = sum_by(seq_bag[ids], w[ids], B) + (0.0 if base_load is None else base_load)
    tok = sum_by(seq_bag[ids], L[ids], B).astype(np.int64) + (0 if base_tok is None else base_tok)
    # items of each bag, kept up to date (scanning all n sequences per iteration is O(n))
    bag_items = _BagItems(ids, seq_bag[ids], B)
    cls, num_cls = problem.bag_class
    members = [np.flatnonzero(cls == i) for i in range(num_cls)]  # ascending bag ids
    per_bag = max(ids.size / B, 1.0)
    fit = _SWAP_CELLS // (per_bag * per_bag * num_cls)
    partners = int(np.clip(fit, _SWAP_BAGS_PER_CLASS, max(_SWAP_BAGS_MAX // num_cls, _SWAP_BAGS_PER_CLASS)))
    if max_iters is None:
        max_iters = problem.options.max_iters
        if max_iters is None:
            max_iters = 2 * len(problem.bags) + 200
    if B >= _BATCH_MIN_BAGS:  # many bags: first move items off many overloaded bags at once
        max_iters -= _batch_moves(problem, seq_bag, bag_items, load, tok, stop_at, max_iters)
    for _ in range(max(max_iters, 0)):
        t = load / kap
        c = int(np.argmax(t))
        M = t[c]
        if M <= stop_at:
            break
        items = bag_items.sorted(c)
        if items.size == 0:
            break
        wi, Li = w[items], L[items]
        # -- moves: to the lightest bag of each class, or to the item's home bag
        lightest = [_lightest(t, m, partners) for m in members]
        dest = np.unique(np.concatenate([x[:1] for x in lightest] + [home[items]]))
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
                bag_items.move(int(g), c, int(b))
                continue
        # -- swaps: critical item s <-> lighter item u in one of the least loaded bags
        light = [int(b) for x in lightest for b in x.tolist() if b != c]
        others = np.sort(np.concatenate([bag_items.sorted(b) for b in light])) if light else np.zeros(0, np.int64)
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
        bag_items.move(int(g), c, int(b))
        bag_items.move(int(u), int(b), c)
    return seq_bag


def _lightest(t: np.ndarray, members: np.ndarray, count: int) -> np.ndarray:
    """The ``count`` bags of ``members`` (ascending ids) with the lowest t, by (t, id): what a
    full sort of the class gives, in O(B) per local-search iteration instead of O(B log B)."""
    tm = t[members]
    if members.size > count:
        v = np.partition(tm, count - 1)[count - 1]
        near = np.flatnonzero(tm <= v)
        return members[near[np.lexsort((near, tm[near]))][:count]]
    return members[np.lexsort((members, tm))]


class _BagItems:
    """The items of each bag as sets, built on a bag's first use from the assignment given at
    construction (a search touches a few hundred of thousands of bags: building every set
    up front cost more than the search), and each bag's items as a sorted array, kept until the
    bag changes (gathering the swap partners' items from the sets was a third of the search).
    Every change goes through :meth:`move`."""

    def __init__(self, ids: np.ndarray, bags: np.ndarray, B: int) -> None:
        order = stable_order(bags, B)
        self._ids = ids[order]
        self._start = np.searchsorted(bags[order], np.arange(B + 1))
        self._sets: dict[int, set[int]] = {}
        self._arrays: dict[int, np.ndarray] = {}

    def __getitem__(self, b: int) -> set[int]:
        got = self._sets.get(b)
        if got is None:
            got = self._sets[b] = set(self._ids[self._start[b] : self._start[b + 1]].tolist())
        return got

    def sorted(self, b: int) -> np.ndarray:
        """Bag b's items, ascending (an array the caller must not change)."""
        got = self._arrays.get(b)
        if got is None:
            if b in self._sets:
                got = np.fromiter(sorted(self._sets[b]), dtype=np.int64, count=len(self._sets[b]))
            else:
                got = np.sort(self._ids[self._start[b] : self._start[b + 1]])
            self._arrays[b] = got
        return got

    def move(self, g: int, src: int, dst: int) -> None:
        """Item g leaves bag ``src`` for bag ``dst``."""
        self[src].discard(g)
        self[dst].add(g)
        self._arrays.pop(src, None)
        self._arrays.pop(dst, None)


def _batch_moves(problem, seq_bag, bag_items, load, tok, stop_at: float, budget: int) -> int:
    """Rounds that each move one item off every one of the (up to) ``_BATCH`` most loaded bags
    into the equally many least loaded ones (the i-th heaviest pairs with the i-th lightest),
    choosing per pair the item that minimises the larger of the two new times; a move is made
    only if it lowers the pair's larger time. Loads and item lists are updated in place;
    returns the iterations spent (moves / pairs per round, so it counts like single moves)."""
    kap, k, w, L = problem.bag_capacity, problem.bag_size, problem.work, problem.lengths
    cap = problem.max_tokens_per_rank
    B = len(kap)
    K = min(_BATCH, B // 2)
    spent = 0
    while spent < budget:
        t = load / kap
        order = np.argsort(-t, kind="stable")
        heavy, light = order[:K], order[::-1][:K]
        keep = (t[heavy] > stop_at) & (t[heavy] > t[light])
        heavy, light = heavy[keep], light[keep]
        if heavy.size == 0:
            break
        lists = [bag_items.sorted(int(b)).tolist() for b in heavy]
        width = max((len(x) for x in lists), default=0)
        if width == 0:
            break
        items = np.full((heavy.size, width), -1, dtype=np.int64)
        for i, x in enumerate(lists):
            items[i, : len(x)] = x
        valid = items >= 0
        wi = np.where(valid, w[np.maximum(items, 0)], 0.0)
        new_h = (load[heavy][:, None] - wi) / kap[heavy][:, None]
        new_l = (load[light][:, None] + wi) / kap[light][:, None]
        pair = np.where(valid, np.maximum(new_h, new_l), np.inf)
        if cap is not None:
            li = np.where(valid, L[np.maximum(items, 0)], 0)
            pair[~fits_cap(tok[light][:, None] + li, k[light][:, None], cap)] = np.inf
        j = np.argmin(pair, axis=1)
        rows = np.arange(heavy.size)
        better = pair[rows, j] < t[heavy] * (1 - _EPS)
        if not better.any():
            break
        for i in np.flatnonzero(better).tolist():
            g, src, dst = int(items[i, j[i]]), int(heavy[i]), int(light[i])
            load[src] -= w[g]
            load[dst] += w[g]
            tok[src] -= L[g]
            tok[dst] += L[g]
            seq_bag[g] = dst
            bag_items.move(g, src, dst)
        spent += max(1, int(better.sum()) // 8)
    return spent


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


def return_home(
    problem: PlanProblem,
    seq_bag: np.ndarray,
    *,
    movable: np.ndarray | None = None,
    base_load: np.ndarray | None = None,
    base_tok: np.ndarray | None = None,
) -> np.ndarray:
    """Move sequences that left their home bag back, largest first, whenever the home bag's
    fluid time stays at or below the current makespan (a copy is returned): the same makespan,
    fewer tokens moved — a move that does not lower the makespan should not cost an exchange.
    ``movable``/``base_*`` as in :func:`local_search`."""
    seq_bag = seq_bag.copy()
    B, n = len(problem.bags), problem.num_seqs
    if n == 0:
        return seq_bag
    w, L = problem.work, problem.lengths
    kap, k, cap = problem.bag_capacity, problem.bag_size, problem.max_tokens_per_rank
    home = problem.bag_of_rank[problem.src_rank]
    ids = np.arange(n) if movable is None else np.flatnonzero(movable)
    load = sum_by(seq_bag[ids], w[ids], B) + (0.0 if base_load is None else base_load)
    tok = sum_by(seq_bag[ids], L[ids], B).astype(np.int64) + (0 if base_tok is None else base_tok)
    ceiling = float((load / kap).max()) * (1 + _EPS)
    away = ids[seq_bag[ids] != home[ids]]
    # only those whose home has room now can go back (other returns only fill homes further;
    # one that left a home makes room for a later round of settle_home)
    away = away[(load[home[away]] + w[away]) / kap[home[away]] <= ceiling]
    away = away[np.argsort(-L[away], kind="stable")]
    # plain Python scalars in the loop (the same float64 arithmetic; numpy indexing per item
    # cost ~100 ms on 20k sequences away from home at 4,096 ranks)
    load_l, tok_l, kap_l, k_l = load.tolist(), tok.tolist(), kap.tolist(), k.tolist()
    w_l, L_l = w[away].tolist(), L[away].tolist()
    homes, bags = home[away].tolist(), seq_bag[away].tolist()
    back = []
    for i, (h, b, wg, Lg) in enumerate(zip(homes, bags, w_l, L_l)):
        if (load_l[h] + wg) / kap_l[h] > ceiling or (cap is not None and -(-(tok_l[h] + Lg) // k_l[h]) > cap):
            continue
        load_l[h] += wg
        load_l[b] -= wg
        tok_l[h] += Lg
        tok_l[b] -= Lg
        back.append(i)
    seq_bag[away[back]] = home[away[back]]
    return seq_bag


def home_among_equals(problem: PlanProblem, seq_bag: np.ndarray, *, movable: np.ndarray | None = None) -> np.ndarray:
    """Sequences of the same length are interchangeable (same work, same tokens): within each
    such class the bags keep their slots, but each bag's slots go first to sequences whose home
    it is. Every bag's load is unchanged; fewer tokens move (a copy is returned). Vectorised
    over all classes at once, every grouping a radix sort (:func:`stable_order`): tens of
    thousands of long-tailed lengths fall mostly in classes of several."""
    seq_bag = seq_bag.copy()
    ids = np.arange(problem.num_seqs) if movable is None else np.flatnonzero(movable)
    if ids.size < 2:
        return seq_bag
    home = problem.bag_of_rank[problem.src_rank][ids]
    slots = seq_bag[ids]
    away = slots != home
    if not away.any():
        return seq_bag
    # only classes of two or more with a sequence away from home can change (long-tailed
    # lengths are mostly unique: those are dropped before any per-class work)
    cls_all, counts = _classes(problem.lengths[ids])
    has_away = np.bincount(cls_all[away], minlength=counts.size) > 0
    in_play = (counts >= 2)[cls_all] & has_away[cls_all]
    if not in_play.any():
        return seq_bag
    ids, home, slots = ids[in_play], home[in_play], slots[in_play]
    B = len(problem.bags)
    cls, _ = _classes(cls_all[in_play])
    m = ids.size
    # per (class, bag): slots it has and sequences whose home it is
    pairs, inv = _classes(np.concatenate([cls * B + home, cls * B + slots]), values=True)
    hp, sp = inv[:m], inv[m:]
    n_slot = np.bincount(sp, minlength=pairs.size)
    keep = np.minimum(np.bincount(hp, minlength=pairs.size), n_slot)
    # the first keep[(class, home)] of a home's sequences stay there: those already home first
    # (all of them fit: they hold slots of it), then by id
    at_home = home == slots
    order = stable_order(2 * hp + ~at_home)
    rank = np.empty(m, dtype=np.int64)
    rank[order] = np.arange(m) - np.searchsorted(hp[order], hp[order], side="left")
    stays = rank < keep[hp]
    new = np.where(stays, home, -1)
    # the others keep their current bag while it has slots the home-comers leave free (no
    # churn among sequences away from home); only the displaced ones move, in bag order
    free = n_slot - keep
    others = np.flatnonzero(~stays)
    others = others[stable_order(sp[others], pairs.size)]
    r = np.arange(others.size) - np.searchsorted(sp[others], sp[others], side="left")
    remain = r < free[sp[others]]
    new[others[remain]] = slots[others[remain]]
    used = np.bincount(sp[others[remain]], minlength=pairs.size)
    displaced = others[~remain]
    displaced = displaced[stable_order(cls[displaced])]
    new[displaced] = np.repeat(pairs, free - used) % B  # sorted by (class, bag)
    seq_bag[ids] = new
    return seq_bag


def _classes(keys: np.ndarray, *, values: bool = False):
    """Dense class ids of integer ``keys`` (0 = the smallest key) by a radix sort, and the
    count of each class (``values``: the distinct keys, ascending, instead of counts)."""
    order = stable_order(keys)
    ks = keys[order]
    new = np.empty(ks.size, dtype=bool)
    new[:1] = True
    np.not_equal(ks[1:], ks[:-1], out=new[1:])
    ids = np.empty(ks.size, dtype=np.int64)
    ids[order] = np.cumsum(new) - 1
    if values:
        return ks[new], ids
    return ids, np.diff(np.append(np.flatnonzero(new), ks.size))


def settle_home(problem: PlanProblem, seq_bag: np.ndarray, **base) -> np.ndarray:
    """:func:`return_home` and :func:`home_among_equals` until neither moves anything (each can
    open a way for the other; a few rounds at most; above :data:`EQUALS_UP_TO` sequences only
    :func:`return_home`). ``base``: ``movable``, ``base_load``, ``base_tok`` as in
    :func:`local_search`."""
    movable = base.get("movable")
    if problem.num_seqs > EQUALS_UP_TO:
        return return_home(problem, seq_bag, **base)
    # later rounds matter on small steps; at 1,024 ranks × 32 sequences they saved 0.002% of
    # the tokens moved for 2× the planning time, so large steps get one round
    for round_ in range(4 if problem.num_seqs <= 2048 else 1):
        back = return_home(problem, seq_bag, **base)
        if round_ and (back == seq_bag).all():  # home_among_equals is idempotent: nothing new
            break
        new = home_among_equals(problem, back, movable=movable)
        if (new == seq_bag).all():
            break
        seq_bag = new
    return seq_bag
