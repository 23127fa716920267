"""What ranks wait for: the exchanges of a layer synchronise the ranks that move data together.

The executor's exchanges involve only the ranks that move data in them, so a rank whose
sequences all run alone waits for nobody in its layers. The members of a multi-rank group do
meet at each of the group's exchanges, though, and a rank in two groups ties them together:
the ranks of one *synchronised set* — a connected set of overlapping multi-rank groups — meet
at every exchange of every layer. Between two meetings each does its own share of one
*segment* of the layer (the linear work between the post-attention exchange of one layer and
the pre-attention exchange of the next; the attention between pre and post; the exchanges
themselves), so every member of the set leaves a segment when its slowest member does. Per
layer a set therefore takes the sum over segments of the slowest member's time in each
segment, not the largest sum: a rank heavy in linear work and another heavy in attention, equal
in total, both take max(linear) + max(attention).

:func:`sync_sets` finds the sets of a plan; :func:`synced_times` prices a step with them. The
planner uses them for ``Plan.step_after`` (so ``Plan.makespan`` is what the executor's
synchronisation makes of the plan) and the cluster model for ``StepPrediction.wait_s``.

Legend: S ranks, G groups, n sequences. Pure numpy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["sync_sets", "synced_times"]


def sync_sets(groups: Sequence[Sequence[int]], seq_group: np.ndarray, num_ranks: int) -> np.ndarray:
    """(S,) the synchronised set of each rank (an id: the smallest rank of the set): ranks
    joined by the multi-rank groups that hold sequences, transitively; a rank in none is a set
    of its own. Vectorised label propagation: each round every group takes its members'
    smallest label and gives it back, until nothing changes (rounds: the longest chain of
    overlapping groups, a few in practice)."""
    labels = np.arange(num_ranks, dtype=np.int64)
    used = np.zeros(len(groups), dtype=bool)
    if np.size(seq_group):
        used[np.asarray(seq_group, dtype=np.int64)] = True
    multi = [g for g in np.flatnonzero(used).tolist() if len(groups[g]) > 1]
    if not multi:
        return labels
    members = np.concatenate([np.asarray(groups[g], dtype=np.int64) for g in multi])
    owner = np.repeat(np.arange(len(multi)), [len(groups[g]) for g in multi])
    while True:
        low = np.full(len(multi), num_ranks, dtype=np.int64)
        np.minimum.at(low, owner, labels[members])
        new = labels.copy()
        np.minimum.at(new, members, low[owner])
        new = new[new]  # follow the labels one hop further (halves the rounds on long chains)
        if np.array_equal(new, labels):
            return labels
        labels = new


def synced_times(sets: np.ndarray, segments: Sequence[np.ndarray], own: np.ndarray | float = 0.0) -> np.ndarray:
    """(S,) the time each rank finishes: for its set, the sum over ``segments`` (each (S,),
    one rank's time in that segment) of the set's slowest member, plus its ``own`` time that
    no exchange synchronises (route and reverse, once a step). A rank alone in its set gets
    the plain sum of its segments (its busy time)."""
    sets = np.asarray(sets, dtype=np.int64)
    total = np.zeros(sets.shape, dtype=np.float64)
    for seg in segments:
        seg = np.broadcast_to(np.asarray(seg, dtype=np.float64), sets.shape)
        top = np.full(sets.shape, -np.inf)
        np.maximum.at(top, sets, seg)
        total += top[sets]
    return total + np.asarray(own, dtype=np.float64)
