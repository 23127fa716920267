"""The online fit alone (pure numpy, no ranks): it recovers a cost model from exact timings
whatever the prior's γ, ignores warm-up steps, is not dragged by one spike, estimates a slow
rank's speed, and rejects bad settings."""

import numpy as np
import pytest

from knapformer import WorkloadModel
from knapformer.config import BalancerConfig
from knapformer.plan.online import Observation, OnlineFit
from knapformer.plan.plan import RankFeatures

LAYERS = 2
TRUE = (2e-6, 4e-9, 3e-4, 1e-3)  # per layer: linear, quadratic, per sequence, per call (seconds)


def _steps(n: int, ranks: int = 4, seed: int = 0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        seqs = rng.integers(1, 12, size=ranks).astype(float)
        tokens = rng.integers(300, 4000, size=ranks).astype(float)
        attn = tokens**2 / seqs * rng.uniform(0.3, 1.0, size=ranks)
        out.append(RankFeatures(tokens=tokens, attn=attn, seqs=seqs))
    return out


def _seconds(f: RankFeatures, speed=1.0) -> np.ndarray:
    a, b, c, d = TRUE
    return LAYERS * ((a * f.tokens + b * f.attn + c * f.seqs) / speed + d)


def _predict(model: WorkloadModel, f: RankFeatures, speed=1.0) -> np.ndarray:
    work = model.linear * f.tokens + model.quadratic * f.attn + model.per_seq * f.seqs
    return LAYERS * (work / speed + model.meta["per_call_seconds"])


def _prior() -> WorkloadModel:
    return WorkloadModel(d_model=64, gamma=20.0, num_layers=LAYERS)  # shape far off, any units


def _fit(obs, **kw) -> tuple[OnlineFit, WorkloadModel, np.ndarray | None]:
    fit = OnlineFit(prior=_prior(), **kw)
    for f, s in obs:
        fit.add(Observation(f, s))
    model, speeds = fit.fit()
    return fit, model, speeds


def _max_rel_error(model, feats, speed=1.0) -> float:
    errors = [np.abs(_predict(model, f, speed) - _seconds(f, speed)) / _seconds(f, speed) for f in feats]
    return float(np.max(errors))


def test_recovers_the_true_costs_from_exact_timings():
    obs = [(f, _seconds(f)) for f in _steps(12)]
    _, model, speeds = _fit(obs, warmup=0)
    assert speeds is None
    assert model.meta["units"] == "seconds per layer"
    assert _max_rel_error(model, _steps(5, seed=1)) < 0.01  # held-out features
    assert model.quadratic == pytest.approx(TRUE[1], rel=0.05)


def test_warmup_steps_are_not_fitted():
    feats = _steps(13)
    obs = [(feats[0], 10 * _seconds(feats[0]))] + [(f, _seconds(f)) for f in feats[1:]]
    fit, skipped, _ = _fit(obs, warmup=1)
    assert fit.steps == 12 and fit.seen == 13
    assert _max_rel_error(skipped, _steps(5, seed=1)) < 0.01
    _, kept, _ = _fit(obs, warmup=0, huber=float("inf"))
    assert _max_rel_error(kept, _steps(5, seed=1)) > 0.02  # the warm-up step would have skewed it


def test_one_spike_does_not_drag_the_fit():
    feats = _steps(16, seed=2)
    obs = [(f, _seconds(f)) for f in feats]
    spiked = obs[-1][1].copy()
    spiked[0] *= 4.0  # one rank-step four times as long (a pause), the newest, so weighted most
    obs[-1] = (feats[-1], spiked)
    _, robust, _ = _fit(obs, warmup=0)
    _, plain, _ = _fit(obs, warmup=0, huber=float("inf"))
    held_out = _steps(5, seed=3)
    assert _max_rel_error(robust, held_out) < 0.02
    assert _max_rel_error(plain, held_out) > 2 * _max_rel_error(robust, held_out)


def test_a_slow_rank_is_estimated_and_floored():
    speed = np.array([1.0, 1.0, 1.0, 0.5])
    obs = [(f, _seconds(f, speed)) for f in _steps(12, seed=4)]
    _, model, speeds = _fit(obs, warmup=0, estimate_speed=True)
    assert speeds[3] / np.median(speeds[:3]) == pytest.approx(0.5, rel=0.05)
    assert _max_rel_error(model, _steps(5, seed=5), speeds) < 0.02
    starved = np.array([1.0, 1.0, 1.0, 0.01])
    obs = [(f, _seconds(f, starved)) for f in _steps(12, seed=4)]
    _, _, speeds = _fit(obs, warmup=0, estimate_speed=True, speed_floor=0.25)
    assert speeds.min() >= 0.25


def test_until_a_step_is_kept_the_prior_plans():
    fit = OnlineFit(prior=_prior(), warmup=2)
    f = _steps(1)[0]
    fit.add(Observation(f, _seconds(f)))
    assert fit.fit() == (fit.prior, None)


@pytest.mark.parametrize(
    "kw, match",
    [({"warmup": -1}, "warmup"), ({"warmup": 1.5}, "warmup"), ({"huber": 0.0}, "huber"), ({"forget": 0.0}, "forget")],
)
def test_bad_settings_are_rejected(kw, match):
    with pytest.raises(ValueError, match=match):
        OnlineFit(prior=_prior(), **kw)


@pytest.mark.parametrize("bad", [-1, True, 1.0])
def test_bad_warmup_in_the_config_is_rejected(bad):
    with pytest.raises(ValueError, match="recalibrate_warmup"):
        BalancerConfig(layout="g1n2", cost=_prior(), recalibrate=True, recalibrate_warmup=bad)


def test_degenerate_timings_keep_predictions_in_seconds():
    """Ranks with more work measuring *less* time (noise swamping the lengths, as on a loaded
    machine): the fit finds no length-dependent term. It keeps the prior's shape scaled to the
    measured seconds (before, it fell back to the prior in cost units and the next steps
    predicted no seconds at all)."""
    feats = _steps(6)
    _, model, _ = _fit([(f, 0.1 - 2e-5 * f.tokens) for f in feats], warmup=0)
    assert str(model.meta.get("units", "")).startswith("seconds"), model.meta
    prior = _prior()
    ratio = model.linear_coef / prior.linear_coef
    assert ratio > 0 and model.quad_coef == pytest.approx(prior.quad_coef * ratio, rel=1e-5)
    mean_pred = np.mean([_predict(model, f).mean() for f in feats])
    measured = np.mean([(0.1 - 2e-5 * f.tokens).mean() for f in feats])
    assert 0.1 < mean_pred / measured < 10  # seconds, the right order of magnitude


def _loop(ranks: int, *, estimate_speed: bool):
    from knapformer.distributed.closed_loop import ClosedLoop

    cfg = BalancerConfig(layout=f"auto:n{ranks}", cost=_prior(), recalibrate=True, estimate_speed=estimate_speed)
    return ClosedLoop(cfg)


@pytest.mark.parametrize("estimate_speed", [False, True])
def test_a_loop_state_moves_to_other_numbers_of_ranks(estimate_speed, caplog):
    """A closed loop's state saved on 4 ranks (a slow rank estimated), loaded on 2, saved again
    and loaded on 3: the fitted cost model is kept each time, the per-rank speeds are dropped
    (rank r after a resize is another GPU; all equal then), the timed-step history is kept unless
    it estimates speeds, a warning names what was dropped — and the loop goes on fitting."""
    speed = np.array([1.0, 1.0, 0.5, 1.0])
    four = _loop(4, estimate_speed=estimate_speed)
    for f in _steps(8, ranks=4):
        four.fit.add(Observation(f, _seconds(f, speed)))
        four._recalibrate()
    state4 = four.state_dict()
    assert (state4["rank_speed"] is not None) == estimate_speed
    two = _loop(2, estimate_speed=estimate_speed)
    with caplog.at_level("WARNING", logger="knapformer"):
        two.load_state_dict(state4, 4)
    assert two.planning.cost == four.planning.cost and two.planning.rank_speed is None
    assert len(two.fit.history) == (0 if estimate_speed else len(four.fit.history))
    assert ("dropped its rank speeds" in caplog.text) == estimate_speed
    for f in _steps(3, ranks=2, seed=5):  # the loop goes on: steps of 2 ranks fit
        two.fit.add(Observation(f, _seconds(f)))
        two._recalibrate()
    three = _loop(3, estimate_speed=estimate_speed)
    three.load_state_dict(two.state_dict(), 2)
    assert three.planning.cost == two.planning.cost and three.planning.rank_speed is None
    same = _loop(4, estimate_speed=estimate_speed)
    same.load_state_dict(state4, 4)  # the same number of ranks: speeds kept
    assert same.planning.rank_speed == four.planning.rank_speed
