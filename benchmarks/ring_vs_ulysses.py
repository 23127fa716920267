"""Ring attention vs Ulysses on a group where both apply: 2 gloo ranks, 4 heads, one sequence
of L tokens on each rank, both sequences on the group (0, 1) — as Ulysses over 2 (each rank
gets all L tokens of 2 heads) or as a ring of 2 (each rank keeps its L/2 tokens of all heads and
passes K/V blocks).

    python benchmarks/ring_vs_ulysses.py [--lens 1024 4096 8192] [--iters 7] [--out runs/bench/ring_vs_ulysses.json]

Per call of ``SequenceBalancer.attention`` (fp32, head dim 64, routed once outside the timing):
forward and forward + backward time (per-rank median of thread CPU time over ``--iters``; the
2 ranks share this VM's 2 cores) and the bytes a rank sends to the other rank (counted at
``all_to_all_single``). ``local`` is the same attention of one rank's share computed without
any exchange (SDPA on L tokens × 2 heads), what either layout cannot go below. Blocks of the
ring run PyTorch's fused CPU flash kernel (with its log-sum-exp); Ulysses runs SDPA.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _common import print_table, write_json  # noqa: E402

from knapformer import SequenceBalancer, WorkloadModel  # noqa: E402
from knapformer.attention import varlen_attention  # noqa: E402
from knapformer.plan import plan_from_groups  # noqa: E402
from knapformer.testing import run_distributed  # noqa: E402

HEADS, HEAD_DIM = 4, 64


def _counting(counter: dict):
    real = dist.all_to_all_single

    def wrapped(out, inp, output_split_sizes=None, input_split_sizes=None, group=None, **kw):
        me = dist.get_rank(group)
        counter["bytes"] += sum(s for r, s in enumerate(input_split_sizes) if r != me) * inp.element_size()
        counter["calls"] += 1
        return real(
            out, inp, output_split_sizes=output_split_sizes, input_split_sizes=input_split_sizes, group=group, **kw
        )

    return wrapped


def _median(fn, iters: int, *args) -> float:
    fn(*args)
    times = []
    for _ in range(iters):
        dist.barrier()
        t = time.thread_time()
        fn(*args)
        times.append(time.thread_time() - t)
    return statistics.median(times)


def worker(rank: int, world: int, lens: list[int], iters: int) -> list[dict]:
    model = WorkloadModel(d_model=HEADS * HEAD_DIM, num_heads=HEADS)
    bal = SequenceBalancer(f"g1n{world}", model)
    counter = {"bytes": 0, "calls": 0}
    dist.all_to_all_single = _counting(counter)
    rows = []
    for L in lens:
        g = torch.Generator().manual_seed(L)
        x = torch.randn(L, 3, HEADS, HEAD_DIM, generator=g)
        for name, ring in (("ulysses", 1), ("ring", 2)):
            bal.use_plan(plan_from_groups([[L]] * world, [(0, 1)], [0] * world, model, ring=[ring]))
            q, k, v = (t.contiguous().requires_grad_() for t in bal.route(x).unbind(1))

            def fwd(q, k, v):
                return bal.attention(q, k, v)

            def fwd_bwd(q, k, v):
                bal.attention(q, k, v).sum().backward()

            counter.update(bytes=0, calls=0)
            fwd(q, k, v)
            fwd_bytes, fwd_calls = counter["bytes"], counter["calls"]
            counter.update(bytes=0, calls=0)
            fwd_bwd(q, k, v)
            both_bytes, both_calls = counter["bytes"], counter["calls"]
            rows.append(
                {
                    "L": L,
                    "layout": name,
                    "fwd_ms": 1e3 * _median(fwd, iters, q, k, v),
                    "fwd_bwd_ms": 1e3 * _median(fwd_bwd, iters, q, k, v),
                    "fwd_MB": fwd_bytes / 1e6,
                    "fwd_bwd_MB": both_bytes / 1e6,
                    "collectives": both_calls,
                    "fwd_collectives": fwd_calls,
                }
            )
        # the floor: one rank's share of the attention with no exchange (L tokens, 2 of 4 heads)
        qs = x[:, 0, : HEADS // 2].contiguous()
        cu = torch.tensor([0, L], dtype=torch.int32)
        local = _median(varlen_attention, iters, qs, qs, qs, cu, L)
        rows.append({"L": L, "layout": "local", "fwd_ms": 1e3 * local})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lens", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--out", default="runs/bench/ring_vs_ulysses.json")
    args = ap.parse_args()
    per_rank = run_distributed(worker, 2, args.lens, args.iters, timeout=1800)
    rows = []
    for i, r0 in enumerate(per_rank[0]):
        row = dict(r0)
        for key in ("fwd_ms", "fwd_bwd_ms"):
            if key in row:
                row[key] = max(pr[i][key] for pr in per_rank)  # the slower rank sets the pace
        rows.append(row)
    by = {(r["L"], r["layout"]): r for r in rows}
    for L in args.lens:
        ring, uly = by[(L, "ring")], by[(L, "ulysses")]
        ring["vs_ulysses_fwd"] = ring["fwd_ms"] / uly["fwd_ms"]
        ring["vs_ulysses_fwd_bwd"] = ring["fwd_bwd_ms"] / uly["fwd_bwd_ms"]
        ring["bytes_vs_ulysses"] = ring["fwd_bwd_MB"] / uly["fwd_bwd_MB"]
    print_table(
        rows,
        [
            ("L", "d"),
            ("layout", "s"),
            ("fwd_ms", ".1f"),
            ("fwd_bwd_ms", ".1f"),
            ("fwd_MB", ".2f"),
            ("fwd_bwd_MB", ".2f"),
            ("collectives", "d"),
            ("vs_ulysses_fwd", ".2f"),
            ("vs_ulysses_fwd_bwd", ".2f"),
            ("bytes_vs_ulysses", ".2f"),
        ],
    )
    write_json(args.out, rows, heads=HEADS, head_dim=HEAD_DIM, ranks=2, iters=args.iters)


if __name__ == "__main__":
    main()
