"""Planning on the training loop's critical path: inline against plans made ahead in a
DataLoader worker process (issue 57).

    python benchmarks/plans_ahead.py [--gpus 64 512 4096] [--mixes realistic hires] [--steps 6]
        [--step-s 1.0] [--out runs/bench/plans_ahead.json]

One process stands for rank 0 of a ``--gpus``-rank job. Its "training step" is ``--step-s``
seconds of small CPU tensor ops (a 64×64 matmul, add, ReLU: dispatch-bound, as kernel
launches are), counted to give the main thread's op rate. Steps come from
``TokenBudgetBatchSampler`` over a synthetic manifest (``realistic``: seed 0; ``hires``:
seed 1; Flux.1-dev tokenisation, 65,536 tokens per GPU), planned for Flux.1-dev sizes with
``auto`` on ``h100`` links. Four ways to run the same steps:

- ``none``: no planning (the op rate's baseline);
- ``inline``: the solve and the route spec on the main thread before each step (what
  ``bal.plan`` does, less its two gathers of the lengths, which need the other ranks);
- ``thread``: ``PlannedSteps`` iterated in a thread of the main process, the next step's plan
  made while this one works (the solver holds the interpreter lock the loop needs);
- ``worker``: ``PlannedSteps`` in one DataLoader worker process; the main thread waits for
  the next step's plan (if the worker is behind) and runs ``use_plan``'s local part (validate,
  route spec, digest; its one small agreement needs the other ranks);
- ``plan_ahead``: the next step's lengths handed to the balancer's worker process at the start
  of the step (``bal.plan_ahead``: they ride on ``route``'s agreement, which needs the other
  ranks); the main thread takes the plan at the next ``plan`` (waiting if the worker is behind).

Columns: the solver's ms per step (median); critical-path planning ms per step (median, and the
worst) of each way; the worker's start (a fresh worker each round: its start and first plan are
not counted in its steps); the op rate ÷ ``none``'s (medians over the steps). Machines are
noisy: ``--rounds`` rounds run ``--per`` steps of each way in turn, so drift hits each alike.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import print_table, write_json  # noqa: E402

from knapformer.cluster import ModelShape, hardware  # noqa: E402
from knapformer.data import (  # noqa: E402
    PlannedSteps,
    TokenBudgetBatchSampler,
    manifest_seq_lens,
    synthetic_manifest,
    tokenizer_for_model,  # noqa: E402
)
from knapformer.distributed.ahead import AheadSolver  # noqa: E402
from knapformer.distributed.spec import build_route_spec, prepared_spec  # noqa: E402
from knapformer.integrations.registry import model_config  # noqa: E402
from knapformer.plan import Planner  # noqa: E402

MODEL = "diffusers-flux-dev"
SEEDS = {"realistic": 0, "hires": 1}


def _setup(mix: str, gpus: int, steps: int):
    tok = tokenizer_for_model(MODEL)
    n = 12 * gpus * (steps + 2)
    while True:
        m = synthetic_manifest(mix, n, seed=SEEDS[mix])
        lens, buckets = manifest_seq_lens(m, tok)
        sampler = TokenBudgetBatchSampler(
            np.asarray(lens, dtype=np.int64),
            65_536,
            buckets=np.asarray(buckets).tolist(),
            num_replicas=gpus,
            rank=0,
            seed=SEEDS[mix],
            drop_last=True,
            oversize="alone",
        )
        if len(sampler) >= steps:
            break
        n *= 2
    hw = hardware("h100")
    shape = ModelShape.from_config(model_config(MODEL)).with_context(tok.context_len(m.text_tokens))
    planner = Planner("auto", shape.workload(), link=hw.link(shape, units_per_second=hw.flop_units_per_second))
    return sampler, planner


def _work(seconds: float, x: torch.Tensor) -> float:
    """Small ops for ``seconds``: ops per second."""
    ops, t0 = 0, time.perf_counter()
    while (t := time.perf_counter() - t0) < seconds:
        for _ in range(20):
            torch.relu(x @ x * 1e-2 + 1.0)
        ops += 80
    return ops / t


def _local_use(plan) -> None:
    """``use_plan``'s work on this rank (its digest agreement aside): validate, route spec,
    digest — of which a plan from ``PlannedSteps`` brings the spec and digest made."""
    plan.validate()
    prepared_spec(plan, 0)
    plan.digest()


def _critical(sampler, planner, steps: int, step_s: float, x: torch.Tensor) -> dict:
    """Critical-path planning per step: inline (solve + route spec before the step) and from a
    DataLoader worker (wait for the step's plan + ``use_plan``'s local part), ``steps`` steps
    of ``step_s`` seconds of work each; the worker's start and first plan apart."""
    inline, solve, worker = [], [], []
    for step in itertools.islice(sampler.iter_steps(), steps):
        t0 = time.perf_counter()
        plan = planner([[int(sampler.lengths[i]) for i in b] for b in step])
        build_route_spec(plan, 0)
        inline.append(time.perf_counter() - t0)
        solve.append(plan.plan_seconds)
        _work(step_s, x)
    it = iter(DataLoader(PlannedSteps(sampler, planner), batch_size=None, num_workers=1, prefetch_factor=2))
    t0 = time.perf_counter()
    _local_use(next(it).plan)
    start = time.perf_counter() - t0
    for _ in range(steps - 1):
        _work(step_s, x)
        t0 = time.perf_counter()
        _local_use(next(it).plan)
        worker.append(time.perf_counter() - t0)
    del it
    # plan_ahead: the next step's lengths handed over at this step's route; the plan solved in
    # the balancer's worker process while the step works, taken at the next plan (the first
    # request pays the worker's start: not counted, as above)
    solver, ahead = AheadSolver(), []
    lens = [
        [[int(sampler.lengths[i]) for i in b] for b in step] for step in itertools.islice(sampler.iter_steps(), steps)
    ]
    solver.result(solver.submit(planner, lens[0], 0), planner, lens[0], 0)
    for k in range(1, steps):
        future = solver.submit(planner, lens[k], 0)
        _work(step_s, x)
        t0 = time.perf_counter()
        plan = solver.result(future, planner, lens[k], 0)
        prepared_spec(plan, 0)  # (built in the worker: a lookup here)
        plan.digest()
        ahead.append(time.perf_counter() - t0)
    solver.close()
    return {
        "ahead_ms": 1e3 * statistics.median(ahead),
        "ahead_ms_max": 1e3 * max(ahead),
        "solve_ms": 1e3 * statistics.median(solve),
        "inline_ms": 1e3 * statistics.median(inline),
        "inline_ms_max": 1e3 * max(inline),
        "worker_ms": 1e3 * statistics.median(worker),
        "worker_ms_max": 1e3 * max(worker),
        "worker_start_ms": 1e3 * start,
    }


