"""Causal ring attention: per-member work under the zigzag cut vs the contiguous cut it replaced.

    python benchmarks/causal_ring_balance.py [--measure-len 4096] [--iters 5]
        [--out runs/bench/causal_ring_balance.json]

1. *Counted*: one sequence of L tokens on a ring group of k = u·r ranks; for every member, the
   query-key pairs its block attends to over all rounds, from the pieces the ring's forward
   runs (``knapformer.distributed.ring.pair_work``). Spread = max / mean − 1 over members
   (contiguous: (2r − 1)/r − 1 for long sequences).
2. *Measured*: 4 gloo ranks, a pure ring (r = 4, u = 1), 2 heads of dim 64, fp32, one causal
   sequence of ``--measure-len`` tokens; per rank the median thread CPU time of forward +
   backward of ``SequenceBalancer.attention`` over ``--iters`` (this VM's 2 cores time-share 4
   ranks; thread CPU time counts a rank's own compute, not its waits), and the spread of those
   over ranks.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _common import print_table, write_json  # noqa: E402

from knapformer import SequenceBalancer, WorkloadModel  # noqa: E402
from knapformer.distributed.ring import pair_work  # noqa: E402
from knapformer.distributed.spec import build_route_spec  # noqa: E402
from knapformer.plan import plan_from_groups  # noqa: E402
from knapformer.plan.plan import chunk_table  # noqa: E402

MODEL = WorkloadModel(d_model=128, num_heads=2, causal=True)
CASES = [(r, u, L) for r in (2, 4, 8, 16) for u in (1, 8) for L in (8192, 131072)] + [(8, 8, 250_000)]


def plans(k: int, r: int, L: int):
    """The zigzag plan the planner cuts, and the contiguous cut of the same groups."""
    zig = plan_from_groups([[L]] + [[] for _ in range(k - 1)], [tuple(range(k))], [0], MODEL, ring=[r])
    return {"zigzag": zig, "contiguous": replace(zig, chunks=chunk_table(zig.index, zig.groups, zig.seq_group))}


def counted() -> list[dict]:
    rows = []
    for r, u, L in CASES:
        k = r * u
        for name, plan in plans(k, r, L).items():
            work = np.array([pair_work(build_route_spec(plan, m).entries[0], causal=True) for m in range(k)], float)
            rows.append(
                {"part": "counted", "cut": name, "r": r, "u": u, "L": L, "spread": work.max() / work.mean() - 1}
            )
    return rows


def worker(rank: int, world: int, L: int, iters: int) -> dict:
    bal = SequenceBalancer(f"g1n{world}", MODEL)
    g = torch.Generator().manual_seed(L)
    x = torch.randn(L if rank == 0 else 0, 3, 2, 64, generator=g)
    out = {}
    for name, plan in plans(world, world, L).items():
        bal.use_plan(plan)
        q, k, v = (t.contiguous().requires_grad_() for t in bal.route(x).unbind(1))

        def step(q=q, k=k, v=v):
            bal.attention(q, k, v, causal=True).sum().backward()

        step()
        times = []
        for _ in range(iters):
            dist.barrier()
            t = time.thread_time()
            step()
            times.append(time.thread_time() - t)
        out[name] = statistics.median(times)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--measure-len", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default="runs/bench/causal_ring_balance.json")
    args = ap.parse_args()
    rows = counted()
    from knapformer.testing import run_distributed

    per_rank = run_distributed(worker, 4, args.measure_len, args.iters, timeout=1800)
    for name in ("zigzag", "contiguous"):
        t = np.array([pr[name] for pr in per_rank])
        rows.append(
            {
                "part": "measured",
                "cut": name,
                "r": 4,
                "u": 1,
                "L": args.measure_len,
                "spread": t.max() / t.mean() - 1,
                "slowest_ms": 1e3 * t.max(),
                "per_rank_ms": " ".join(f"{1e3 * x:.0f}" for x in t),
            }
        )
    print_table(
        rows,
        [
            ("part", "s"),
            ("cut", "s"),
            ("r", "d"),
            ("u", "d"),
            ("L", "d"),
            ("spread", ".4f"),
            ("slowest_ms", ".0f"),
            ("per_rank_ms", "s"),
        ],
    )
    write_json(args.out, rows, measured_ranks=4, heads=2, head_dim=64, iters=args.iters)


if __name__ == "__main__":
    main()
