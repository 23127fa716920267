"""Online recalibration: refit the cost model (and optionally rank speeds) from measured steps.

Each timed step gives, per rank, the features the plan already knew (tokens held, Σ L²/k of
its groups' sequences, sequences run: :class:`~knapformer.plan.plan.RankFeatures`) and the
seconds the rank spent in the balanced region. :class:`OnlineFit` keeps the last ``window``
steps, weights a step ``forget**age``, and solves non-negative least squares on *relative*
error (every rank-step counts alike, short or long)::

    seconds ≈ layers · (a·tokens + b·attn + c·seqs) / speed_r + d

(d: what every rank pays per step whatever the plan — kernel launches per block call; it
does not change a plan, so it is kept in the profile's ``per_call_seconds``) with a light
ridge pull towards the prior (the configured model, rescaled to seconds by the
first fit) so that steps whose ranks look alike cannot send a coefficient to nonsense.
The fit is robust: the first ``warmup`` timed steps are not used (they pay one-time costs:
allocator growth, lazy initialisation, autotuning, compilation), and rank-steps whose relative
residual is far outside the others' (a GC pause, a recompile at a new shape, a co-scheduled
process) are down-weighted (Huber weights on a MAD scale, a few reweighted solves), so one spike
cannot skew the model for the ``window`` steps it stays in.
Per-rank speeds (opt-in) are the median ratio of predicted to measured time over the window,
normalised to a median of 1 and floored, so one noisy step cannot starve a rank.

Every rank feeds the same gathered numbers into the same code, so every rank holds the same
model; coefficients are rounded to 9 significant digits so that last-bit differences of
float arithmetic between machines cannot split the ranks' plans (the plan digest check
would catch it). Pure numpy.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from knapformer.cost_terms import COST_TERMS, coefficients, with_coefficients
from knapformer.plan.plan import RankFeatures
from knapformer.workload import WorkloadModel
from knapformer.workload_fit import nonneg_lstsq

__all__ = ["OnlineFit", "Observation"]


def _round(v: float, digits: int = 9) -> float:
    if v == 0 or not math.isfinite(v):
        return float(v)
    return float(f"{v:.{digits}g}")


@dataclass(frozen=True)
class Observation:
    """One timed step: per rank (S,) features and measured seconds."""

    features: RankFeatures
    seconds: np.ndarray


@dataclass
class OnlineFit:
    """Accumulates timed steps and refits the cost model (see the module docstring)."""

    prior: WorkloadModel
    """The model to start from (its coefficients' ratios pull the fit; any units)."""
    window: int = 16
    """Steps kept."""
    forget: float = 0.9
    """Weight of a step ``forget**age`` (age 0 = the newest)."""
    estimate_speed: bool = False
    speed_floor: float = 0.25
    """No rank's estimated speed goes below this (relative to the median rank)."""
    ridge: float = 1e-3
    """Strength of the pull towards the (rescaled) prior, per observation row."""
    warmup: int = 1
    """Timed steps at the start that are not fitted (one-time costs)."""
    huber: float = 2.5
    """Rank-steps whose relative residual exceeds this many robust standard deviations (MAD
    scale, at least 2%) get weight ∝ 1/residual; ``math.inf`` = plain least squares."""
    history: deque = field(default_factory=deque, repr=False)
    seen: int = 0
    """Steps offered to :meth:`add`, warm-up included."""

    def __post_init__(self) -> None:
        if not 0 < self.forget <= 1:
            raise ValueError(f"forget must be in (0, 1], got {self.forget}")
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if not 0 < self.speed_floor <= 1:
            raise ValueError(f"speed_floor must be in (0, 1], got {self.speed_floor}")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"warmup must be an int >= 0, got {self.warmup!r}")
        if not self.huber > 0:
            raise ValueError(f"huber must be > 0, got {self.huber}")

    def add(self, obs: Observation) -> None:
        """Record one step (ranks whose time is not positive and finite are left out; the
        first ``warmup`` steps are counted, not kept)."""
        self.seen += 1
        if self.seen <= self.warmup:
            return
        self.history.append(obs)
        while len(self.history) > self.window:
            self.history.popleft()

    @property
    def steps(self) -> int:
        return len(self.history)

    def _rows(self):
        """Rank-step rows: features, seconds, weight, rank, and whether the step ran on as
        many ranks as the newest (steps from before a resize have ranks of another job: they
        inform the cost terms, at speed 1, never a rank's speed)."""
        X, y, w, rank, now = [], [], [], [], []
        S = self.history[-1].seconds.size
        for age, obs in enumerate(reversed(self.history)):
            f = obs.features
            ok = np.isfinite(obs.seconds) & (obs.seconds > 0)
            X.append(f.matrix()[ok])
            y.append(obs.seconds[ok])
            w.append(np.full(int(ok.sum()), self.forget**age))
            rank.append(np.flatnonzero(ok))
            now.append(np.full(int(ok.sum()), obs.seconds.size == S))
        return tuple(np.concatenate(a) for a in (X, y, w, rank, now))

    def fit(self, speeds: np.ndarray | None = None) -> tuple[WorkloadModel, np.ndarray | None]:
        """(the refitted model in seconds per layer, estimated speeds or None); the prior
        unchanged (and None) until a step has been recorded."""
        if not self.history:
            return self.prior, None
        X, y, w, rank, now = self._rows()
        if y.size == 0:
            return self.prior, None
        S = self.history[-1].seconds.size
        speed = np.ones(S) if speeds is None else np.asarray(speeds, dtype=np.float64)

        def per_row(v: np.ndarray) -> np.ndarray:
            return np.where(now, v[np.minimum(rank, S - 1)], 1.0)

        coef = self._solve(X, y, w, per_row(speed))
        est = None
        if self.estimate_speed:
            pred = X @ coef[:-1]
            ratio = np.full(S, np.nan)
            for r in range(S):
                sel = (rank == r) & now & (pred > 0)
                if sel.any():
                    ratio[r] = np.median(pred[sel] / np.maximum(y[sel] - coef[-1], 1e-12))
            good = np.isfinite(ratio)
            if good.any():
                ratio[~good] = np.median(ratio[good])
                est = np.maximum(ratio / np.median(ratio), self.speed_floor)
                est = np.asarray([_round(v, 6) for v in est])
                coef = self._solve(X, y, w, per_row(est))  # refit with the speeds taken out
        layers = self.prior.num_layers
        terms = coef[:-1]
        if not any(v > 0 for t, v in zip(COST_TERMS, terms) if t.grows):
            # degenerate data (noise swamped every length-dependent term): the prior's shape,
            # scaled to the measured seconds, so that predictions stay in seconds; the prior
            # itself only if even that scale is not positive
            spd = per_row(est if est is not None else speed)
            pred = (X / spd[:, None]) @ (coefficients(self.prior) * layers)
            scale = float(np.sum(w * pred / y) / max(np.sum(w * pred**2 / y**2), 1e-300))
            if not (math.isfinite(scale) and scale > 0):
                return self.prior, est
            terms = coefficients(self.prior) * layers * scale
            coef = np.append(terms, 0.0)  # the scale takes the whole time: no per-call constant
        meta = {
            **self.prior.meta,
            "units": "seconds per layer",
            "online_steps": self.steps,
            "per_call_seconds": _round(coef[-1] / layers),
        }
        return with_coefficients(self.prior, [_round(v / layers) for v in terms], meta=meta), est

    def _solve(self, X: np.ndarray, y: np.ndarray, w: np.ndarray, speed: np.ndarray) -> np.ndarray:
        """Robust non-negative relative least squares: :meth:`_nnls`, then a few solves with
        Huber weights on the relative residuals (so outlying rank-steps count less)."""
        A = np.concatenate([X / speed[:, None], np.ones((X.shape[0], 1))], axis=1)
        coef = self._nnls(A, y, w)
        if not math.isfinite(self.huber):
            return coef
        for _ in range(3):
            r = (A @ coef - y) / y
            scale = max(1.4826 * float(np.median(np.abs(r - np.median(r)))), 0.02)
            cut = self.huber * scale
            a = np.abs(r)
            hw = np.where(a > cut, cut / np.maximum(a, 1e-300), 1.0)
            coef = self._nnls(A, y, w * hw)
        return coef

    def _nnls(self, A: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
        """Non-negative relative least squares with a ridge towards the rescaled prior; ``A``:
        the features over speed, then a column of ones (the per-step constant)."""
        p = np.append(coefficients(self.prior), 0.0) * self.prior.num_layers
        n = p.size - 1  # the cost terms; the last column is the per-step constant
        pred_prior = A @ p
        scale = float(np.sum(w * pred_prior * y / y**2) / max(np.sum(w * pred_prior**2 / y**2), 1e-300))
        target = p * scale  # the prior in seconds
        rw = np.sqrt(w) / y
        rows = [A * rw[:, None]]
        rhs = [y * rw]
        lam = self.ridge * math.sqrt(max(len(y), 1))
        for j in range(n):
            if target[j] > 0:
                e = np.zeros(n + 1)
                e[j] = lam / target[j]
                rows.append(e[None, :])
                rhs.append(np.asarray([lam]))
        M, b = np.concatenate(rows), np.concatenate(rhs)
        return nonneg_lstsq(M, b, [j for j in range(n) if np.any(A[:, j] > 0)] + [n])
