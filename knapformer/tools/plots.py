"""PNG charts (matplotlib, imported lazily with the Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = [
    "LAYOUT_ROWS",
    "integer_steps",
    "plot_layouts",
    "plot_prediction",
    "plot_rank_work",
    "plot_step_times",
    "seconds_log_axis",
]

LAYOUT_ROWS = 40
"""Most layouts :func:`plot_layouts` draws (the baseline and the fastest)."""


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def integer_steps(ax) -> None:
    """Whole-number ticks on the x axis (steps are not fractional)."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def seconds_log_axis(axis) -> None:
    """A log axis of seconds labelled in readable units at 1-2-5 steps, no crowded minor labels."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    def fmt(v, _pos):
        for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
            if v >= scale:
                return f"{v / scale:g} {unit}"
        return f"{v:.1e} s"

    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0), numticks=12))
    axis.set_major_formatter(FuncFormatter(fmt))
    axis.set_minor_formatter(NullFormatter())


def plot_rank_work(path: str | Path, title: str, series: dict[str, np.ndarray], ylabel: str = "predicted work") -> None:
    """Grouped bars of per-rank values, one colour per series, with each series' max/mean."""
    plt = _plt()
    names = list(series)
    num_ranks = len(next(iter(series.values())))
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(max(6, num_ranks * 0.35), 3.6))
    x = np.arange(num_ranks)
    for i, name in enumerate(names):
        v = np.asarray(series[name], dtype=float)
        ratio = v.max() / v.mean() if v.mean() > 0 else 1.0
        ax.bar(x + i * width - 0.4 + width / 2, v, width, label=f"{name} (max/mean {ratio:.3f})")
    ax.set_xlabel("rank")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.set_xticks(x)
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_step_times(path: str | Path, series: dict[str, list[float]]) -> None:
    """Step time per measured step, one line per run."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.4))
    for name, v in series.items():
        ax.plot(range(1, len(v) + 1), v, marker="o", label=f"{name} (mean {np.mean(v):.3f} s)")
    ax.set_xlabel("measured step")
    integer_steps(ax)
    ax.set_ylabel("step time (s)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_prediction(path: str | Path, telemetry: list[dict]) -> None:
    """Per step: the slowest rank's predicted and measured seconds when both exist (the model in
    seconds and timing on), else the predicted imbalance (and the measured one, if timed)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.4))
    steps = [t["step"] for t in telemetry]
    measured = bool(telemetry) and all(t.get("measured_imbalance") is not None for t in telemetry)
    if not measured:  # one lone predicted line would read as a comparison: say what is missing
        ax.text(
            0.5,
            0.5,
            "nothing measured: run with --measure (BalancerConfig(measure=True))\n"
            "to compare predicted with measured time per step",
            ha="center",
            va="center",
            fontsize=9,
            transform=ax.transAxes,
        )
        ax.set_axis_off()
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return
    if all(t.get("predicted_s") and t.get("measured_s") for t in telemetry):
        ax.plot(steps, [max(t["predicted_s"]) for t in telemetry], marker="o", label="predicted (slowest rank)")
        ax.plot(steps, [max(t["measured_s"]) for t in telemetry], marker="s", label="measured (slowest rank)")
        ax.set_ylabel("seconds of the balanced region")
        ax.set_ylim(bottom=0)
    else:
        ax.plot(steps, [t["imbalance_after"] for t in telemetry], marker="o", label="predicted imbalance")
        ax.plot(steps, [t["measured_imbalance"] for t in telemetry], marker="s", label="measured imbalance")
        ax.set_ylabel("max/mean - 1")
    ax.set_xlabel("step")
    integer_steps(ax)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_layouts(path: str | Path, rows: list[dict], *, title: str = "", best: str | None = None) -> None:
    """``knapformer cluster --plot``: per layout (rows of ``bags``, ``step_s``, ``comm_share``,
    ``speedup``, ``hfu``), its predicted step time (the slowest rank's exchanges shaded) and its
    HFU side by side, one row each. The first row (the ``none`` baseline) and the fastest
    layouts up to :data:`LAYOUT_ROWS` rows are drawn, so the picture stays readable (at most
    1,210 × 1,320 px)."""
    if not rows:
        raise ValueError("no layouts to plot")
    for r in rows:
        missing = [k for k in ("bags", "step_s", "comm_share", "speedup", "hfu") if k not in r]
        if missing:
            raise ValueError(f"layout row {r.get('bags', r)!r} lacks {missing}")
    drawn = [rows[0]] + sorted(rows[1:], key=lambda r: (r["step_s"], r["bags"]))[: LAYOUT_ROWS - 1]
    left_out = len(rows) - len(drawn)
    plt = _plt()
    from matplotlib.patches import Patch

    n = len(drawn)
    fig, (ax_t, ax_h) = plt.subplots(1, 2, sharey=True, figsize=(11, min(2.4 + 0.24 * n, 12)))
    y = np.arange(n)
    step = np.array([r["step_s"] for r in drawn], dtype=float)
    comm = step * np.array([r["comm_share"] for r in drawn], dtype=float)
    hfu = 100 * np.array([r["hfu"] for r in drawn], dtype=float)
    colours = ["tab:green" if r["bags"] == best else "tab:blue" for r in drawn]
    colours[0] = "tab:orange"  # the baseline
    ax_t.barh(y, step - comm, 0.7, color=colours)
    ax_t.barh(y, comm, 0.7, left=step - comm, color="0.75", edgecolor="0.5", linewidth=0.3)
    for i, r in enumerate(drawn):
        ax_t.text(step[i], i, f" {step[i]:.3g} s, {r['speedup']:.2f}x", va="center", fontsize=7)
        ax_h.text(hfu[i], i, f" {hfu[i]:.1f}%", va="center", fontsize=7)
    ax_h.barh(y, hfu, 0.7, color=colours)
    ax_t.set_yticks(y, [r["bags"] for r in drawn], fontsize=7)
    for tick, r in zip(ax_t.get_yticklabels(), drawn):
        if r["bags"] == best:
            tick.set_fontweight("bold")
    ax_t.invert_yaxis()
    ax_t.set_xlim(0, step.max() * 1.3)
    ax_h.set_xlim(0, max(hfu.max(), 1e-9) * 1.25)
    ax_t.set_xlabel("predicted step time (s)")
    ax_h.set_xlabel("HFU (% of peak FLOP/s)")
    used = set(colours[1:])
    keys = [Patch(color="tab:orange", label=f"{drawn[0]['bags']} (the speedups' baseline)")]
    keys += [Patch(color=c, label=lab) for c, lab in (("tab:blue", "layout"), ("tab:green", "best")) if c in used]
    keys.append(Patch(facecolor="0.75", edgecolor="0.5", label="exchanges (slowest rank)"))
    # above the bars (never over them); tight_layout makes room for it
    ax_t.legend(handles=keys, fontsize=7, loc="lower left", bbox_to_anchor=(0.0, 1.01), ncol=2, borderaxespad=0.0)
    more = f" ({left_out} slower layouts not drawn)" if left_out else ""
    fig.suptitle(f"{title}{more}" if title else f"predicted step time and HFU per layout{more}", fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
