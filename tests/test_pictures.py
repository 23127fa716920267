"""Pictures say what they show: plan keys beside (not over) the bars, a colour key naming the
sequences, --title added to the stats, integral step ticks, an empty prediction chart that
says nothing was measured, readable calibration axes."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")
import matplotlib  # noqa: E402

matplotlib.use("Agg")
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import NullFormatter  # noqa: E402

from knapformer import WorkloadModel  # noqa: E402
from knapformer.plan import plan_from_groups  # noqa: E402
from knapformer.tools.plots import plot_prediction, plot_step_times, seconds_log_axis  # noqa: E402


@pytest.fixture
def figures(monkeypatch):
    """The figures the code under test saves (drawn, so that extents are known)."""
    saved: list[Figure] = []
    real = Figure.savefig

    def keep(self, *args, **kwargs):
        self.canvas.draw()
        saved.append(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    return saved


def _plan():
    return plan_from_groups(
        [[700, 30], [40, 20], [5000], [64] * 4],
        groups=[(0,), (1,), (2, 3), (0, 1, 2, 3), (3,)],
        seq_group=[0, 3, 1, 1, 2, 4, 4, 4, 4],
        model=WorkloadModel(d_model=64, num_heads=2),
    )


def test_plan_picture_keys_sit_beside_the_bars_and_name_the_sequences(tmp_path, figures):
    _plan().plot(tmp_path / "p.png", title="my run")
    (fig,) = figures
    ax = fig.axes[0]
    assert ax.get_title().startswith("my run\n") and "imbalance" in ax.get_title(), "title adds to the stats"
    legends = [c for c in ax.get_children() if isinstance(c, matplotlib.legend.Legend)]
    assert len(legends) == 2
    axes_box = ax.get_window_extent()
    for lg in legends:
        assert lg.get_window_extent().x0 >= axes_box.x1, "a key overlaps the bars"
    labels = [t.get_text() for lg in legends for t in lg.get_texts()]
    assert any(lab.startswith("seq 4: 5000 tok, rank 2 -> 2 ranks") for lab in labels), labels
    assert any("4 ranks, ring 2" in lab for lab in labels), labels  # 2 heads: the 4-rank group is a ring


def test_step_charts_have_whole_step_ticks(tmp_path, figures):
    plot_step_times(tmp_path / "s.png", {"balanced": [1.0, 1.1, 1.2], "unbalanced": [2.0, 2.1, 2.2]})
    plot_prediction(
        tmp_path / "p.png",
        [{"step": i, "imbalance_after": 0.01, "measured_imbalance": 0.05} for i in range(3)],
    )
    for fig in figures:
        ticks = [t for t in fig.axes[0].get_xticks() if fig.axes[0].get_xlim()[0] <= t <= fig.axes[0].get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks


def test_prediction_chart_without_measurements_says_so(tmp_path, figures):
    plot_prediction(tmp_path / "p.png", [{"step": i, "imbalance_after": 0.01} for i in range(3)])
    (fig,) = figures
    ax = fig.axes[0]
    assert not ax.lines, "no lone predicted line"
    assert any("nothing measured" in t.get_text() for t in ax.texts)


def test_seconds_axis_is_readable():
    fig = Figure()
    ax = fig.add_subplot()
    ax.set_xscale("log")
    ax.set_xlim(1.5e-3, 3e-2)
    seconds_log_axis(ax.xaxis)
    assert isinstance(ax.xaxis.get_minor_formatter(), NullFormatter)
    fmt = ax.xaxis.get_major_formatter()
    assert fmt(2e-3, 0) == "2 ms" and fmt(0.5, 0) == "500 ms" and fmt(2.0, 0) == "2 s"


def test_progress_bars_show_on_a_terminal_that_reports_no_size():
    """A pty of 0 × 0 (as ``script`` or a sizeless container console gives): tqdm alone draws
    nothing there; the CLI's bar must still show."""
    import os
    import pty
    import subprocess
    import sys

    master, slave = pty.openpty()  # a new pty reports 0 columns and 0 rows
    code = (
        "from knapformer.tools.cli_support import progress\n"
        "import time\n"
        "for _ in progress(range(5), desc='steps'):\n"
        "    time.sleep(0.12)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=slave, stdout=slave, stdin=slave, env=env)
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # the child closed its end
            break
        if not chunk:
            break
        out += chunk
    proc.wait(timeout=60)
    os.close(master)
    assert proc.returncode == 0
    assert b"steps:" in out and (b"5/5" in out or b"4/5" in out), out[-500:]
