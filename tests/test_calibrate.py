"""Calibration: the fit recovers known coefficients from noisy timings, rejects bad input, and
the timing path runs end to end on a tiny model."""

import numpy as np
import pytest

from knapformer.cli import main
from knapformer.workload import WorkloadModel
from knapformer.workload_fit import Fit, Timing, check_lengths, fit_cost, fit_paper_style

TRUE = Fit(a=2e-5, b=3e-8, c=1e-3, d=4e-3)
BATCHES = [[n] for n in (16, 32, 64, 128, 256, 512, 1024, 2048)] + [[64] * 8, [32] * 16, [256, 512], [1024, 64, 64]]


def noisy(batches, rel_noise, seed=0):
    rng = np.random.default_rng(seed)
    return [Timing(tuple(b), TRUE.predict(b) * (1 + rng.normal(0, rel_noise))) for b in batches]


def test_fit_recovers_known_coefficients():
    fit = fit_cost(noisy(BATCHES, 0.0))
    for k in "abcd":
        assert getattr(fit, k) == pytest.approx(getattr(TRUE, k), rel=1e-6)
    fit = fit_cost(noisy(BATCHES, 0.02))
    assert fit.a == pytest.approx(TRUE.a, rel=0.1) and fit.b == pytest.approx(TRUE.b, rel=0.1)
    held = noisy([[96], [640], [48] * 12, [768, 256]], 0.0, seed=1)
    assert fit.errors(held)["median_abs_rel"] < 0.05


def test_paper_style_fit_misses_per_sequence_cost():
    timings = noisy(BATCHES, 0.0)
    paper, ours = fit_paper_style(timings), fit_cost(timings)
    many_short = [Timing((32,) * 16, TRUE.predict([32] * 16))]
    assert ours.errors(many_short)["max_abs_rel"] < 1e-6
    assert paper.errors(many_short)["max_abs_rel"] > 0.1


def test_coefficients_stay_non_negative():
    timings = [Timing((n,), 1e-5 * n) for n in (10, 20, 40, 80)] + [Timing((10, 10), 2e-4)]
    fit = fit_cost(timings)
    assert min(fit.a, fit.b, fit.c, fit.d) >= 0


@pytest.mark.parametrize(
    "lengths, message",
    [([], "non-empty list"), ([16, 0], r"lengths\[1\] = 0 is not a positive integer"), ([16, 2.5], "2.5")],
)
def test_bad_lengths(lengths, message):
    with pytest.raises(ValueError, match=message):
        check_lengths(lengths)


def test_fit_rejects_bad_timings():
    with pytest.raises(ValueError, match="need at least 4 timings"):
        fit_cost([Timing((1,), 1.0)])
    with pytest.raises(ValueError, match="positive, finite"):
        fit_cost([Timing((n,), -1.0) for n in (1, 2, 3, 4)])


def test_profile_per_seq_cost_enters_plans():
    m = WorkloadModel(d_model=8, linear=1.0, quadratic=0.0, per_seq=5.0)
    assert m.cost(10) == 15.0 and m.chunk_cost(5, 10, 2) == 10.0


def test_calibrate_cli_on_tiny_model(tmp_path, capsys):
    out = tmp_path / "p.json"
    rc = main(
        [
            "calibrate",
            "--model",
            "transformer-tiny",
            "--lengths",
            "16",
            "64",
            "256",
            "512",
            "--holdout",
            "128",
            "--repeats",
            "1",
            "--output",
            str(out),
            "--no-progress",
            "--plot",
            str(tmp_path / "f.png"),
        ]
    )
    assert rc == 0, capsys.readouterr().err
    prof = WorkloadModel.from_profile(out)
    assert prof.d_model == 64 and prof.num_layers == 2 and prof.meta["model"] == "transformer-tiny"
    assert "fit_quality" in prof.meta and (tmp_path / "f.png").stat().st_size > 0
    assert "held-out" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "nope"], "unknown model preset 'nope'"),
        (["--model", "mmdit-tiny", "--lengths", "0", "8", "16"], r"lengths\[0\] = 0"),
        (["--model", "mmdit-tiny", "--lengths", "8", "8", "8"], "at least 3 distinct fit lengths"),
        (["--model", "mmdit-tiny", "--lengths", "16", "32", "40000000"], "lengths too large for memory"),
        (["--model", "mmdit-tiny", "--causal"], "--causal applies to the transformer presets only"),
    ],
)
def test_calibrate_bad_input(tmp_path, capsys, args, message):
    assert main(["calibrate", *args, "--output", str(tmp_path / "p.json"), "--no-progress"]) == 2
    import re

    assert re.search(message, capsys.readouterr().err)


def test_mismatched_profile_is_refused_by_the_simulator(tmp_path):
    from knapformer.tools.sim_config import SimConfig
    from knapformer.tools.simulate import simulate

    p = tmp_path / "p.json"
    WorkloadModel(d_model=7).save(p)
    cfg = SimConfig(
        ranks=1,
        mix="g1b1i64f1s0",
        model="mmdit-tiny",
        steps=1,
        warmup=0,
        profile=str(p),
        peak_tflops=1.0,
        progress=False,
    )
    with pytest.raises(ValueError, match="profile d_model 7 does not match model 'mmdit-tiny'"):
        simulate(cfg)


def test_report_of_a_fit_without_a_linear_term():
    """Tiny or noisy timings can fit a linear term of 0 (no γ-equivalent): the report says so
    instead of crashing the command (it did: unsupported format string passed to NoneType)."""
    from knapformer.tools.calibrate import format_report
    from knapformer.workload import WorkloadModel

    profile = WorkloadModel(d_model=64, linear=0.0, quadratic=1e-8, num_layers=2).to_dict()
    combined = {
        "heldout": {"median_abs_rel": 0.1, "max_abs_rel": 0.2},
        "heldout_paper_style": {"median_abs_rel": 0.1},
        "additivity": None,
    }
    text = format_report({"blocks": {}, "combined": combined, "profile": profile})
    assert "γ-equivalent n/a (no linear term fitted)" in text
