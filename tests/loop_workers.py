"""Workers for the closed-loop tests: a real model trained a few steps on real gloo ranks with
the balancer timing itself, refitting its cost model online, and reporting telemetry."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from knapformer import SequenceBalancer, WorkloadModel
from knapformer.config import BalancerConfig
from knapformer.data.batches import batch_from_lens
from knapformer.models import Transformer, TransformerConfig

CFG = TransformerConfig(in_dim=16, dim=64, num_heads=4, num_layers=2, out_dim=16)
PROFILE = Path(__file__).resolve().parent.parent / "profiles" / "cpu-transformer-tiny.json"


def _lens(step: int, rank: int, world: int) -> list[int]:
    """Long-tailed lengths, different every step: 12–23 short ones per rank, and every even
    rank also holds one of 450–600 tokens, whose cost (how much of it is attention) decides how many
    short ones it should give away — so a wrong γ balances measurably worse."""
    rng = np.random.default_rng([step, rank])
    lens = np.clip(rng.lognormal(3.6, 0.7, size=int(rng.integers(12, 24))), 8, 200).astype(int).tolist()
    if rank % 2 == 0:
        lens.append(int(rng.integers(450, 600)))
    return lens


def _digest(model: WorkloadModel) -> str:
    d = {k: v for k, v in model.to_dict().items() if k != "meta"}
    d["per_call"] = model.meta.get("per_call_seconds", 0.0)
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def _shadow(model: Transformer, bal: SequenceBalancer) -> None:
    """The blocks' forward and backward once more on this rank's routed tokens, without
    collectives: a rank that computes twice as long for the same plan (layout g1: routed
    chunks are whole sequences, so local attention over them is the same work)."""
    from knapformer.models import LocalExecutor

    spec = bal.spec
    if spec.num_routed == 0:
        return
    ex = LocalExecutor(spec.local_seq_lens)
    _, pos = bal.routed_positions()
    h = torch.randn(spec.num_routed, CFG.dim, requires_grad=True)
    for block in model.blocks:
        h = block(h, pos, ex)
    h.sum().backward()


def _train_step(model, bal, rank, world, step, slow_rank) -> list[list[float]]:
    """One step; returns its plan's per-rank features (tokens, attention, sequences)."""
    lens = _lens(step, rank, world)
    b = batch_from_lens(lens, [0] * len(lens), seed=1, rank=rank, step=step, in_dim=16, vec_dim=1, out_dim=16)
    f = bal.plan(lens).features()
    out = model(b.x, b.seq_lens, executor=bal)
    if rank == slow_rank:
        _shadow(model, bal)  # inside the timed region: before the backward reaches route
    ((out - b.target) ** 2).mean().backward()
    model.zero_grad(set_to_none=True)
    return [np.asarray(v, dtype=np.float64).tolist() for v in (f.tokens, f.attn, f.seqs)]


def run_loop(
    rank: int,
    world: int,
    cost: WorkloadModel,
    steps: int,
    *,
    slow_rank: int | None,
    first_step: int = 0,
    **settings,
) -> tuple[list[dict], BalancerConfig]:
    """Train ``steps`` steps (batches ``first_step``, ...); ``slow_rank`` runs its blocks twice
    (:func:`_shadow`), so it computes twice as long for the same plan. Returns this rank's
    telemetry per step (with its plan's ``features``) and the balancer's final settings (the
    recalibrated cost model and speeds, when on)."""
    torch.manual_seed(0)
    model = Transformer(CFG)
    # unpriced: these runs fit the compute model (a measured link would keep work home on 4
    # ranks sharing 2 cores, and hide what the fit changes)
    cfg = BalancerConfig(layout=f"g1n{world}", cost=cost, measure=True, link="free", **settings)
    bal = SequenceBalancer(cfg)
    records = []
    bal.on_step(lambda rec: records.append(rec.to_dict() | {"digest": _digest(bal.online_model())}))
    features = [_train_step(model, bal, rank, world, step, slow_rank) for step in range(first_step, first_step + steps)]
    bal.flush()
    return [r | {"features": f} for r, f in zip(records, features, strict=True)], bal.planning_config


WARMUP_STEPS = 10
EVAL_STEPS = (100, 101, 102, 103, 104, 105)
EVAL_REPEATS = 5


