"""Workers for the closed-loop tests: a real model trained on real gloo ranks with the balancer
timing itself, refitting its cost model online and reporting telemetry — on *simulated* time.

Each rank's timer reads a :class:`~knapformer.testing.SimulatedClock` that the step advances by
the seconds the rank's plan would take on a simulated machine (:class:`Machine`: a cost model
in seconds, per-rank speeds, deterministic noise and spikes). So the closed loop's whole logic
runs as in training and every verdict is exact, whatever else the machine is doing; what the
loop achieves on real timings is measured by ``benchmarks/closed_loop.py``.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from knapformer import SequenceBalancer, WorkloadModel
from knapformer.config import BalancerConfig
from knapformer.cost_terms import coefficients, with_coefficients
from knapformer.models import Transformer
from knapformer.plan import SolverOptions
from knapformer.plan.plan import RankFeatures
from knapformer.testing import SimulatedClock, blocking_exchanges, use_clock
from knapformer.testing.closed_loop import PROFILE, TINY, long_tailed_lens, model_digest, run_loop, train_step

CFG = TINY
QUICK = SolverOptions(bnb_nodes=2_000)
"""Every run plans with a tenth of the exact search's default node budget (the 2-rank steps have
~37 sequences, where the full search costs ~70 ms a plan): the same for every setting compared."""


@dataclasses.dataclass(frozen=True)
class Machine:
    """A simulated machine: rank r's step takes ``layers · (features · coef / speed[r] + d)``
    seconds (the online fit's form), times a lognormal noise of ``noise`` (σ) and, on about one rank-step in
    ``spike_every``, a 2× spike (a GC pause) — both drawn from (seed, step, rank), so every run
    measures the same seconds."""

    truth: WorkloadModel
    speed: tuple[float, ...]
    noise: float = 0.05
    spike_every: int = 25
    seed: int = 11

    def work(self, f: RankFeatures) -> np.ndarray:
        """(S,) noiseless seconds of every rank of a plan."""
        per_call = float(self.truth.meta.get("per_call_seconds", 0.0))
        return self.truth.num_layers * (f.matrix() @ coefficients(self.truth) / np.asarray(self.speed) + per_call)

    def seconds(self, f: RankFeatures, rank: int, step: int) -> float:
        rng = np.random.default_rng([self.seed, step, rank])
        spike = 2.0 if rng.random() < 1.0 / self.spike_every else 1.0
        return float(self.work(f)[rank]) * math.exp(self.noise * rng.standard_normal()) * spike


def machine(world: int, slow: bool) -> Machine:
    """This test's machine: the CPU profile with attention 1.5× dearer than the profile says (so
    the offline profile is good, not exact); with ``slow`` the last rank at half speed."""
    profile = WorkloadModel.from_profile(PROFILE)
    c = coefficients(profile) * np.asarray([1.0, 1.5, 1.0])
    truth = with_coefficients(profile, c.tolist(), meta=profile.meta)
    return Machine(truth, tuple([1.0] * (world - 1) + [0.5 if slow else 1.0]))


def _simulated(rank: int, m: Machine) -> tuple:
    """(setup, work, truth) for :func:`run_loop`: the balancer's timer on a simulated clock,
    advanced by the machine's seconds for this rank's plan inside the timed region; ``truth``
    collects every step's noiseless seconds of all ranks."""
    clock = SimulatedClock()
    truth: list[list[float]] = []

    def work(model, bal, plan, step):
        f = plan.features()
        truth.append(m.work(f).tolist())
        clock.advance(m.seconds(f, rank, step))

    return (lambda bal: use_clock(bal, clock)), work, truth


EVAL_STEPS = (100, 101, 102, 103, 104, 105)


def evaluate(rank: int, world: int, runs: dict[str, tuple[BalancerConfig, Machine]]) -> dict:
    """Each run's final settings (its cost model and speeds, frozen) plan held-out batches;
    returns per run and batch the machine's noiseless seconds of every rank and the frozen
    model's predicted seconds (None for a model in cost units)."""
    out: dict[str, list] = {}
    for name, (config, m) in runs.items():
        bal = SequenceBalancer(dataclasses.replace(config, measure=False, recalibrate=False, estimate_speed=False))
        records: list = []
        bal.on_step(records.append)  # untimed: each plan's record (its prediction) comes at once
        rows = []
        for step in EVAL_STEPS:
            plan = bal.plan(long_tailed_lens(step, rank))
            rows.append({"seconds": m.work(plan.features()).tolist(), "predicted_s": records[-1].predicted_s})
        out[name] = rows
    return out


