"""Blocks of ranks with their members' largest load and token count, kept up to date as
sequences land: choosing the earliest-finishing block of size k then costs O(S/k) instead of
gathering every rank's load (all ranks equally fast; the planners fall back to gathering
otherwise).

Two kinds of block: *aligned* blocks of a size k dividing S (ranks b·k … b·k + k − 1), and
*windows* of whole nodes for a size k that does not divide S (k a multiple of the node size
n: any k/n consecutive nodes — a 176-rank group on 1,024 ranks starts at any node). Windows
are read from the per-node maxima, which are always kept."""

from __future__ import annotations

import numpy as np

__all__ = ["Blocks", "block_members", "window_starts"]


def window_starts(S: int, k: int, node: int) -> np.ndarray:
    """First ranks of the windows of k ranks on whole nodes of ``node`` ranks (k a multiple)."""
    return np.arange(0, S - k + 1, node, dtype=np.int64)


def block_members(S: int, k: int, node: int | None) -> np.ndarray:
    """(blocks, k) ranks of every block of size k: aligned when k divides S; else windows of
    whole nodes when ``node`` is given and divides k, else every window of k consecutive ranks
    (small groups without a link model)."""
    if S % k == 0:
        return np.arange(S, dtype=np.int64).reshape(S // k, k)
    if node is not None and k % node == 0:
        return window_starts(S, k, node)[:, None] + np.arange(k, dtype=np.int64)
    return np.arange(S - k + 1, dtype=np.int64)[:, None] + np.arange(k, dtype=np.int64)


class Blocks:
    """For each aligned size k (dividing S), the largest load and token count among the members
    of every aligned block of k ranks; sizes that do not divide S are windows of whole nodes
    (``node`` ranks each, which must divide S and every such size). Loads only grow, so after
    a placement on ranks lo … hi − 1 a block inside that range grew by exactly the placement, a
    block containing it takes the max with the range's new loads, and only a block that
    overlaps it partly is recomputed from the per-rank loads (sizes need not nest: 16 and 24
    on 48 ranks)."""

    def __init__(self, S: int, degrees, cap: int | None, node: int | None = None) -> None:
        self.S, self.cap = S, cap
        sizes = sorted(set(int(k) for k in degrees))
        self.windowed = [k for k in sizes if S % k]
        if self.windowed and (node is None or S % node or any(k % node for k in self.windowed)):
            raise ValueError(f"sizes {self.windowed} do not divide {S} ranks and are not whole nodes of {node}")
        self.node = node
        ks = sorted({1} | {k for k in sizes if S % k == 0} | ({node} if self.windowed else set()))
        self.load = {k: np.zeros(S // k) for k in ks}  # level 1: every rank's own load
        self.tok = {k: np.zeros(S // k, dtype=np.int64) for k in ks}
        self._above = [j for j in ks if j > 1]

    def _window_max(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(load, tok) maxima of every window of k ranks (k/node consecutive nodes)."""
        m = k // self.node
        view = np.lib.stride_tricks.sliding_window_view
        return view(self.load[self.node], m).max(axis=1), view(self.tok[self.node], m).max(axis=1)

    def best(self, k: int, c: float, need: int, home: int | None = None) -> int:
        """The block of size k with the earliest finish after adding ``c`` (ties: the one
        holding rank ``home``, then the lowest); -1 when none has room for ``need`` more
        tokens under the cap. Aligned blocks are numbered b (ranks b·k …); windows by their
        first node (ranks b·node …)."""
        load, tok = (self.load[k], self.tok[k]) if k in self.load else self._window_max(k)
        finish = load + c
        if self.cap is not None:
            finish = np.where(tok + need <= self.cap, finish, np.inf)
        best = finish.min()
        if not np.isfinite(best):
            return -1
        near = finish <= best * (1 + 1e-12)
        if home is not None:
            if k in self.load:
                if near[home // k]:
                    return home // k
            else:  # windows holding home's node: starts home_node - m + 1 … home_node
                hn, m = home // self.node, k // self.node
                lo = max(hn - m + 1, 0)
                hits = np.flatnonzero(near[lo : hn + 1])
                if hits.size:
                    return int(lo + hits[0])
        return int(np.argmax(near))

    def add_ranks(self, loads: np.ndarray) -> None:
        """Every rank's load grows by ``loads`` (S,), tokens unchanged; block maxima rebuilt once
        (the source ranks' route charges: one pass instead of one update per sequence)."""
        self.load[1] += loads
        for j in self._above:
            self.load[j] = self.load[1].reshape(-1, j).max(axis=1)

    def first_rank(self, k: int, b: int) -> int:
        """The first rank of block b of size k (see :meth:`best`)."""
        return b * k if k in self.load else b * self.node

    def add(self, k: int, b: int, c: float, need: int) -> None:
        """Block b of size k took a sequence: each member's load grows by c, tokens by need."""
        lo = self.first_rank(k, b)
        hi = lo + k
        rank_load, rank_tok = self.load[1], self.tok[1]
        rank_load[lo:hi] += c
        rank_tok[lo:hi] += need
        if k == 1:  # one rank (most sequences): every block containing it takes a max
            load, tok = rank_load[lo], rank_tok[lo]
            for j in self._above:
                i = lo // j
                if self.load[j][i] < load:
                    self.load[j][i] = load
                if self.tok[j][i] < tok:
                    self.tok[j][i] = tok
            return
        top_l, top_t = rank_load[lo:hi].max(), rank_tok[lo:hi].max()
        for j in self._above:
            load, tok = self.load[j], self.tok[j]
            inside_lo, inside_hi = -(-lo // j), hi // j
            if inside_lo < inside_hi:  # blocks inside the range: grew uniformly
                load[inside_lo:inside_hi] += c
                tok[inside_lo:inside_hi] += need
            for i in {lo // j, (hi - 1) // j}:
                if inside_lo <= i < inside_hi:
                    continue
                if i * j <= lo and hi <= (i + 1) * j:  # contains the range
                    load[i] = max(load[i], top_l)
                    tok[i] = max(tok[i], top_t)
                else:  # overlaps it partly
                    load[i] = rank_load[i * j : (i + 1) * j].max()
                    tok[i] = rank_tok[i * j : (i + 1) * j].max()
