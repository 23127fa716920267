"""Closed loop on real gloo ranks: the balancer times itself, refits its cost model online and
reports telemetry; with timing off it adds no collective.

The model trained is the reference Transformer (transformer-tiny's size) under layout g1
(whole sequences, so the cost model alone decides the balance). Thresholds: after 12 timed
steps the online model (frozen) predicts each rank's measured time on held-out batches to
≤ 10% (median over ranks and batches), and balances them no worse than the offline calibrated
profile + 0.02 (measured imbalance). Each held-out plan is run 3 times and each rank's minimum
kept: this VM's vCPUs drift ±13% and single steps spike, more when 4 ranks time-share 2 cores
(measured per step, identical steps differ by ±0.05 in imbalance and the 4-rank median error
of single steps reached 16%). On 2 ranks the training steps' own median error (last 5) is
checked too. 4 ranks time-share the 2 cores, so their thresholds are 15% and +0.03: in 7 local
runs the held-out error was 1.4–12.8% and the imbalance difference −0.016…+0.015.
"""

import numpy as np
import pytest

from knapformer.testing import run_distributed
from tests import loop_workers as W

STEPS = 12
LAST = 5


def _median_error(records) -> float:
    return float(np.median([e for r in records[-LAST:] for e in r["prediction_errors"]]))


@pytest.mark.parametrize("world, max_error, margin", [(2, 0.10, 0.02), (4, 0.15, 0.03)])
def test_online_recalibration_from_a_wrong_gamma_and_a_slow_rank(world, max_error, margin):
    res = run_distributed(W.check_recalibration, world, STEPS, timeout=600)
    first = res[0]
    for run in ("online", "offline", "slow_online", "slow_offline"):
        # every rank holds the identical model every step
        for i in range(len(first[run])):
            assert len({r[run][i]["digest"] for r in res}) == 1, (run, i)
        assert len(first[run]) == STEPS  # one record per step (the last completed by flush)
    ev = {k[: -len("_eval")]: v for k, v in first.items() if k.endswith("_eval")}
    # γ 10x too large: the online model learns the real costs, and balances like the profile
    assert ev["online"]["error"] <= max_error, ev["online"]
    assert ev["online"]["imbalance"] <= ev["offline"]["imbalance"] + margin, ev
    # one rank twice as slow: its speed is estimated and it gets less work
    speeds = first["slow_online"][-1]["rank_speed"]
    assert speeds[world - 1] < 0.8 * min(speeds[: world - 1]), speeds
    assert ev["slow_online"]["error"] <= max_error, ev["slow_online"]
    assert ev["slow_online"]["imbalance"] <= ev["slow_offline"]["imbalance"] + margin, ev
    assert ev["slow_online"]["imbalance"] < 0.5 * ev["slow_offline"]["imbalance"], ev
    # and on the training steps themselves (single measurements, noisier): 2 ranks only
    if world == 2:
        assert _median_error(first["online"]) <= 0.10, [r["prediction_errors"] for r in first["online"][-LAST:]]
        assert _median_error(first["slow_online"]) <= 0.10


@pytest.mark.parametrize("world", [2])
def test_timing_off_adds_no_collective(world):
    off = run_distributed(W.count_collectives, world, False, timeout=120)
    on = run_distributed(W.count_collectives, world, True, timeout=120)
    assert off[0]["per_step"] == on[0]["per_step"]  # the seconds ride on plan's own gather
    assert off[0]["measured"] is None and all(s > 0 for s in on[0]["measured"])
