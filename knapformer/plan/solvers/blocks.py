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
    (``node`` ranks each, which must divide S and every such size). Loads only grow, so an
    aligned block of size j containing the block that took a sequence only needs a max, and
    the blocks inside it grew uniformly."""

    def __init__(self, S: int, degrees, cap: int | None, node: int | None = None) -> None:
        self.S, self.cap = S, cap
        sizes = sorted(set(int(k) for k in degrees))
        self.windowed = [k for k in sizes if S % k]
        if self.windowed and (node is None or S % node or any(k % node for k in self.windowed)):
            raise ValueError(f"sizes {self.windowed} do not divide {S} ranks and are not whole nodes of {node}")
        if self.windowed and any(node % k for k in sizes if k < node):
            raise ValueError(f"sizes below a node must divide its {node} ranks, got {sizes}")
        self.node = node
        ks = sorted(set(k for k in sizes if S % k == 0) | ({node} if self.windowed else set()))
        self.load = {k: np.zeros(S // k) for k in ks}  # ascending: :meth:`add` relies on it
        self.tok = {k: np.zeros(S // k, dtype=np.int64) for k in ks}
        self._above = {k: [j for j in ks if j > k] for k in ks}

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

    def first_rank(self, k: int, b: int) -> int:
        """The first rank of block b of size k (see :meth:`best`)."""
        return b * k if k in self.load else b * self.node

    def add(self, k: int, b: int, c: float, need: int) -> None:
        """Block b of size k took a sequence: each member's load grows by c, tokens by need."""
        if k not in self.load:
            self._add_window(b * self.node, k, c, need)
            return
        if k == 1:  # one rank (most sequences): plain scalar updates
            self.load[1][b] += c
            self.tok[1][b] += need
            load, tok = self.load[1][b], self.tok[1][b]
            for j in self._above[1]:
                i = b // j
                if self.load[j][i] < load:
                    self.load[j][i] = load
                if self.tok[j][i] < tok:
                    self.tok[j][i] = tok
            return
        lo, hi = b * k, (b + 1) * k
        for j, load in self.load.items():
            tok = self.tok[j]
            if j <= k:  # blocks inside: every member grew by the same amount
                load[lo // j : hi // j] += c
                tok[lo // j : hi // j] += need
            else:  # the block containing it: its largest member may now be one of these
                i = lo // j
                load[i] = max(load[i], self.load[k][b])
                tok[i] = max(tok[i], self.tok[k][b])

    def _add_window(self, lo: int, k: int, c: float, need: int) -> None:
        """Ranks lo … lo + k − 1 (whole nodes) took a sequence. Sizes up to a node divide it,
        so their blocks inside the window grew uniformly; a larger aligned block overlapping
        the window takes the max of its nodes (exact: the node maxima are kept)."""
        hi = lo + k
        for j, load in self.load.items():
            if j <= self.node:
                load[lo // j : hi // j] += c
                self.tok[j][lo // j : hi // j] += need
        n = self.node
        nodes_l, nodes_t = self.load[n], self.tok[n]
        for j in self._above[n]:
            per = j // n
            for i in range(lo // j, (hi - 1) // j + 1):
                self.load[j][i] = nodes_l[i * per : (i + 1) * per].max()
                self.tok[j][i] = nodes_t[i * per : (i + 1) * per].max()
