"""Pictures say what they show: plan keys beside (not over) the bars, a colour key naming the
sequences, --title added to the stats, integral step ticks, an empty prediction chart that
says nothing was measured, readable calibration axes; at 512-4,096 ranks the plan picture
draws bands of ranks (their numbers the plan's), stays under 2,000 px wide and reads in
seconds when the plan carries its links; ``cluster --plot`` draws step times and HFU."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import json  # noqa: E402
import re  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import numpy as np  # noqa: E402
from matplotlib.container import ErrorbarContainer  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import NullFormatter  # noqa: E402
from PIL import Image  # noqa: E402

from knapformer import WorkloadModel  # noqa: E402
from knapformer.cluster.hardware import hardware  # noqa: E402
from knapformer.plan import LinkModel, Plan, plan_from_groups, plan_sequences  # noqa: E402
from knapformer.plan.picture_bands import band_summary, default_band, size_class  # noqa: E402
from knapformer.plan.picture_common import time_axis  # noqa: E402
from knapformer.tools import cluster_cli, plan_cli, show  # noqa: E402
from knapformer.tools.plots import plot_prediction, plot_step_times, seconds_log_axis  # noqa: E402

MAX_WIDTH_PX = 2000
"""The plan picture's width bound at any rank count."""


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


def _big_plan(S: int) -> Plan:
    """S ranks of two sequences each: every rank's first sequence alone (the odd ranks' on the
    rank before: away from home), every second sequence in its 8-rank node's group, and one
    40,000-token sequence of rank S/2 on a group of min(64, S/2) ranks from S/2."""
    rng = np.random.default_rng(S)
    lens = [[int(v) for v in rng.integers(64, 2048, size=2)] for _ in range(S)]
    lens[S // 2][0] = 40_000
    big = tuple(range(S // 2, S // 2 + min(64, S // 2)))
    groups = [(r,) for r in range(S)] + [tuple(range(n, n + 8)) for n in range(0, S, 8)] + [big]
    seq_group = []
    for r in range(S):
        seq_group += [len(groups) - 1 if r == S // 2 else r - r % 2, S + r // 8]
    return plan_from_groups(lens, groups, seq_group, WorkloadModel(d_model=256, num_heads=8, num_layers=4))


def _whiskers(ax) -> np.ndarray:
    """(B, 2) the bottom and top of each band's whisker as drawn."""
    (bars,) = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
    segments = bars.lines[2][0].get_segments()
    return np.array([[seg[:, 1].min(), seg[:, 1].max()] for seg in segments])


@pytest.mark.parametrize("S", [64, 512, 4096])
def test_plan_picture_at_scale_is_banded_bounded_and_true_to_the_plan(tmp_path, figures, S):
    plan = _big_plan(S)
    plan.plot(tmp_path / "p.png")
    with Image.open(tmp_path / "p.png") as im:
        assert im.format == "PNG" and im.size[0] <= MAX_WIDTH_PX and im.size[1] <= 700, im.size
    (fig,) = figures
    ax = fig.axes[0]
    assert ax.get_ylabel() == "predicted time (cost units)", "no links: cost units"
    if S <= 64:
        assert ax.get_xlabel() == "rank", "small plans keep one bar per rank"
        return
    w = default_band(plan)
    assert w % 8 == 0 if S >= 512 else True
    bands = band_summary(plan, w)
    B = -(-S // w)
    assert 16 <= B <= 64 and bands.first.tolist() == list(range(0, S, w))
    t = plan.time_after
    for b in range(B):
        mine = t[b * w : (b + 1) * w]
        assert bands.max[b] == mine.max() and bands.min[b] == mine.min()
        assert bands.mean[b] == pytest.approx(mine.mean(), rel=1e-12)
        assert t[bands.slowest[b]] == mine.max() and b * w <= bands.slowest[b] < (b + 1) * w
    # compute by group size, home or away, plus exchanges: the band's mean rank
    np.testing.assert_allclose(bands.home.sum(1) + bands.away.sum(1) + bands.exchange, bands.mean, rtol=1e-9)
    # the long sequence's group shows in exactly the bands its members are in; half the
    # single-rank work (the odd ranks' first sequences) is away from home in every band
    big = list(bands.classes).index(int(size_class(min(64, S // 2))))
    members = range(S // 2, S // 2 + min(64, S // 2))
    assert np.nonzero(bands.home[:, big] + bands.away[:, big])[0].tolist() == sorted({r // w for r in members})
    model, lens = plan.cost_model, plan.seq_lens
    moved = [sum(float(model.cost(lens[r][0])) for r in range(b * w + 1, (b + 1) * w, 2)) / w for b in range(B)]
    np.testing.assert_allclose(bands.away[:, 0], moved, rtol=1e-12)
    assert (bands.home[:, 0] > 0).all()
    # drawn: one whisker per band from its fastest to its slowest rank
    np.testing.assert_allclose(_whiskers(ax), np.stack([bands.min, bands.max], 1), rtol=1e-12)


def test_plan_picture_reads_seconds_with_links_or_a_seconds_profile(tmp_path, figures):
    hw = hardware("h100")
    model = WorkloadModel(d_model=256, num_heads=8, num_layers=4)
    ups = hw.flop_units_per_second
    rng = np.random.default_rng(1)
    plans = {}
    for S in (8, 512):
        lens = [[int(v) for v in rng.integers(64, 4096, size=3)] for _ in range(S)]
        layout = f"g1n{S // 2}+g2n{S // 4}"
        plans[S] = plan_sequences(lens, layout, model, link=hw.link(units_per_second=ups))
        plans[S].plot(tmp_path / f"priced{S}.png")
    plan_sequences(lens[:8], "g1n4+g2n2", model).plot(tmp_path / "free.png")
    seconds_profile = WorkloadModel(d_model=256, meta={"units": "seconds per layer"})
    plan_sequences(lens[:8], "g2n4", seconds_profile).plot(tmp_path / "timed.png")
    priced8, priced512, free, timed = (fig.axes[0].get_ylabel() for fig in figures)
    for label in (priced8, priced512):
        assert re.fullmatch(r"predicted time \((s|ms|µs), 4 layers\)", label), label
    assert free == "predicted time (cost units)", free
    assert re.fullmatch(r"predicted time \((s|ms|µs), per layer\)", timed), timed
    # the heights are seconds: the slowest rank's time × 4 layers / units per second
    priced = plans[512]
    scale = {"s": 1.0, "ms": 1e-3, "µs": 1e-6}[time_axis(priced).unit]
    assert _whiskers(figures[1].axes[0]).max() * scale == pytest.approx(priced.makespan * 4 / ups, rel=1e-9)
    assert priced.link is not None and Plan.from_json(priced.to_json()).link == priced.link
    bands = band_summary(priced, default_band(priced))  # exchanges priced: the grey caps
    assert (bands.exchange > 0).all()
    np.testing.assert_allclose(bands.home.sum(1) + bands.away.sum(1) + bands.exchange, bands.mean, rtol=1e-9)


def test_plan_and_show_commands_draw_a_512_rank_plan_in_seconds(tmp_path, figures, capsys):
    rng = np.random.default_rng(2)
    lens = [[int(v) for v in rng.integers(64, 4096, size=3)] for _ in range(512)]
    (tmp_path / "lens.json").write_text(json.dumps({"seq_lens": lens}))
    common = ["--input", str(tmp_path / "lens.json"), "--bags", "g1n256+g4n64", "--d-model", "512", "--layers", "8"]
    out = str(tmp_path / "plan.json")
    assert plan_cli.main([*common, "--hardware", "h100", "--output", out]) == 0
    assert show.main([out, "-o", str(tmp_path / "plan.png")]) == 0
    assert show.main([out, "-o", str(tmp_path / "nodes.png"), "--ranks-per-band", "64", "--title", "nodes"]) == 0
    assert show.main([out, "-o", str(tmp_path / "x.png"), "--ranks-per-band", "1"]) == 2  # 512 bars
    assert "at most 128" in capsys.readouterr().err
    per_node, eight_nodes = figures
    for fig in figures:
        assert re.fullmatch(r"predicted time \((s|ms), 8 layers\)", fig.axes[0].get_ylabel())
    assert "(1 node of 8)" in per_node.axes[0].get_xlabel() and len(_whiskers(per_node.axes[0])) == 64
    assert "(8 nodes of 8)" in eight_nodes.axes[0].get_xlabel() and len(_whiskers(eight_nodes.axes[0])) == 8
    assert eight_nodes.axes[0].get_title().startswith("nodes\n")
    with Image.open(tmp_path / "plan.png") as im:
        assert im.size[0] <= MAX_WIDTH_PX


def test_default_bands_are_whole_nodes_and_at_most_64():
    def band(S, gpus_per_node=None):
        link = None if gpus_per_node is None else LinkModel(intra_bw=1e9, inter_bw=1e9, gpus_per_node=gpus_per_node)
        return default_band(SimpleNamespace(num_ranks=S, link=link))

    assert [band(S) for S in (8, 64, 65, 768, 4096)] == [1, 1, 2, 12, 64]
    assert [band(S, 8) for S in (64, 72, 768, 4096)] == [1, 2, 16, 64]  # 12 would split nodes; 2 divides one
    assert band(4096, 1024) == 64 and band(320, 32) == 8  # a division of a big node (not 5)


def test_plan_picture_refuses_unreadable_band_sizes(tmp_path):
    plan = _big_plan(512)
    for bad in (0, -8, 2.5, True):
        with pytest.raises(ValueError, match="ranks_per_band"):
            plan.plot(tmp_path / "p.png", ranks_per_band=bad)
    with pytest.raises(ValueError, match="512 bars"):
        plan.plot(tmp_path / "p.png", ranks_per_band=1)
    assert not (tmp_path / "p.png").exists()


def test_cluster_plot_draws_step_times_and_hfu_side_by_side(tmp_path, figures, capsys):
    lens = {"seq_lens": [[4096, 256], [1024], [8192], [64, 64, 64], [512], [2048, 128], [300], [900, 900]]}
    (tmp_path / "lens.json").write_text(json.dumps(lens))
    png = tmp_path / "out" / "layouts.png"
    args = ["--input", str(tmp_path / "lens.json"), "--gpus", "8", "--model", "flux", "--hardware", "h100"]
    assert cluster_cli.main([*args, "--quiet", "--json", "--plot", str(png)]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)  # stdout stays JSON; the "wrote" line goes to stderr
    assert f"wrote {png}" in captured.err
    with Image.open(png) as im:
        im.verify()
    with Image.open(png) as im:
        assert im.format == "PNG" and 600 <= im.size[0] <= 1400 and 300 <= im.size[1] <= 1400, im.size
    (fig,) = figures
    ax_t, ax_h = fig.axes
    rows = report["rows"]
    drawn = [rows[0]] + sorted(rows[1:], key=lambda r: (r["step_s"], r["bags"]))
    assert [t.get_text() for t in ax_t.get_yticklabels()] == [r["bags"] for r in drawn]
    assert "step time" in ax_t.get_xlabel() and "HFU" in ax_h.get_xlabel()
    ends = {}  # right end of each row's stacked bar: the step time
    for p in ax_t.patches:
        y = round(p.get_y() + p.get_height() / 2)
        ends[y] = max(ends.get(y, 0.0), p.get_x() + p.get_width())
    np.testing.assert_allclose([ends[i] for i in range(len(drawn))], [r["step_s"] for r in drawn], rtol=1e-12)
    hfu = sorted((round(p.get_y() + p.get_height() / 2), p.get_width()) for p in ax_h.patches)
    np.testing.assert_allclose([w for _, w in hfu], [100 * r["hfu"] for r in drawn], rtol=1e-12)
    bold = [t.get_text() for t in ax_t.get_yticklabels() if t.get_fontweight() == "bold"]
    assert bold == [report["best"]["bags"]]