def check_recalibration(rank: int, world: int, steps: int) -> dict:
    """Two online runs on the same batches, ``steps`` steps each, on the simulated machine: γ 10×
    too large, and (the last rank at half speed) the calibrated profile with speed estimation;
    then their final settings and the offline profile's (without and with the slow rank) plan
    held-out batches (:func:`evaluate`)."""
    profile = WorkloadModel.from_profile(PROFILE)
    wrong = WorkloadModel(d_model=64, gamma=10 * profile.gamma_equivalent, num_layers=CFG.num_layers)
    offline = BalancerConfig(layout=f"g1n{world}", cost=profile, measure=True, link="free", solver_options=QUICK)
    even, slow = machine(world, False), machine(world, True)
    out: dict = {}
    finals = {
        "offline": (offline, even),
        "slow_offline": (offline, slow),
        "wrong": (dataclasses.replace(offline, cost=wrong), even),
    }
    for name, cost, m, settings in (
        ("online", wrong, even, {}),
        ("slow_online", profile, slow, {"estimate_speed": True}),
    ):
        setup, work, truth = _simulated(rank, m)
        records, final = run_loop(
            rank, world, cost, steps, setup=setup, work=work, recalibrate=True, solver_options=QUICK, **settings
        )
        out[name] = [r | {"true_s": t} for r, t in zip(records, truth, strict=True)]
        finals[name] = (final, m)
    out["eval"] = evaluate(rank, world, finals)
    return out


def count_collectives(rank: int, world: int, measure: bool) -> dict:
    """Collectives (and host syncs of CUDA tensors: none on CPU) per step, timing on or off."""
    import torch.distributed as dist

    counts = {"all_gather": 0, "all_reduce": 0, "all_to_all_single": 0}
    real = {name: getattr(dist, name) for name in counts}

    def counting(name):
        def wrapped(*a, **k):
            counts[name] += 1
            return real[name](*a, **k)

        return wrapped

    for name in counts:
        setattr(dist, name, counting(name))
    try:
        torch.manual_seed(0)
        model = Transformer(CFG)
        bal = SequenceBalancer(BalancerConfig(layout=f"g{world}n1", cost=WorkloadModel(d_model=64), measure=measure))
        per_step = []
        for step in range(3):
            before = dict(counts)
            train_step(model, bal, rank, step)
            per_step.append({k: counts[k] - before[k] for k in counts})
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    return {"per_step": per_step, "measured": bal.last_step.measured_s if bal.last_step else None}


SLOW = 3.0
"""How many times longer rank 1's blocks take in :func:`wall_clock_loop` (a slow GPU)."""
BLOCK_S = 0.01
"""Simulated seconds of one block's forward per 1,000 tokens on a rank at full speed."""


def wall_clock_loop(rank: int, world: int, steps: int, layout: str, pause_exchanges: bool = True) -> dict:
    """``timer="wall"`` on a simulated clock, every exchange blocking it as a collective blocks
    the host (or a CUDA stream): each block's forward takes :data:`BLOCK_S` per 1,000 tokens it
    holds, :data:`SLOW`× that on rank 1 (a slow GPU); the prior's γ is 50× too large, lengths
    differ between ranks; the cost model is refitted online with speeds estimated. Returns every
    rank's measured seconds per step and its own block seconds, the final speeds and whether
    the online fit moved off the prior. ``pause_exchanges=False`` times the whole region instead
    (what CUDA events around the region measured: the slowest peer on every rank)."""
    clock = SimulatedClock()
    torch.manual_seed(0)
    model = Transformer(CFG)
    own: list[float] = [0.0]

    def block_work(_module, inputs, _output):
        s = BLOCK_S * inputs[0].shape[0] / 1000 * (SLOW if rank == 1 else 1.0)
        own[0] += s
        clock.advance(s)

    for block in model.blocks:
        block.register_forward_hook(block_work)
    prior = WorkloadModel(d_model=64, gamma=50.0, num_layers=CFG.num_layers)
    cfg = BalancerConfig(layout=layout, cost=prior, timer="wall", recalibrate=True, estimate_speed=True)
    bal = SequenceBalancer(dataclasses.replace(cfg, recalibrate_warmup=1))
    use_clock(bal, clock)
    records = []
    bal.on_step(records.append)
    blocks = []
    with blocking_exchanges(clock, pause_timer=pause_exchanges):
        for step in range(steps):
            own[0] = 0.0
            train_step(model, bal, rank, step)
            blocks.append(own[0])
        bal.flush()
    return {
        "measured": [r.measured_s for r in records],
        "own": blocks,
        "speeds": list(bal.planning_config.rank_speed or []),
        "moved": model_digest(bal.online_model()) != model_digest(prior),
    }
