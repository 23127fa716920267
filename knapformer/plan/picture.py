"""A picture of a plan: ranks across, predicted time up, every (sequence, member) share a box.

Each box is one member's share of one sequence (its chunk's linear cost + 1/k of the
attention + the per-sequence cost, from the plan's cost model), coloured by the sequence;
boxes of multi-rank groups have a dark outline, boxes away from the sequence's source rank
are hatched (the source keeps solid boxes), a grey cap is the rank's exchanges (what the
predicted time has beyond compute), and the dashed line is the lower bound. Readable for a
few ranks and for 64; matplotlib is imported only here, when a picture is asked for.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from knapformer.plan.seqindex import DST, IDX, LEN, SRC
from knapformer.plan.validate import PlanForm

__all__ = ["plot_plan"]

_KEY_SEQS = 10
"""Sequences named in the colour key (the longest ones)."""


def _shares(plan: PlanForm):
    """(rank, sequence id, cost, at home) for every member of every sequence's group."""
    model = plan.cost_model
    index = plan.index
    L = index.lengths.astype(np.float64)
    held: dict[tuple[int, int], int] = {}
    gid = index.gid(plan.chunks[:, SRC], plan.chunks[:, IDX])
    for g, d, n in zip(gid.tolist(), plan.chunks[:, DST].tolist(), plan.chunks[:, LEN].tolist()):
        held[(g, d)] = held.get((g, d), 0) + n
    out = []
    for g, b in enumerate(plan.seq_group.tolist()):
        members = plan.groups[b]
        k = len(members)
        for m in members:
            n = held.get((g, m), 0)
            if model is not None:
                cost = float(model.lin(n) + model.quad(L[g]) / k + model.per_seq_coef)
            else:  # an old plan file without its model: tokens as the measure
                cost = float(n)
            out.append((m, g, cost, m == int(index.src_rank[g]), k))
    return out


def plot_plan(plan: PlanForm, path: str | Path, *, title: str | None = None) -> None:
    """Write a PNG of ``plan`` to ``path`` (see the module docstring)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    S = plan.num_ranks
    shares = _shares(plan)
    speed_scale = plan.time_after  # times include speeds and exchanges; boxes are compute shares
    compute = np.zeros(S)
    for m, _, c, _, _ in shares:
        compute[m] += c
    unit_scale = 1.0 if plan.cost_model is not None else (plan.time_after.sum() / max(compute.sum(), 1e-300))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.22 * S + 2) + 3.2, 4.6))
    tab = plt.get_cmap("tab20")
    palette = [tab(i) for i in range(20) if i not in (14, 15)]  # the greys are for exchanges

    def cmap(g: int):
        return palette[g % len(palette)]

    bottom = np.zeros(S)
    width = 0.8
    for m, g, c, home, k in sorted(shares, key=lambda x: (x[0], x[1])):
        h = c * unit_scale
        ax.bar(
            m,
            h,
            width,
            bottom=bottom[m],
            color=cmap(g),
            linewidth=1.2 if k > 1 else 0.3,
            edgecolor="black" if k > 1 else "white",
            hatch=None if home else "///",
        )
        bottom[m] += h
    rest = np.maximum(speed_scale - bottom, 0.0)
    if rest.max() > 0:
        ax.bar(np.arange(S), rest, width, bottom=bottom, color="0.75", edgecolor="0.5", linewidth=0.3)
    if plan.lower_bound > 0:
        ax.axhline(plan.lower_bound, color="black", linestyle="--", linewidth=1)
    ax.set_xlabel("rank")
    ax.set_ylabel("predicted time" + (" (cost units)" if plan.cost_model is not None else ""))
    ax.set_xlim(-0.6, S - 0.4)
    if S <= 32:
        ax.set_xticks(range(S))
    st = plan.stats()
    stats = (
        f"{plan.solver}: {S} ranks, {len(plan.seq_group)} sequences, imbalance {st['imbalance_before']:.3f} -> "
        f"{st['imbalance_after']:.3f}, makespan/bound {st['gap_to_bound']:.4f}"
    )
    ax.set_title(f"{title}\n{stats}" if title else stats, fontsize=9)
    # keys beside the axes, never over the bars: what the marks mean, then which colour is which
    # sequence (the longest ones; colours cycle after 18)
    marks = ax.legend(
        handles=[
            Patch(facecolor="white", edgecolor="black", linewidth=1.2, label="multi-rank group"),
            Patch(facecolor="white", edgecolor="0.4", hatch="///", label="away from its source rank"),
            Patch(facecolor="0.75", edgecolor="0.5", label="exchanges"),
            plt.Line2D([0], [0], color="black", linestyle="--", label="lower bound"),
        ],
        fontsize=7,
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        borderaxespad=0.0,
    )
    ax.add_artist(marks)
    index = plan.index
    lengths = index.lengths
    shown = sorted(range(len(lengths)), key=lambda g: (-int(lengths[g]), g))[:_KEY_SEQS]
    ring = getattr(plan, "rings", None)
    keys = []
    for g in sorted(shown):
        b = int(plan.seq_group[g])
        k = len(plan.groups[b])
        if k == 1:
            where = f"rank {plan.groups[b][0]}"
        else:
            where = f"{k} ranks" + (f", ring {int(ring[b])}" if ring is not None and int(ring[b]) > 1 else "")
        label = f"seq {g}: {int(lengths[g])} tok, rank {int(index.src_rank[g])} -> {where}"
        keys.append(Patch(facecolor=cmap(g), label=label))
    more = len(lengths) - len(shown)
    title_keys = "colour = sequence" + (f" ({len(shown)} longest; {more} more)" if more > 0 else "")
    ax.legend(
        handles=keys,
        fontsize=6,
        title=title_keys,
        title_fontsize=7,
        loc="lower left",
        bbox_to_anchor=(1.01, 0.0),
        borderaxespad=0.0,
    )
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