def _rate_beside_worker(sampler, planner, pairs: int, window_s: float, solve_s: float, x: torch.Tensor) -> dict:
    """The loop's op rate with the worker planning against the worker stopped (SIGSTOP), in
    alternating windows of ``window_s`` (so that the VM's drift hits both alike): the median of
    the pairs' ratios. The worker is given enough steps to plan through every running window."""
    ahead = 2 + int(np.ceil(pairs * window_s / max(solve_s, 1e-3)))
    steps = PlannedSteps(sampler, planner)
    loader = DataLoader(steps, batch_size=None, num_workers=1, prefetch_factor=ahead)
    it = iter(loader)
    next(it)  # started, and planning the next `ahead` steps now
    pid = it._workers[0].pid
    ratios, running = [], []
    try:
        for _ in range(pairs):
            os.kill(pid, signal.SIGSTOP)
            stopped = _work(window_s, x)
            os.kill(pid, signal.SIGCONT)
            cpu0 = _proc_cpu(pid)
            on = _work(window_s, x)
            running.append((_proc_cpu(pid) - cpu0) / window_s)
            ratios.append(on / stopped)
    finally:
        os.kill(pid, signal.SIGCONT)
        del it
        try:  # a worker still planning its prefetched steps would share the next config's cores
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return {"worker_rate": statistics.median(ratios), "worker_busy": statistics.median(running)}


def _spin() -> None:
    a = np.random.default_rng(0).random((256, 256))
    while True:
        a = np.sqrt(a @ a.T / 256.0 + 1.0)


