"""Closed loop on real timings: online recalibration from a wrong γ, and from the profile with
one rank computing twice as long, measured on real gloo ranks (reported, not asserted).

    python benchmarks/closed_loop.py [--ranks 2 4] [--repeats 3] [--out runs/bench/closed_loop.json]

The scenario of ``tests/test_closed_loop.py`` (``knapformer.testing.closed_loop``: the tiny
reference Transformer under g1, long-tailed lengths that differ every step), timed by each
rank's thread CPU clock instead of the test's simulated one. Per rank count and repeat:

1. warm-up: 10 steps with the profile (a fresh process gets faster for tens of steps);
2. ``online``: 16 + 32 steps from γ 10× too large with ``recalibrate``; ``slow_online``: the
   same from the calibrated profile with ``estimate_speed``, the last rank running its blocks
   twice (its own real work, inside the timed region);
3. every run's final settings frozen, and the offline profile's (with and without the slow
   rank), take turns on 6 held-out batches, 5 repeats each (each rank's median kept).

Reported: the online model's median relative error on the 32 judged steps (each predicted
before it ran) beside the *in-hindsight floor* (the best model of the same form fitted to those
very steps: what the machine's noise leaves to any such model), the held-out imbalance
(max/mean − 1 of the measured seconds) of each setting, and the slow rank's estimated speed.
With a core per rank each rank is pinned to its own; 4 ranks share 2 cores (unpinned).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import print_table, write_json  # noqa: E402

from knapformer import SequenceBalancer, WorkloadModel  # noqa: E402
from knapformer.config import BalancerConfig  # noqa: E402
from knapformer.models import LocalExecutor, Transformer  # noqa: E402
from knapformer.testing import keep_freed_memory, pin_to_core, run_distributed  # noqa: E402
from knapformer.testing.closed_loop import PROFILE, TINY, run_loop, train_step  # noqa: E402

N, JUDGED, WARMUP_STEPS = 16, 32, 10
EVAL_STEPS, EVAL_REPEATS = (100, 101, 102, 103, 104, 105), 5


def _twice(rank: int, slow_rank: int | None):
    """``work`` for :func:`run_loop`: on ``slow_rank``, the blocks' forward and backward once
    more on its routed tokens, without collectives (layout g1: routed chunks are whole
    sequences, so local attention over them is the same work) — a rank twice as slow."""

    def work(model, bal, plan, step):
        spec = bal.spec
        if rank != slow_rank or spec.num_routed == 0:
            return
        ex = LocalExecutor(spec.local_seq_lens)
        _, pos = bal.routed_positions()
        h = torch.randn(spec.num_routed, TINY.dim, requires_grad=True)
        for block in model.blocks:
            h = block(h, pos, ex)
        h.sum().backward()

    return work


def _evaluate(rank: int, world: int, runs: dict[str, tuple[BalancerConfig, int | None]]) -> dict:
    """Each run's frozen settings on the held-out batches, taking turns step by step (a change
    of the vCPUs' speed falls on all alike): per run and batch, the predicted seconds and every
    repeat's measured seconds of all ranks."""
    state = {}
    for name, (config, slow) in runs.items():
        torch.manual_seed(0)
        bal = SequenceBalancer(dataclasses.replace(config, measure=True, recalibrate=False, estimate_speed=False))
        records: list = []
        bal.on_step(records.append)
        state[name] = (Transformer(TINY), bal, records, _twice(rank, slow))
    out: dict[str, list] = {name: [] for name in runs}
    for step in EVAL_STEPS:
        for _, _, records, _ in state.values():
            records.clear()
        for _ in range(EVAL_REPEATS):
            for model, bal, _, work in state.values():
                train_step(model, bal, rank, step, work)
                bal.flush()
        for name, (_, _, records, _) in state.items():
            out[name].append({"predicted_s": records[0].predicted_s, "measured_s": [r.measured_s for r in records]})
    return out


