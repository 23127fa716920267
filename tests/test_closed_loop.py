"""Closed loop on real gloo ranks: the balancer times itself, refits its cost model online and
reports telemetry; with timing off it adds no collective.

The model trained is the reference Transformer (transformer-tiny's size) under layout g1
(whole sequences, so the cost model alone decides the balance), on long-tailed lengths that
differ every step (:func:`~tests.loop_workers._lens`: many short sequences, and a 450–600 token
one on every even rank, whose attention share decides the balance). Two online runs of
``N + JUDGED`` steps: γ 10× too large, and one rank computing twice as long (speed estimation
on). What is checked, against the issue's acceptance:

* after ``N`` = 16 timed steps, the online model's prediction of each rank's measured time on
  the next ``JUDGED`` = 32 steps (each predicted before it runs, by the model fitted up to
  then) has a median |predicted − measured| / measured ≤ 10% over ranks and steps — or, when
  the machine is noisier than that, ≤ the in-hindsight floor + 8 points (the best model of the
  same form fitted to those very steps, solved independently in the test; over 21 local runs
  the online error minus the floor was −0.006…+0.059, so +5 points failed one run);
* its final settings, frozen, balance held-out batches no worse than the offline calibrated
  profile + 0.02 (measured imbalance, max/mean − 1; not significantly: mean of the paired
  per-batch differences ≤ 0.02 + 2 standard errors), while the wrong γ frozen is far worse (so
  the batches can tell them apart). All settings take turns on the same 6 batches, 5 repeats
  each, each rank's median kept;
* every rank holds the identical model every step; the slow rank's speed is estimated and its
  imbalance at least halved.

The exact properties (identical models, one record per step, the speed estimate) must hold on
every attempt; the measured thresholds get up to ``ATTEMPTS`` = 3 attempts (in 6 local
first attempts of this version one failed: the slow rank's imbalance 0.167, not under half
the profile's 0.284); in the full suite a level shift of the VM's speed during the judged steps left the
online model 9 points above the floor for several steps (a median error of 19% vs a 10% floor
in one CI-like run). A broken fit fails every attempt (mutation below).

Why the floor: ranks on this VM's vCPUs change speed by up to ~25% for seconds at a time
(measured: the same plan at 52 ms, then 65 ms; the in-hindsight floor of 60 steps ranged 2–12%
between runs minutes apart), which no cost model can predict; a plain 10% bound failed ~30%
of runs. With a core per rank each rank is pinned to its own. 4 ranks time-share the 2 cores
(unpinned), so single steps are noisier: their thresholds are 15% and +0.03. Local runs
(16 judged steps): 2 ranks error 2.8–6.0% (floor 3.1–5.6%), imbalance online 0.054–0.071 vs
profile 0.050–0.051 vs wrong γ 0.19–0.24; 4 ranks error 7.1–12.8% (floor 6.1–10.8%), imbalance
0.064–0.069 vs 0.079–0.090 vs 0.30–0.34. A fit that only rescales the prior (mutation) fails:
37% error.
"""

import numpy as np
import pytest

from knapformer.testing import run_distributed
from tests import loop_workers as W

N = 16
JUDGED = 32
NOISE_ALLOWANCE = 0.08
ATTEMPTS = 3


def _online_errors(records: list[dict]) -> np.ndarray:
    """|predicted − measured| / measured of the judged steps (every rank)."""
    assert all(r["predicted_s"] is not None for r in records[N:]), "the online model predicts seconds"
    return np.asarray([e for r in records[N:] for e in r["prediction_errors"]])


