"""Aligned blocks of ranks with their members' largest load and tokens, kept up to date as
sequences land: choosing the earliest-finishing block of size k then costs O(S/k) instead of
gathering every rank's load (all ranks equally fast; the planners fall back to gathering
otherwise)."""

from __future__ import annotations

import numpy as np

__all__ = ["Blocks"]


class Blocks:
    """For each degree k (each dividing S), the largest load and token count among the members
    of every aligned block of k ranks. Loads only grow, so a block of size j containing the
    block that took a sequence only needs a max, and the blocks inside it grew uniformly."""

    def __init__(self, S: int, degrees, cap: int | None) -> None:
        self.S, self.cap = S, cap
        ks = sorted(set(int(k) for k in degrees))  # ascending: :meth:`add` relies on it
        self.load = {k: np.zeros(S // k) for k in ks}
        self.tok = {k: np.zeros(S // k, dtype=np.int64) for k in ks}
        self._above = {k: [j for j in ks if j > k] for k in ks}

    def best(self, k: int, c: float, need: int, home: int | None = None) -> int:
        """The block of size k with the earliest finish after adding ``c`` (ties: the one
        holding rank ``home``, then the lowest); -1 when none has room for ``need`` more
        tokens under the cap."""
        finish = self.load[k] + c
        if self.cap is not None:
            finish = np.where(self.tok[k] + need <= self.cap, finish, np.inf)
        best = finish.min()
        if not np.isfinite(best):
            return -1
        if home is not None and finish[home // k] <= best * (1 + 1e-12):
            return home // k
        return int(np.argmax(finish <= best * (1 + 1e-12)))

    def add(self, k: int, b: int, c: float, need: int) -> None:
        """Block b of size k took a sequence: each member's load grows by c, tokens by need."""
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