def evaluate(rank: int, world: int, runs: dict[str, tuple[BalancerConfig, int | None]]) -> dict:
    """Each run's final settings (its cost model and speeds, frozen) on held-out batches,
    measured: the runs take turns step by step (a change of the vCPUs' speed falls on all of
    them alike), each batch's plan ``EVAL_REPEATS`` times. Returns per run and batch the
    predicted seconds (None for a model in cost units) and every repeat's measured seconds of
    all ranks."""
    state = {}
    for name, (config, slow) in runs.items():
        torch.manual_seed(0)
        cfg = dataclasses.replace(config, measure=True, recalibrate=False, estimate_speed=False)
        bal = SequenceBalancer(cfg)
        records: list = []
        bal.on_step(records.append)
        state[name] = (Transformer(CFG), bal, records, slow)
    out: dict[str, list] = {name: [] for name in runs}
    for step in EVAL_STEPS:
        for _, _, records, _ in state.values():
            records.clear()
        for _ in range(EVAL_REPEATS):
            for model, bal, _, slow in state.values():
                _train_step(model, bal, rank, world, step, slow)
                bal.flush()
        for name, (_, _, records, _) in state.items():
            out[name].append({"predicted_s": records[0].predicted_s, "measured_s": [r.measured_s for r in records]})
    return out


def check_recalibration(rank: int, world: int, steps: int) -> dict:
    """Two online runs on the same batches, ``steps`` steps each: γ 10× too large, and (one rank
    twice as slow) the calibrated profile with speed estimation; then their final settings and
    the offline profile's (without and with the slow rank) are measured together on held-out
    batches (:func:`evaluate`). With a core per rank, each rank is pinned to its own."""
    from knapformer.testing import keep_freed_memory, pin_to_core

    keep_freed_memory()  # page faults of re-grown buffers otherwise add spikes to a rank's CPU time
    # a rank that migrates between this VM's vCPUs changes speed by up to ~25% for seconds at a
    # time (pinned, the same plan's time varies ~2%); more ranks than cores stay unpinned (two
    # ranks pinned to one core measure worse: ~13% vs ~5% median noise)
    pin_to_core(rank, world)
    profile = WorkloadModel.from_profile(PROFILE)
    wrong = WorkloadModel(d_model=64, gamma=10 * profile.gamma_equivalent, num_layers=CFG.num_layers)
    offline = BalancerConfig(layout=f"g1n{world}", cost=profile, measure=True, link="free")
    # a fresh process runs its first tens of steps ever faster (allocator, first calls of each
    # kernel shape): warm it up, so the runs below measure the cost model, not that trend
    run_loop(rank, world, profile, WARMUP_STEPS, slow_rank=None, first_step=200)
    out: dict = {}
    finals = {
        "offline": (offline, None),
        "slow_offline": (offline, world - 1),
        "wrong": (dataclasses.replace(offline, cost=wrong), None),
    }
    for name, cost, slow, settings in (
        ("online", wrong, None, {}),
        ("slow_online", profile, world - 1, {"estimate_speed": True}),
    ):
        records, final = run_loop(rank, world, cost, steps, slow_rank=slow, recalibrate=True, **settings)
        out[name] = records
        finals[name] = (final, slow)
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
            lens = _lens(step, rank, world)
            b = batch_from_lens(lens, [0] * len(lens), seed=1, rank=rank, step=step, in_dim=16, vec_dim=1, out_dim=16)
            bal.plan(lens)
            out = model(b.x, b.seq_lens, executor=bal)
            ((out - b.target) ** 2).mean().backward()
            per_step.append({k: counts[k] - before[k] for k in counts})
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    return {"per_step": per_step, "measured": bal.last_step.measured_s if bal.last_step else None}


SLOW_S = 0.03
"""Seconds rank 1 sleeps in each block's forward in :func:`wall_clock_loop` (a slow GPU)."""


def wall_clock_loop(rank: int, world: int, steps: int, layout: str, pause_exchanges: bool = True) -> dict:
    """``timer="wall"`` (a gloo collective blocks the host like a CUDA stream waits for NCCL):
    rank 1 sleeps inside every block (a slow GPU), the prior's γ is 50x too large, lengths
    differ between ranks; the cost model is refitted online with speeds estimated. Returns
    every rank's measured seconds per step, the final speeds and whether the online fit moved
    off the prior. ``pause_exchanges=False`` times the whole region instead (what CUDA events
    around the region measured: the slowest peer on every rank)."""
    import time

    import knapformer.distributed.timing as timing

    if not pause_exchanges:
        timing.pause = timing.resume = lambda: None
    torch.manual_seed(0)
    model = Transformer(CFG)
    if rank == 1:
        for block in model.blocks:
            block.register_forward_hook(lambda *_: time.sleep(SLOW_S))
    prior = WorkloadModel(d_model=64, gamma=50.0, num_layers=CFG.num_layers)
    bal = SequenceBalancer(
        BalancerConfig(
            layout=layout, cost=prior, timer="wall", recalibrate=True, estimate_speed=True, recalibrate_warmup=1
        )
    )
    records = []
    bal.on_step(records.append)
    for step in range(steps):
        _train_step(model, bal, rank, world, step, None)
    bal.flush()
    return {
        "measured": [r.measured_s for r in records],
        "speeds": list(bal.planning_config.rank_speed or []),
        "moved": _digest(bal.online_model()) != _digest(prior),
    }
