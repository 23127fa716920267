"""The plan picture at scale: contiguous ranks drawn as bands, one bar per band.

A bar per band would hide the one slow rank a step waits for if it showed only a mean, and
colouring thousands of sequences one colour each says nothing. So each band's bar is its mean
rank, stacked the way the per-rank picture stacks a rank: compute coloured by the size of the
group it runs in (1 rank, 2, 3–4, 5–8, …: where the long sequences' groups sit), hatched where
the work is away from its sequence's source rank, a grey cap for the exchanges (the predicted
time beyond compute); a whisker spans the band's fastest and slowest rank, and the dashed line
is the lower bound. A key names the largest groups and the ranks they span. Bands are whole
nodes when the plan carries its links (``gpus_per_node``), and at most :data:`MAX_BANDS` of
them are drawn unless asked for, so the image is at most 18 in (1,980 px) wide.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

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

__all__ = ["MAX_BANDS", "Bands", "band_summary", "default_band", "plot_bands"]

MAX_BANDS = 64
"""Most bands the default band size gives."""
_KEY_GROUPS = 6
"""Largest groups named in their key."""


def default_band(plan: PlanForm) -> int:
    """Ranks per bar: 1 up to :data:`~knapformer.plan.picture_common.PER_RANK_MAX` ranks; beyond, the
    fewest ranks giving at most :data:`MAX_BANDS` bands, as whole nodes (or whole divisions of
    a node) when the plan carries its links."""
    S = plan.num_ranks
    if S <= PER_RANK_MAX:
        return 1
    per = -(-S // MAX_BANDS)
    link = getattr(plan, "link", None)
    node = int(link.gpus_per_node) if link is not None else 1
    if node == 1 or node >= S:
        return per
    if node <= per:
        return node * -(-per // node)
    return next(d for d in range(per, node + 1) if node % d == 0)


def size_class(k: np.ndarray) -> np.ndarray:
    """Group-size class: 0 for 1 rank, 1 for 2, 2 for 3–4, 3 for 5–8, … (⌈log2 k⌉)."""
    k = np.asarray(k, dtype=np.int64)
    return np.ceil(np.log2(np.maximum(k, 1))).astype(np.int64)


def class_label(c: int) -> str:
    if c == 0:
        return "1 rank"
    lo, hi = 2 ** (c - 1) + 1, 2**c
    return f"{hi} ranks" if lo == hi else f"{lo}-{hi} ranks"


@dataclass(frozen=True)
class Bands:
    """Per band of contiguous ranks, in the plan's time units (B bands, C group-size classes)."""

    first: np.ndarray
    """(B,) first rank of each band."""
    size: np.ndarray
    """(B,) ranks in each band (the last may be short)."""
    mean: np.ndarray
    """(B,) mean predicted time (``time_after``) of the band's ranks."""
    max: np.ndarray
    """(B,) the slowest rank's predicted time."""
    min: np.ndarray
    """(B,) the fastest rank's predicted time."""
    slowest: np.ndarray
    """(B,) the slowest rank of each band."""
    classes: np.ndarray
    """(C,) group-size classes present (:func:`size_class`)."""
    home: np.ndarray
    """(B, C) mean compute per rank of the band, on sequences' source ranks, by class."""
    away: np.ndarray
    """(B, C) the same away from the source ranks."""
    exchange: np.ndarray
    """(B,) mean of each rank's predicted time beyond its compute (its exchanges)."""


def band_summary(plan: PlanForm, ranks_per_band: int) -> Bands:
    """The numbers a banded picture draws (see :class:`Bands`)."""
    S = plan.num_ranks
    band = np.arange(S) // ranks_per_band
    B = int(band[-1]) + 1 if S else 0
    size = np.bincount(band, minlength=B)
    t = np.asarray(plan.time_after, dtype=np.float64)
    rank, _, cost, home, k = member_shares(plan)
    if plan.cost_model is None:  # token shares: scale them to the plan's times
        cost = cost * (t.sum() / max(cost.sum(), 1e-300))
    compute = np.bincount(rank, weights=cost, minlength=S)
    beyond = t - compute
    beyond[beyond <= 1e-9 * np.abs(t)] = 0.0  # rounding, not exchanges
    cls = size_class(k)
    classes = np.unique(cls)
    col = np.searchsorted(classes, cls)
    C = classes.size
    split = []
    for where in (home, ~home):
        flat = np.bincount(band[rank[where]] * C + col[where], weights=cost[where], minlength=B * C)
        split.append(flat.reshape(B, C) / size[:, None])
    by_band = [t[band == b] for b in range(B)]
    first = np.arange(B) * ranks_per_band
    return Bands(
        first=first,
        size=size,
        mean=np.bincount(band, weights=t, minlength=B) / size,
        max=np.array([v.max() for v in by_band]),
        min=np.array([v.min() for v in by_band]),
        slowest=first + np.array([int(np.argmax(v)) for v in by_band], dtype=np.int64),
        classes=classes,
        home=split[0],
        away=split[1],
        exchange=np.bincount(band, weights=beyond, minlength=B) / size,
    )