def _rate_beside_spinner(pairs: int, window_s: float, x: torch.Tensor) -> dict:
    """The control: the same windows beside a process that only computes (numpy, no planning),
    stopped and running in turn: what any busy process on the other core costs the loop here."""
    proc = multiprocessing.get_context("spawn").Process(target=_spin, daemon=True)
    proc.start()
    time.sleep(1.0)
    ratios = []
    try:
        for _ in range(pairs):
            os.kill(proc.pid, signal.SIGSTOP)
            stopped = _work(window_s, x)
            os.kill(proc.pid, signal.SIGCONT)
            ratios.append(_work(window_s, x) / stopped)
    finally:
        proc.kill()
    return {"spinner_rate": statistics.median(ratios)}


def _proc_cpu(pid: int) -> float:
    """CPU seconds the process has used (utime + stime from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rate_beside_thread(sampler, planner, rounds: int, phase_s: float, x: torch.Tensor) -> dict:
    """The loop's op rate with a thread of this process planning continuously against none,
    in alternating phases (a plan cannot be paused midway): the median of the pairs' ratios."""
    go, idle, quit_ = threading.Event(), threading.Event(), threading.Event()
    steps = list(itertools.islice(sampler.iter_steps(), 8))

    def plan_forever() -> None:
        for step in itertools.cycle(steps):
            idle.set()
            go.wait()
            idle.clear()
            if quit_.is_set():
                return
            planner([[int(sampler.lengths[i]) for i in b] for b in step])

    threading.Thread(target=plan_forever, daemon=True).start()
    ratios = []
    for _ in range(rounds):
        go.clear()
        idle.wait()  # the plan in flight done
        alone = _work(phase_s, x)
        go.set()
        beside = _work(phase_s, x)
        ratios.append(beside / alone)
    quit_.set()
    go.set()
    return {"thread_rate": statistics.median(ratios)}


def run_config(mix: str, gpus: int, args) -> dict:
    # enough steps for the worker to plan through every running window (plans take ~60 ms at
    # 64 GPUs, ~0.5 s at 4,096: worker_busy reports whether it did)
    ahead = int(np.ceil(args.pairs * args.window_s / (0.05 if gpus <= 64 else 0.1 if gpus <= 512 else 0.3)))
    sampler, planner = _setup(mix, gpus, args.steps + ahead + 4)
    x = torch.randn(64, 64)
    row = {"mix": mix, "gpus": gpus}
    row.update(_critical(sampler, planner, args.steps, args.step_s, x))
    row.update(_rate_beside_worker(sampler, planner, args.pairs, args.window_s, row["solve_ms"] / 1e3, x))
    row.update(_rate_beside_thread(sampler, planner, args.rounds, args.phase_s, x))
    row.update(_rate_beside_spinner(args.pairs, args.window_s, x))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, nargs="+", default=[64, 512, 4096])
    ap.add_argument("--mixes", nargs="+", default=["realistic", "hires"], choices=sorted(SEEDS))
    ap.add_argument("--steps", type=int, default=6, help="steps timed for the critical path")
    ap.add_argument("--step-s", type=float, default=1.0, help="seconds of small ops per training step")
    ap.add_argument("--pairs", type=int, default=30, help="window pairs (worker planning / stopped)")
    ap.add_argument("--window-s", type=float, default=0.2)
    ap.add_argument("--rounds", type=int, default=6, help="phase pairs (thread planning / idle)")
    ap.add_argument("--phase-s", type=float, default=0.5)
    ap.add_argument("--out", default="runs/bench/plans_ahead.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for mix in args.mixes:
        for gpus in args.gpus:
            rows.append(run_config(mix, gpus, args))
            print(".", end="", flush=True)
    print()
    print_table(
        rows,
        [
            ("mix", "s"),
            ("gpus", "d"),
            ("solve_ms", ".0f"),
            ("inline_ms", ".1f"),
            ("inline_ms_max", ".1f"),
            ("worker_ms", ".1f"),
            ("worker_ms_max", ".1f"),
            ("worker_start_ms", ".0f"),
            ("ahead_ms", ".1f"),
            ("ahead_ms_max", ".1f"),
            ("worker_rate", ".3f"),
            ("worker_busy", ".2f"),
            ("thread_rate", ".3f"),
            ("spinner_rate", ".3f"),
        ],
    )
    write_json(args.out, rows, **{k: v for k, v in vars(args).items() if k != "out"}, model=MODEL, hardware="h100")


if __name__ == "__main__":
    main()
