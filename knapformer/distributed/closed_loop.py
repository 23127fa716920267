"""The balancer's closed loop: time each rank's step, refit the cost model, emit telemetry.

With ``measure`` each rank times its balanced region (:class:`~knapformer.distributed.timing.StepTimer`:
from the first ``route`` to the end of its backward); the seconds ride on the gather the next
``plan`` does anyway, so every rank sees every rank's time. With ``recalibrate`` those times
feed an online fit (:class:`~knapformer.plan.online.OnlineFit`, identical on every rank), and
the next plans use the fitted model (and speeds): :attr:`ClosedLoop.planning` is the config
the planner reads, the user's config is never rewritten. Every completed step becomes one
:class:`~knapformer.telemetry.StepTelemetry` for the callbacks and ``last_step``.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math

import numpy as np
import torch

from knapformer.config import BalancerConfig
from knapformer.cost_terms import COST_TERMS, coefficients
from knapformer.distributed.timing import StepTimer
from knapformer.plan import Plan
from knapformer.plan.cost import LinkModel
from knapformer.plan.online import Observation, OnlineFit
from knapformer.plan.plan import RankFeatures
from knapformer.telemetry import StepTelemetry, imbalance
from knapformer.workload import WorkloadModel

__all__ = ["ClosedLoop"]

_log = logging.getLogger("knapformer")


class ClosedLoop:
    """Timing, online recalibration and telemetry of one balancer (module docstring)."""

    def __init__(self, config: BalancerConfig) -> None:
        self.planning = config
        """The settings the next plan uses (the user's, with the fitted cost model and speeds)."""
        self._own_speed = config.rank_speed  # the user's setting, what a resize falls back to
        self.timer = StepTimer(config.timer) if config.measure else None
        self.fit = (
            OnlineFit(
                prior=config.cost,
                window=config.recalibrate_window,
                warmup=config.recalibrate_warmup,
                estimate_speed=config.estimate_speed,
            )
            if config.recalibrate
            else None
        )
        self.callbacks: list = []
        self.last_step: StepTelemetry | None = None
        # steps whose records wait for their measurement (record, plan features for the fit):
        # the last one, and with CUDA events (read a step late) the one before
        self._waiting: collections.deque = collections.deque()
        self._bytes_per_token = 0

    @property
    def waiting(self) -> bool:
        """A step's record waits for its measurement."""
        return bool(self._waiting)

    @property
    def ready(self) -> bool:
        """The next gathered seconds complete a record (CUDA timing lags a step behind)."""
        return len(self._waiting) > (self.timer.lag if self.timer is not None else 0)

    @property
    def ready_ahead(self) -> bool:
        """Seconds gathered in a step's ``route`` (``plan_ahead``'s row) complete a record: they
        are the previous step's, whose record waits behind the current one's."""
        return len(self._waiting) > (self.timer.lag if self.timer is not None else 0) + 1

    # -- per step ---------------------------------------------------------------------------
    def seconds_bits(self) -> int:
        """The last step's measured seconds (NaN without timing) as int64 bits, to ride on an
        int64 gather."""
        seconds = self.timer.seconds() if self.timer is not None else float("nan")
        return int(np.float64(seconds).view(np.int64))

    def drain_bits(self) -> list[int]:
        """The seconds of every step still waiting, oldest first, as int64 bits (CUDA events are
        waited for): one per waiting record, NaN where a step was never timed."""
        n = len(self._waiting)
        if self.timer is None:
            values = []
        elif self.timer.kind == "cuda":
            values = self.timer.drain()
        else:
            values = [self.timer.seconds()]
        values = [float("nan")] * max(n - len(values), 0) + values[-n:] if n else []
        return [int(np.float64(v).view(np.int64)) for v in values]

    def measured(self, bits) -> list[float] | None:
        """Every rank's seconds from their gathered bits (int64, a tensor or a numpy array; None
        without timing)."""
        if self.timer is None:
            return None
        return np.asarray(bits, dtype=np.int64).view(np.float64).tolist()

    def start_step(self, plan: Plan, step: int) -> None:
        """Open the step's telemetry record (emitted at once without timing)."""
        cfg = self.planning
        model = cfg.cost
        in_seconds = str(model.meta.get("units", "")).startswith("seconds")
        per_call = float(model.meta.get("per_call_seconds", 0.0))
        record = StepTelemetry(
            step=step,
            layout=cfg.layout.spec(),
            solver=plan.solver,
            plan_ms=1e3 * plan.plan_seconds,
            predicted=plan.time_after.tolist(),
            predicted_s=((plan.time_after + per_call) * model.num_layers).tolist() if in_seconds else None,
            measured_s=None,
            imbalance_before=plan.imbalance_before,
            imbalance_after=plan.imbalance_after,
            measured_imbalance=None,
            gap_to_bound=plan.gap_to_bound,
            tokens_moved=plan.tokens_moved,
            bytes_moved=0,
            coefficients={
                **{t.field: float(c) for t, c in zip(COST_TERMS, coefficients(model))},
                "units": model.meta.get("units", "cost units"),
            },
            rank_speed=list(cfg.rank_speed) if cfg.rank_speed is not None else None,
        )
        self._waiting.append((record, plan.features() if self.fit is not None else None))
        if self.timer is None:  # nothing to wait for
            self.finish_step(None)

    def finish_step(self, measured: list[float] | None) -> None:
        """Complete the oldest waiting record with the measured seconds (gathered from every
        rank: they are that step's); refit; call the callbacks."""
        if not self._waiting:
            return
        record, features = self._waiting.popleft()
        record = dataclasses.replace(
            record,
            measured_s=measured,
            measured_imbalance=imbalance(measured) if measured is not None else None,
            bytes_moved=record.tokens_moved * self._bytes_per_token,
        )
        if self.fit is not None and measured is not None and features is not None:
            self.fit.add(Observation(features, np.asarray(measured, dtype=np.float64)))
            self._recalibrate()
        self.last_step = record
        for cb in self.callbacks:
            cb(record)

    def _recalibrate(self) -> None:
        """Plan the next steps with the model (and speeds) fitted to the measured steps."""
        cfg = self.planning
        model, speeds = self.fit.fit(cfg.rank_speed if cfg.estimate_speed else None)
        changes = {"cost": model}
        if speeds is not None:
            changes["rank_speed"] = tuple(float(s) for s in speeds)
        if cfg.link is not None and model is not self.fit.prior:
            changes["link"] = dataclasses.replace(cfg.link, units_per_second=1.0)  # the fit is in seconds
        self.planning = dataclasses.replace(cfg, **changes)

    def note_bytes(self, bytes_per_value: int) -> None:
        """The activations exchanged per layer are ``bytes_per_value`` wide (their dtype): the
        next plans price them so (every rank calls this with the agreed dtype)."""
        link = self.planning.link
        if link is not None and link.bytes_per_value != bytes_per_value:
            self.planning = dataclasses.replace(
                self.planning, link=dataclasses.replace(link, bytes_per_value=int(bytes_per_value))
            )

    # -- per exchange -------------------------------------------------------------------------
    def on_route(self, tensors: tuple) -> tuple:
        """Start the timer at the step's first route (its end is stamped by route's backward)."""
        self._bytes_per_token = sum(math.prod(t.shape[1:]) * t.element_size() for t in tensors)
        if self.timer is None:
            return tensors
        self.timer.start(tensors[0].device)
        out = self.timer.mark(tensors)
        return out if isinstance(out, tuple) else (out,)

    def on_reverse(self, y: torch.Tensor) -> None:
        if self.timer is not None and not (torch.is_grad_enabled() and y.requires_grad):
            self.timer.stop()  # no backward to wait for

    # -- resumable state ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The fitted cost model and speeds, and the fit's history (plain data, JSON-ready)."""
        cfg = self.planning
        fit = None
        if self.fit is not None:
            fit = {
                "seen": self.fit.seen,
                "history": [
                    {
                        "features": {t.name: getattr(o.features, t.name).tolist() for t in COST_TERMS},
                        "seconds": o.seconds.tolist(),
                    }
                    for o in self.fit.history
                ],
            }
        return {
            "cost": cfg.cost.to_dict(),
            "rank_speed": list(cfg.rank_speed) if cfg.rank_speed is not None else None,
            "link": dataclasses.asdict(cfg.link) if cfg.link is not None else None,
            "fit": fit,
        }

    def load_state_dict(self, state: dict, saved_ranks: int | None = None) -> None:
        """Plan the next steps as the saved loop would have (see :meth:`state_dict`).

        ``saved_ranks``: the balancing group the state was saved from. On another number of
        ranks (a job resumed after a resize) the fitted cost model and links are kept, the
        saved per-rank speeds are dropped — rank r after a resize need not be the GPU it was —
        so the plans use this balancer's own ``rank_speed`` setting (re-estimated from the new
        steps with ``estimate_speed``), and the fit's history of timed steps is kept unless it
        estimates speeds (its rows are tied to the old ranks); a warning says what was dropped."""
        cost = WorkloadModel.from_dict(state["cost"])
        speed = tuple(state["rank_speed"]) if state.get("rank_speed") is not None else None
        link = LinkModel(**state["link"]) if state.get("link") is not None else None
        size = self.planning.layout.group_size
        if saved_ranks is None:  # states saved before resizes were possible
            saved_ranks = len(speed) if speed is not None else size
        resized = saved_ranks != size
        if resized:
            dropped = ["its rank speeds"] if speed is not None else []
            speed = self._own_speed
            if self.fit is not None and self.fit.estimate_speed and state.get("fit"):
                dropped.append("its timed-step history (it estimates per-rank speeds)")
                state = {**state, "fit": None}
            if dropped:
                _log.warning(
                    "knapformer: a balancer state saved on %d ranks loaded on %d: kept the fitted cost model, "
                    "dropped %s",
                    saved_ranks,
                    size,
                    " and ".join(dropped),
                )
        self.planning = dataclasses.replace(self.planning, cost=cost, rank_speed=speed, link=link)
        saved = state.get("fit")
        if self.fit is not None and saved is not None:
            self.fit.history.clear()
            for o in saved["history"]:
                f = RankFeatures(**{t.name: np.asarray(o["features"][t.name], dtype=np.float64) for t in COST_TERMS})
                self.fit.history.append(Observation(f, np.asarray(o["seconds"], dtype=np.float64)))
            self.fit.seen = int(saved["seen"])
