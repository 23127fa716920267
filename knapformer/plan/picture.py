"""A picture of a plan: ranks across, predicted time up, every (sequence, member) share a box.

Each box is one member's share of one sequence (its chunk's linear cost + 1/k of the
attention + the per-sequence cost, from the plan's cost model), coloured by the sequence;
boxes of multi-rank groups have a dark outline, boxes away from the sequence's source rank
are hatched (the source keeps solid boxes), a grey cap is the rank's exchanges (what the
predicted time has beyond compute), and the dashed line is the lower bound.

Up to :data:`PER_RANK_MAX` ranks every rank gets its own bar; beyond, ranks are drawn in
bands (whole nodes when the plan carries its links) with the same marks
(:mod:`knapformer.plan.picture_bands`), so the image stays under about 2,000 px wide at any
rank count. The y-axis is in seconds (all layers of the cost model) when the plan carries a
link (its ``units_per_second``) or its cost model is in seconds (a calibrated or fitted
profile), else in cost units. matplotlib is imported only when a picture is asked for.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from knapformer.plan.picture_bands import MAX_BANDS, default_band, plot_bands
from knapformer.plan.picture_common import (
    DPI,
    PER_RANK_MAX,
    figure_width,
    member_shares,
    plt_agg,
    seq_label,
    stats_line,
    time_axis,
)
from knapformer.plan.validate import PlanForm

__all__ = ["PER_RANK_MAX", "plot_plan", "time_axis"]

_KEY_SEQS = 10
"""Sequences named in the colour key (the longest ones)."""


def plot_plan(plan: PlanForm, path: str | Path, *, title: str | None = None, ranks_per_band: int | None = None) -> None:
    """Write a PNG of ``plan`` to ``path`` (see the module docstring). ``ranks_per_band``: 1
    draws every rank (up to 128 ranks), more draws bands of that many ranks; None chooses (one
    bar per rank up to :data:`PER_RANK_MAX` ranks, else bands, of whole nodes when the plan
    carries its links)."""
    S = plan.num_ranks
    if ranks_per_band is None:
        ranks_per_band = default_band(plan)
    if not isinstance(ranks_per_band, int) or isinstance(ranks_per_band, bool) or ranks_per_band < 1:
        raise ValueError(f"ranks_per_band must be an int >= 1, got {ranks_per_band!r}")
    bars = -(-S // ranks_per_band)
    if bars > 2 * MAX_BANDS:
        raise ValueError(
            f"ranks_per_band={ranks_per_band} draws {bars} bars for {S} ranks; at most {2 * MAX_BANDS} stay "
            f"readable (use ranks_per_band >= {-(-S // (2 * MAX_BANDS))}, or leave it out)"
        )
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    if ranks_per_band == 1:
        _plot_ranks(plan, path, title)
    else:
        plot_bands(plan, path, ranks_per_band, title)


def _plot_ranks(plan: PlanForm, path: str | Path, title: str | None) -> None:
    """One bar per rank, one box per (sequence, member) share."""
    plt = plt_agg()
    from matplotlib.patches import Patch

    S = plan.num_ranks
    rank, gid, cost, home, ks = member_shares(plan)
    axis = time_axis(plan)
    compute = np.bincount(rank, weights=cost, minlength=S)
    unit_scale = 1.0 if plan.cost_model is not None else (plan.time_after.sum() / max(compute.sum(), 1e-300))
    unit_scale *= axis.factor
    fig, ax = plt.subplots(figsize=(figure_width(S), 4.6))
    tab = plt.get_cmap("tab20")
    palette = [tab(i) for i in range(20) if i not in (14, 15)]  # the greys are for exchanges

    def cmap(g: int):
        return palette[g % len(palette)]

    bottom = np.zeros(S)
    width = 0.8
    for i in np.lexsort((gid, rank)).tolist():
        m, g, k = int(rank[i]), int(gid[i]), int(ks[i])
        h = float(cost[i]) * unit_scale
        ax.bar(
            m,
            h,
            width,
            bottom=bottom[m],
            color=cmap(g),
            linewidth=1.2 if k > 1 else 0.3,
            edgecolor="black" if k > 1 else "white",
            hatch=None if home[i] else "///",
        )
        bottom[m] += h
    rest = np.maximum(plan.time_after * axis.factor - bottom, 0.0)
    if rest.max() > 0:
        ax.bar(np.arange(S), rest, width, bottom=bottom, color="0.75", edgecolor="0.5", linewidth=0.3)
    if plan.lower_bound > 0:
        ax.axhline(plan.lower_bound * axis.factor, color="black", linestyle="--", linewidth=1)
    ax.set_xlabel("rank")
    ax.set_ylabel(axis.label)
    ax.set_xlim(-0.6, S - 0.4)
    if S <= 32:
        ax.set_xticks(range(S))
    stats = stats_line(plan)
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
    keys = [Patch(facecolor=cmap(g), label=seq_label(plan, g)) for g in sorted(shown)]
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
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
