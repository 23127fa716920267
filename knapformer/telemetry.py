"""Per-step telemetry of a balancer: what was planned, what it predicted, what was measured.

:class:`StepTelemetry` is a plain record (torch-free); the balancer emits one per step to the
callbacks registered with ``SequenceBalancer.on_step`` and keeps the last as
``SequenceBalancer.last_step``. :func:`jsonl_writer` appends records to a JSONL file (what
``knapformer simulate --metrics`` writes); :func:`tensorboard_callback` feeds a TensorBoard
``SummaryWriter`` when the user has one (``pip install tensorboard``), instead of a home-made
dashboard.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

__all__ = ["StepTelemetry", "imbalance", "jsonl_writer", "tensorboard_callback"]


def imbalance(values) -> float | None:
    """max/mean − 1 (None for no values or a zero mean)."""
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0 or not np.isfinite(v).all() or v.mean() <= 0:
        return None
    return float(v.max() / v.mean() - 1.0)


@dataclass(frozen=True)
class StepTelemetry:
    """One step of one balancing group, the same on every rank of it."""

    step: int
    """Plans made so far by this balancer, this one included (1 = the first step)."""
    layout: str
    solver: str
    plan_ms: float
    """Planning wall time on this rank."""
    predicted: list[float]
    """Per rank: the plan's predicted time, in the cost model's units."""
    predicted_s: list[float] | None
    """Per rank: predicted seconds of the balanced region, when the model is in seconds (a
    calibrated profile or the online fit): layers × predicted."""
    measured_s: list[float] | None
    """Per rank: measured seconds of the balanced region (``measure=True``), else None."""
    imbalance_before: float
    """Predicted max/mean − 1 without balancing."""
    imbalance_after: float
    """Predicted max/mean − 1 of this plan."""
    measured_imbalance: float | None
    """Measured max/mean − 1 (``measure=True``)."""
    gap_to_bound: float
    """Predicted makespan / lower bound."""
    tokens_moved: int
    bytes_moved: int
    """Bytes the route sent off their rank (tokens moved × bytes per routed token)."""
    coefficients: dict
    """The cost model the step was planned with: linear, quadratic, per_seq (per layer), units."""
    rank_speed: list[float] | None

    @property
    def prediction_errors(self) -> list[float] | None:
        """Per rank |predicted − measured| / measured (when both are in seconds)."""
        if self.predicted_s is None or self.measured_s is None:
            return None
        return [abs(p - m) / m if m > 0 else float("nan") for p, m in zip(self.predicted_s, self.measured_s)]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["prediction_errors"] = self.prediction_errors
        return d


def jsonl_writer(path: str | Path, *, rank: int | None = None) -> Callable[[StepTelemetry], None]:
    """A callback appending each record as one JSON line to ``path`` (created, truncated).

    Register it on every rank: with ``{rank}`` in ``path`` each rank writes its own file
    (``metrics_{rank}.jsonl``: with replicas, each balancing group's records); otherwise only
    rank 0 writes (every rank of a group holds the same record), so the file has one record per
    step. ``rank``: this process's rank (default: ``torch.distributed``'s, 0 without it)."""
    if rank is None:
        rank = _global_rank()
    text = str(path)
    per_rank = "{rank}" in text
    target = Path(text.format(rank=rank)) if per_rank else Path(text)
    if not per_rank and rank != 0:
        return lambda record: None
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("")

    def write(record: StepTelemetry) -> None:
        with target.open("a") as f:
            f.write(json.dumps(record.to_dict()) + "\n")

    return write


def _global_rank() -> int:
    try:
        import torch.distributed as dist
    except ImportError:
        return 0
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def tensorboard_callback(writer, prefix: str = "knapformer") -> Callable[[StepTelemetry], None]:
    """A callback logging the scalars of each record to a TensorBoard ``SummaryWriter`` (register
    it where the writer lives, typically rank 0 only: every rank of a group holds the same record)."""

    def log(record: StepTelemetry) -> None:
        scalars = {
            "plan_ms": record.plan_ms,
            "imbalance_before": record.imbalance_before,
            "imbalance_after": record.imbalance_after,
            "gap_to_bound": record.gap_to_bound,
            "tokens_moved": record.tokens_moved,
            "bytes_moved": record.bytes_moved,
        }
        if record.measured_imbalance is not None:
            scalars["measured_imbalance"] = record.measured_imbalance
        errors = record.prediction_errors
        if errors:
            scalars["prediction_error_median"] = float(np.median(errors))
        for name, value in scalars.items():
            writer.add_scalar(f"{prefix}/{name}", value, record.step)
        for name in ("linear", "quadratic", "per_seq"):
            writer.add_scalar(f"{prefix}/coef_{name}", record.coefficients[name], record.step)

    return log
