"""PNG charts (matplotlib, imported lazily with the Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["plot_rank_work", "plot_step_times"]


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


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
    ax.set_ylabel("step time (s)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
