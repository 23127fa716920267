"""PNG charts (matplotlib, imported lazily with the Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["integer_steps", "plot_prediction", "plot_rank_work", "plot_step_times", "seconds_log_axis"]


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