def _hindsight_floor(records: list[dict], rank_speed: bool = False) -> float:
    """The median relative error of the best model of the online fit's form (seconds ≈
    (a·tokens + b·attn + c·seqs) / speed_r + d, non-negative; speeds only with ``rank_speed``)
    fitted in hindsight to the judged steps themselves: what the machine's noise leaves to
    any such model. Solved here independently of the library: relative least squares on every
    subset of coefficients, the best feasible one; speeds by three rounds of per-rank median
    ratios."""
    X = np.concatenate([np.asarray(r["features"]).T for r in records[N:]])  # (steps·ranks, 3)
    y = np.concatenate([np.asarray(r["measured_s"]) for r in records[N:]])
    rank = np.concatenate([np.arange(len(r["measured_s"])) for r in records[N:]])
    scale = np.ones(len(y))
    for _ in range(3 if rank_speed else 1):
        A = np.concatenate([X * scale[:, None], np.ones((len(y), 1))], axis=1) / y[:, None]
        best, coef = np.inf, None
        for mask in range(1, 16):
            cols = [j for j in range(4) if mask >> j & 1]
            c, *_ = np.linalg.lstsq(A[:, cols], np.ones(len(y)), rcond=None)
            err = float(np.median(np.abs(A[:, cols] @ c - 1.0)))
            if (c >= 0).all() and err < best:
                best, coef = err, (cols, c)
        d = coef[1][-1] if 3 in coef[0] else 0.0
        fitted = A[:, coef[0]] @ coef[1] * y - d  # the work part of each prediction
        for r in np.unique(rank):
            sel = rank == r
            scale[sel] *= np.median((y[sel] - d) / np.maximum(fitted[sel], 1e-12))
    return best


def _held_out(evaluation: dict[str, list]) -> dict[str, dict]:
    """Per setting: measured imbalance (mean over batches of each rank's median of repeats)
    and the frozen model's median error (reported only: a frozen model cannot follow the
    machine's speed)."""
    out = {}
    for name, batches in evaluation.items():
        imb, err = [], []
        for batch in batches:
            t = np.median(np.asarray(batch["measured_s"]), axis=0)
            imb.append(t.max() / t.mean() - 1.0)
            if batch["predicted_s"] is not None:
                err += (np.abs(np.asarray(batch["predicted_s"]) - t) / t).tolist()
        out[name] = {"imbalance": imb, "error": float(np.median(err)) if err else None}
    return out


def _no_worse(ev: dict, run: str, reference: str, margin: float) -> str:
    """ "" if ``run``'s measured imbalance is not significantly above ``reference``'s +
    ``margin`` (the mean of the paired per-batch differences ≤ margin + 2 standard errors),
    else why."""
    d = np.asarray(ev[run]["imbalance"]) - np.asarray(ev[reference]["imbalance"])
    se = float(np.std(d, ddof=1) / np.sqrt(d.size))
    return "" if d.mean() <= margin + 2 * se else f"{run} imbalance − {reference}'s: {d.round(3).tolist()}, se {se:.3f}"


def _timing_problems(res: list[dict], world: int, max_error: float, margin: float) -> list[str]:
    """The measured thresholds of the module docstring; what fails (empty: all hold)."""
    first = res[0]
    ev = _held_out(first["eval"])
    problems = []
    # γ 10x too large: the online model learns the real costs ...
    for run, speeds in (("online", False), ("slow_online", True)):
        err = float(np.median(_online_errors(first[run])))
        floor = _hindsight_floor(first[run], rank_speed=speeds)
        if err > max(max_error, floor + NOISE_ALLOWANCE):
            problems.append(f"{run}: median error {err:.3f}, in-hindsight floor {floor:.3f}")
    # ... and balances like the profile, where the wrong γ frozen balances far worse (so these
    # batches can tell the two apart)
    problems.append(_no_worse(ev, "online", "offline", margin))
    mean = {name: float(np.mean(v["imbalance"])) for name, v in ev.items()}
    if not mean["wrong"] > mean["offline"] + 0.05:
        problems.append(f"wrong γ balances like the profile: {mean}")
    if not mean["online"] < 0.5 * mean["wrong"]:
        problems.append(f"online not clearly better than wrong γ: {mean}")
    # one rank twice as slow: its imbalance at least halved, and no worse than the profile's
    problems.append(_no_worse(ev, "slow_online", "slow_offline", margin))
    if not mean["slow_online"] < 0.5 * mean["slow_offline"]:
        problems.append(f"slow rank not relieved: {mean}")
    return [p for p in problems if p]