def _band_axis_label(plan: PlanForm, w: int) -> str:
    link = getattr(plan, "link", None)
    node = int(link.gpus_per_node) if link is not None else 0
    what = f"rank bands of {w}"
    if node and node < plan.num_ranks:
        what += f" ({w // node} node{'s' if w // node > 1 else ''} of {node})" if w % node == 0 else ""
    return f"{what}, labelled by first rank; bar: the band's mean rank, whisker: its fastest to slowest rank"


def plot_bands(plan: PlanForm, path: str | Path, ranks_per_band: int, title: str | None = None) -> None:
    """Write the banded picture of ``plan`` (see the module docstring)."""
    plt = plt_agg()
    from matplotlib.patches import Patch

    bands = band_summary(plan, ranks_per_band)
    axis = time_axis(plan)
    f = axis.factor
    B = bands.first.size
    x = np.arange(B)
    fig, ax = plt.subplots(figsize=(figure_width(B), 5.2))
    palette = _class_colours(plt)
    bottom = np.zeros(B)
    width = 0.8
    for j, c in enumerate(bands.classes.tolist()):
        for part, hatch in ((bands.home[:, j], None), (bands.away[:, j], "///")):
            if part.max() > 0:
                ax.bar(x, part * f, width, bottom=bottom, color=palette[c % len(palette)], hatch=hatch,
                       edgecolor="0.2", linewidth=0.2)  # fmt: skip
                bottom += part * f
    if bands.exchange.max() > 0:
        ax.bar(x, bands.exchange * f, width, bottom=bottom, color="0.75", edgecolor="0.5", linewidth=0.3)
    mid, half = (bands.max + bands.min) / 2 * f, (bands.max - bands.min) / 2 * f
    whisker = ax.errorbar(x, mid, yerr=half, fmt="none", ecolor="black", elinewidth=0.9, capsize=2.0)
    if plan.lower_bound > 0:
        ax.axhline(plan.lower_bound * f, color="black", linestyle="--", linewidth=1)
    step = max(1, -(-B // 16))
    ax.set_xticks(x[::step], [str(int(r)) for r in bands.first[::step]], fontsize=7)
    ax.set_xlim(-0.6, B - 0.4)
    ax.set_xlabel(_band_axis_label(plan, ranks_per_band), fontsize=8)
    ax.set_ylabel(axis.label)
    worst = int(bands.slowest[int(np.argmax(bands.max))]) if B else 0
    unit = f" {axis.unit}" if axis.unit else ""
    stats = f"{stats_line(plan)}\nslowest rank {worst}: {plan.makespan * f:.4g}{unit}; {B} bands of {ranks_per_band}"
    ax.set_title(f"{title}\n{stats}" if title else stats, fontsize=9)
    # keys beside the axes: the marks, the colours (group sizes), the largest groups and where
    whisker.set_label("fastest to slowest rank")
    marks = ax.legend(
        handles=[
            Patch(facecolor="white", edgecolor="0.4", hatch="///", label="away from its source rank"),
            Patch(facecolor="0.75", edgecolor="0.5", label="exchanges"),
            whisker,
            plt.Line2D([0], [0], color="black", linestyle="--", label="lower bound"),
        ],
        fontsize=7,
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        borderaxespad=0.0,
    )
    ax.add_artist(marks)
    sizes = ax.legend(
        handles=[
            Patch(facecolor=palette[c % len(palette)], label=class_label(c)) for c in bands.classes.tolist()[::-1]
        ],
        fontsize=7,
        title="colour = group size",
        title_fontsize=7,
        loc="center left",
        bbox_to_anchor=(1.01, 0.45),
        borderaxespad=0.0,
    )
    ax.add_artist(sizes)
    named = [seq_label(plan, g, span=True) for g in _largest(plan)]
    ax.legend(
        handles=[Patch(facecolor="none", edgecolor="none", label=label) for label in named],
        fontsize=6,
        title="largest groups (member ranks)",
        title_fontsize=7,
        loc="lower left",
        bbox_to_anchor=(1.01, 0.0),
        borderaxespad=0.0,
        handlelength=0,
        handletextpad=0,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def _largest(plan: PlanForm) -> list[int]:
    """The sequences of the largest groups, longest first (one per group)."""
    sizes = np.fromiter((len(g) for g in plan.groups), dtype=np.int64, count=len(plan.groups))
    lengths = plan.index.lengths
    k = sizes[plan.seq_group]
    order = np.lexsort((np.arange(k.size), -lengths, -k)).tolist()
    out, seen = [], set()
    for g in order:
        b = int(plan.seq_group[g])
        if b not in seen:
            seen.add(b)
            out.append(g)
        if len(out) == _KEY_GROUPS:
            break
    return out


def _class_colours(plt) -> list:
    """Mid-tone colours (black hatching shows on each), one per group-size class in order."""
    tab = plt.get_cmap("tab20")
    strong = [tab(i) for i in range(0, 20, 2) if i != 14]  # tab10 without its grey
    light = [tab(i) for i in range(1, 20, 2) if i != 15]
    return strong + light
