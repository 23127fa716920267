"""The closed-loop scenario that the tests run on simulated time and the benchmark on real time.

A tiny reference Transformer trained under layout ``g1n{world}`` (whole sequences, so the cost
model alone decides the balance) on long-tailed lengths that differ every step
(:func:`long_tailed_lens`), with the balancer timing itself and (optionally) refitting its cost
model online. What one step's timed region holds besides the model is a callback, ``work``:

- the tests advance a :class:`~knapformer.testing.clock.SimulatedClock` by the seconds the
  rank's plan would take on a simulated machine (deterministic: the verdict never depends on
  load);
- ``benchmarks/closed_loop.py`` runs a slow rank's blocks once more (real work, timed by the
  thread's CPU clock) and reports what it measured.

Needs torch and torch.distributed (every rank of the world calls these functions alike).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from knapformer.config import BalancerConfig
from knapformer.data.batches import batch_from_lens
from knapformer.distributed import SequenceBalancer
from knapformer.models import Transformer, TransformerConfig
from knapformer.plan import Plan
from knapformer.telemetry import StepTelemetry
from knapformer.workload import WorkloadModel

__all__ = ["PROFILE", "TINY", "StepWork", "long_tailed_lens", "model_digest", "run_loop", "train_step"]

TINY = TransformerConfig(in_dim=16, dim=64, num_heads=4, num_layers=2, out_dim=16)
"""transformer-tiny's size: a step of ~1,000 tokens costs a few milliseconds of CPU."""
PROFILE = Path(__file__).resolve().parent.parent.parent / "profiles" / "cpu-transformer-tiny.json"
"""The offline calibrated profile of :data:`TINY` on this project's CPU machine (seconds per layer)."""

StepWork = Callable[[Transformer, SequenceBalancer, Plan, int], None]
"""``work(model, balancer, plan, step)``: run inside the timed region, after the forward and
before the backward reaches ``route``."""


def long_tailed_lens(step: int, rank: int) -> list[int]:
    """Long-tailed lengths, different every step: 12–23 short ones per rank, and every even
    rank also holds one of 450–600 tokens, whose cost (how much of it is attention) decides how
    many short ones it should give away — so a wrong γ balances measurably worse."""
    rng = np.random.default_rng([step, rank])
    lens = np.clip(rng.lognormal(3.6, 0.7, size=int(rng.integers(12, 24))), 8, 200).astype(int).tolist()
    if rank % 2 == 0:
        lens.append(int(rng.integers(450, 600)))
    return lens


def model_digest(model: WorkloadModel) -> str:
    """A short digest of a cost model's coefficients and per-call seconds (equal on every rank
    exactly when the ranks plan with the same model)."""
    d = {k: v for k, v in model.to_dict().items() if k != "meta"}
    d["per_call"] = model.meta.get("per_call_seconds", 0.0)
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def train_step(model: Transformer, bal: SequenceBalancer, rank: int, step: int, work: StepWork | None = None) -> Plan:
    """Plan, forward, ``work`` (module docstring), backward: one training step on
    :func:`long_tailed_lens`. Returns the step's plan."""
    lens = long_tailed_lens(step, rank)
    c = model.cfg
    b = batch_from_lens(
        lens, [0] * len(lens), seed=1, rank=rank, step=step, in_dim=c.in_dim, vec_dim=1, out_dim=c.out_dim
    )
    plan = bal.plan(lens)
    out = model(b.x, b.seq_lens, executor=bal)
    if work is not None:
        work(model, bal, plan, step)
    ((out - b.target) ** 2).mean().backward()
    model.zero_grad(set_to_none=True)
    return plan


def run_loop(
    rank: int,
    world: int,
    cost: WorkloadModel,
    steps: int,
    *,
    first_step: int = 0,
    work: StepWork | None = None,
    setup: Callable[[SequenceBalancer], None] | None = None,
    **settings,
) -> tuple[list[dict], BalancerConfig]:
    """Train ``steps`` steps (batches ``first_step``, ...) of :data:`TINY` with a timing
    balancer (``settings``: more :class:`~knapformer.config.BalancerConfig` fields; communication
    is unpriced, so the runs fit and compare the compute model alone). ``setup(balancer)`` runs
    once before the first step (e.g. :func:`~knapformer.testing.clock.use_clock`). Returns this
    rank's telemetry per step as dicts, each with its plan's per-rank ``features`` (one row per
    cost term, in :data:`~knapformer.cost_terms.COST_TERMS` order) and the ``digest`` of the
    model planned with next, and the balancer's final settings (the recalibrated cost model and
    speeds, when on)."""
    torch.manual_seed(0)
    model = Transformer(TINY)
    cfg = BalancerConfig(layout=f"g1n{world}", cost=cost, measure=True, link="free", **settings)
    bal = SequenceBalancer(cfg)
    if setup is not None:
        setup(bal)
    records: list[dict] = []

    def keep(rec: StepTelemetry) -> None:
        records.append(rec.to_dict() | {"digest": model_digest(bal.online_model())})

    bal.on_step(keep)
    features = []
    for step in range(first_step, first_step + steps):
        features.append(train_step(model, bal, rank, step, work).features().matrix().T.tolist())
    bal.flush()
    return [r | {"features": f} for r, f in zip(records, features, strict=True)], bal.planning_config