@pytest.mark.parametrize("world, max_error, margin", [(2, 0.10, 0.02), (4, 0.15, 0.03)])
def test_online_recalibration_from_a_wrong_gamma_and_a_slow_rank(world, max_error, margin):
    failed = []
    for _ in range(ATTEMPTS):
        res = run_distributed(W.check_recalibration, world, N + JUDGED, timeout=600)
        first = res[0]
        for run in ("online", "slow_online"):  # exact properties: every attempt
            assert len(first[run]) == N + JUDGED  # one record per step (the last completed by flush)
            for i in range(len(first[run])):  # every rank holds the identical model every step
                assert len({r[run][i]["digest"] for r in res}) == 1, (run, i)
            assert _online_errors(first[run]).size == world * JUDGED
        speeds = first["slow_online"][-1]["rank_speed"]  # the slow rank's speed is estimated
        assert speeds[world - 1] < 0.8 * min(speeds[: world - 1]), speeds
        problems = _timing_problems(res, world, max_error, margin)
        if not problems:
            return
        failed.append(problems)
    pytest.fail(f"measured thresholds failed in all {ATTEMPTS} attempts: {failed}")


@pytest.mark.parametrize("world", [2])
def test_timing_off_adds_no_collective(world):
    off = run_distributed(W.count_collectives, world, False, timeout=120)
    on = run_distributed(W.count_collectives, world, True, timeout=120)
    assert off[0]["per_step"] == on[0]["per_step"]  # the seconds ride on plan's own gather
    assert off[0]["measured"] is None and all(s > 0 for s in on[0]["measured"])


def test_wall_clock_timing_measures_each_ranks_own_work_and_finds_the_slow_rank():
    """Wall-clock timing between exchanges (how CUDA events behave): the fast rank's waits for
    the slow one are not its work, so the ranks' times differ (g2n1: both ranks hold the same
    work), and from a wrong prior with unequal work (auto) the fit moves and the slow rank's
    speed is estimated below the other's. Timing the whole region instead makes every rank
    measure the slowest one (the failure on CUDA this replaces)."""
    import statistics

    injected = W.SLOW_S * W.CFG.num_layers  # rank 1's extra seconds per step
    same_work = run_distributed(W.wall_clock_loop, 2, 4, "g2n1", timeout=180)
    gaps = [m[1] - m[0] for m in same_work[0]["measured"][1:]]
    assert statistics.median(gaps) > 0.6 * injected, same_work[0]["measured"]  # rank 1's own work is longer
    region = run_distributed(W.wall_clock_loop, 2, 4, "g2n1", False, timeout=180)
    gaps = [abs(m[1] - m[0]) for m in region[0]["measured"][1:]]
    assert statistics.median(gaps) < 0.3 * injected, region[0]["measured"]  # the whole region: both the same
    for r in run_distributed(W.wall_clock_loop, 2, 6, "auto", timeout=180):
        assert r["moved"], r
        assert r["speeds"][1] < 0.7 * r["speeds"][0], r["speeds"]


def test_cuda_events_are_read_a_step_late_and_an_unstamped_end_is_nan(monkeypatch):
    """CUDA-mode timing with events that follow CUDA's rules (``elapsed_time`` raises on an
    event never recorded): seconds come one step late, summed over the segments between
    exchanges; a step whose end was never stamped (route inputs without gradients) is NaN."""
    import math

    import torch

    import knapformer.distributed.timing as timing

    class Event:
        clock = [0.0]

        def __init__(self):
            self.t = None

        def record(self):
            Event.clock[0] += 1.0
            self.t = Event.clock[0]

        def query(self):
            return self.t is not None

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            if self.t is None or other.t is None:
                raise RuntimeError("CUDA error: the event was never recorded")
            return 1e3 * (other.t - self.t)

    monkeypatch.setattr(timing, "_cuda_event", Event)
    t = timing.StepTimer("cuda")
    t.start(torch.device("cpu"))  # events 1; an exchange: 2 (pause), 3 (resume); stop: 4, then 5
    timing.pause()
    timing.resume()
    t.stop()
    assert math.isnan(t.seconds()) and t.lag == 1  # not read yet: a step late
    t.start(torch.device("cpu"))  # a step whose end is never stamped
    assert t.seconds() == 2.0  # the first step: segments 1-2 and 3-4
    t.start(torch.device("cpu"))
    t.stop()
    assert math.isnan(t.seconds())  # the unstamped step: NaN, no exception
    assert t.drain() == [1.0]