def _worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    keep_freed_memory()  # page faults of re-grown buffers otherwise add spikes to a rank's CPU time
    pin_to_core(rank, world)
    profile = WorkloadModel.from_profile(PROFILE)
    wrong = WorkloadModel(d_model=TINY.dim, gamma=10 * profile.gamma_equivalent, num_layers=TINY.num_layers)
    offline = BalancerConfig(layout=f"g1n{world}", cost=profile, measure=True, link="free")
    run_loop(rank, world, profile, WARMUP_STEPS, first_step=200)
    slow = world - 1
    out: dict = {}
    finals = {
        "offline": (offline, None),
        "slow_offline": (offline, slow),
        "wrong": (dataclasses.replace(offline, cost=wrong), None),
    }
    for name, cost, slow_rank, settings in (
        ("online", wrong, None, {}),
        ("slow_online", profile, slow, {"estimate_speed": True}),
    ):
        work = _twice(rank, slow_rank)
        records, final = run_loop(rank, world, cost, N + JUDGED, work=work, recalibrate=True, **settings)
        out[name] = records
        finals[name] = (final, slow_rank)
    out["eval"] = _evaluate(rank, world, finals)
    return out


def hindsight_floor(records: list[dict], rank_speed: bool = False) -> float:
    """The median relative error of the best model of the online fit's form (seconds ≈
    (a·tokens + b·attn + c·seqs) / speed_r + d, non-negative; speeds only with ``rank_speed``)
    fitted in hindsight to the judged steps themselves. Solved independently of the library:
    relative least squares on every subset of coefficients, the best feasible one; speeds by
    three rounds of per-rank median ratios."""
    X = np.concatenate([np.asarray(r["features"]).T for r in records[N:]])  # (steps·ranks, 3)
    y = np.concatenate([np.asarray(r["measured_s"]) for r in records[N:]])
    rank = np.concatenate([np.arange(len(r["measured_s"])) for r in records[N:]])
    scale = np.ones(len(y))
    best = np.inf
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


def summarise(world: int, res: list[dict]) -> dict:
    """One table row from one run's results (rank 0's records: every rank gathered the same)."""
    first = res[0]
    row: dict = {"ranks": world}
    for run, speeds in (("online", False), ("slow_online", True)):
        errors = [e for r in first[run][N:] for e in r["prediction_errors"]]
        row[f"{run}_err"] = float(np.median(errors))
        row[f"{run}_floor"] = hindsight_floor(first[run], rank_speed=speeds)
    for name, batches in first["eval"].items():
        imb = []
        for batch in batches:
            t = np.median(np.asarray(batch["measured_s"]), axis=0)
            imb.append(t.max() / t.mean() - 1.0)
        row[f"imb_{name}"] = float(np.mean(imb))
    speed = first["slow_online"][-1]["rank_speed"]
    row["slow_speed"] = speed[-1] / statistics.median(speed[:-1])
    return row


COLUMNS = [
    ("ranks", "d"),
    ("online_err", ".3f"),
    ("online_floor", ".3f"),
    ("slow_online_err", ".3f"),
    ("slow_online_floor", ".3f"),
    ("imb_offline", ".3f"),
    ("imb_wrong", ".3f"),
    ("imb_online", ".3f"),
    ("imb_slow_offline", ".3f"),
    ("imb_slow_online", ".3f"),
    ("slow_speed", ".2f"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--repeats", type=int, default=3, help="whole runs per rank count (each a fresh spawn)")
    ap.add_argument("--out", default="runs/bench/closed_loop.json")
    args = ap.parse_args()
    rows = []
    for world in args.ranks:
        for rep in range(args.repeats):
            rows.append(summarise(world, run_distributed(_worker, world, timeout=1800)) | {"repeat": rep})
    print_table(rows, COLUMNS)
    for world in args.ranks:
        mine = [r for r in rows if r["ranks"] == world]
        med = {k: statistics.median(r[k] for r in mine) for k, _ in COLUMNS[1:]}
        print(f"{world} ranks, median of {len(mine)}: " + ", ".join(f"{k} {v:.3f}" for k, v in med.items()))
    write_json(args.out, rows, args=vars(args))


if __name__ == "__main__":
    main()
