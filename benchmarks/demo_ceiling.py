"""How close to its ideal speedup can the demo get on this machine? The demo's two ranks, with
the balanced run's costs removed one at a time.

    python benchmarks/demo_ceiling.py [--reps 8] [--out runs/bench/demo_ceiling.json]

On the demo's batches (one per rep, every mode on the same batch, modes interleaved), forward +
backward only (no optimizer), each mode's step is timed from a common start to the last
rank's end (one monotonic clock on one machine):

- ``unbalanced``: no balancing; gives the ideal speedup (busy max/mean) as the demo does;
- ``balanced``: the real run (SequenceBalancer, Ulysses in one 2-rank bag);
- ``no transfer``: the same, but every all-to-all is replaced by a local buffer of the right
  shape and a barrier: no bytes move, every synchronisation stays;
- ``no transfer, no sync``: no barrier either; the ranks run their halves independently
  (what is left over the ideal is the executor's own work and two ranks sharing the machine).

``balanced`` minus ``no transfer`` is the time spent moving bytes, ``no transfer`` minus
``no sync`` the time lost to synchronising ranks whose speed fluctuates (sync jitter). The
outputs of the two ``no`` modes are garbage; only their timings mean something. The plan's
two all-gathers and the route/reverse input checks (three small all-reduces per forward) still
synchronise in every balanced mode.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import demo_batch, demo_loss, demo_rank, print_table, write_json  # noqa: E402

from knapformer.distributed import ops  # noqa: E402
from knapformer.testing import run_distributed  # noqa: E402

MODES = ("unbalanced", "balanced", "no transfer", "no transfer, no sync")


def _worker(rank: int, world: int, reps: int) -> dict:
    model, bal, mcfg, cfg = demo_rank(rank, world)
    real_exchange = ops._exchange
    mode_now = {"m": "balanced"}

    def exchange(x, send, recv, group, **kw):
        if mode_now["m"] == "balanced":
            return real_exchange(x, send, recv, group, **kw)
        if mode_now["m"] == "no transfer":
            dist.barrier(group=group)
        return x.new_zeros((sum(recv), *x.shape[1:]))

    ops._exchange = exchange
    rows: dict[str, list[tuple[float, float, float]]] = {m: [] for m in MODES}
    for rep in range(reps + 1):  # rep 0 warms up
        b = demo_batch(rank, world, rep, mcfg, cfg)
        for mode in MODES:
            mode_now["m"] = mode
            dist.barrier()
            start = time.perf_counter()
            busy0 = time.thread_time()
            demo_loss(model, b, bal, mode).backward()
            busy = time.thread_time() - busy0
            end = time.perf_counter()
            model.zero_grad(set_to_none=True)
            if rep:
                rows[mode].append((start, end, busy))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--out", default="runs/bench/demo_ceiling.json")
    args = ap.parse_args()
    res = run_distributed(_worker, 2, args.reps, timeout=1800)
    reps = range(args.reps)

    def wall(mode: str, i: int) -> float:  # common start to the last rank's end
        return max(r[mode][i][1] for r in res) - min(r[mode][i][0] for r in res)

    u_busy = [[r["unbalanced"][i][2] for r in res] for i in reps]
    ideal = sum(max(b) for b in u_busy) / sum(statistics.mean(b) for b in u_busy)
    u_wall = sum(wall("unbalanced", i) for i in reps)
    out = []
    for mode in MODES:
        w = sum(wall(mode, i) for i in reps)
        busy = statistics.mean(statistics.mean(r[mode][i][2] for r in res) for i in reps)
        busy_max = statistics.mean(max(r[mode][i][2] for r in res) for i in reps)
        out.append(
            {
                "mode": mode,
                "step_s": w / args.reps,
                "busy_mean_s": busy,
                "busy_max_s": busy_max,
                "speedup": u_wall / w,
                "of_ideal": u_wall / w / ideal,
            }
        )
    print(f"demo batches, 2 ranks, fwd+bwd, {args.reps} reps; ideal speedup {ideal:.3f}")
    print_table(
        out,
        [
            ("mode", "22s"),
            ("step_s", ".3f"),
            ("busy_mean_s", ".3f"),
            ("busy_max_s", ".3f"),
            ("speedup", ".3f"),
            ("of_ideal", ".1%"),
        ],
    )
    write_json(args.out, out, ideal_speedup=ideal, reps=args.reps)


if __name__ == "__main__":
    sys.exit(main())
