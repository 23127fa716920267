"""Where the balanced run's extra CPU goes: the demo's two ranks, with vs without balancing,
and balanced with the ranks *serialised* (never computing at the same time).

    python benchmarks/balanced_overhead.py [--reps 4] [--top 12] [--out runs/bench/balanced_overhead.json]

The demo reaches less than its ideal speedup partly because the balanced ranks spend more
thread CPU time in forward + backward than the unbalanced ranks do for the same FLOPs. This
separates two causes on the same batch, interleaved:

- ``balanced``: both ranks compute at once (the real run);
- ``balanced, serialised``: each backward segment between two all-to-alls runs on one rank
  while the other waits (a barrier handshake), so cores never compete; what is left over the
  unbalanced CPU time is the executor's own work (packing, permutations, more attention calls).

Backward only (forward has per-step checks that would need their own handshake); with
``--top N`` a torch.profiler table lists the ops whose self time grew most (serialised vs
unbalanced, summed over ranks).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from knapformer.data.batches import make_batch
from knapformer.dist import ops
from knapformer.models import LocalExecutor, build_model, preset
from knapformer.testing import keep_freed_memory, pin_to_core, run_distributed
from knapformer.tools.sim_config import DEMO_MIX
from knapformer.workload import WorkloadModel

MODES = ("unbalanced", "balanced", "balanced, serialised")


def _worker(rank: int, world: int, reps: int, top: int) -> dict:
    from knapformer.dist import SequenceBalancer

    torch.set_num_threads(1)
    pin_to_core(rank, world)
    keep_freed_memory()
    serial = {"on": False}
    exchange = ops._exchange

    def handshake_exchange(x, send, recv, group):
        # rank 0 finishes its segment, then releases rank 1 (barrier) and waits in the exchange
        # while rank 1 computes the same segment; rank 1 waits for the next release afterwards
        if not serial["on"]:
            return exchange(x, send, recv, group)
        if rank == 0:
            dist.barrier()
            return exchange(x, send, recv, group)
        out = exchange(x, send, recv, group)
        dist.barrier()
        return out

    ops._exchange = handshake_exchange
    mcfg = preset("mmdit-small")
    torch.manual_seed(0)
    model = build_model(mcfg)
    bal = SequenceBalancer("g2n1", WorkloadModel(d_model=mcfg.dim, num_layers=mcfg.num_layers))
    b = make_batch(DEMO_MIX, rank=rank, num_ranks=world, step=1, seed=0, scale=2, in_dim=mcfg.in_dim,
                   vec_dim=mcfg.vec_dim, out_dim=mcfg.out_dim, dtype=torch.float32)
    busy: dict[str, list[float]] = {m: [] for m in MODES}
    ops_ms: dict[str, dict[str, float]] = {m: {} for m in MODES}
    for i in range(reps + 1):  # the first round warms up
        for mode in MODES:
            dist.barrier()
            if mode == "unbalanced":
                ex = LocalExecutor(b.seq_lens)
            else:
                bal.plan(b.seq_lens)
                ex = bal
            out = model(b.x, b.seq_lens, b.txt_lens, b.t, b.vec, executor=ex)
            loss = ((out - b.target) ** 2).mean()
            serial["on"] = mode == "balanced, serialised"
            if serial["on"] and rank == 1:
                dist.barrier()  # wait for rank 0's first segment
            prof = None
            if top and i:
                from torch.profiler import ProfilerActivity, profile

                prof = profile(activities=[ProfilerActivity.CPU])
                prof.__enter__()
            c = time.thread_time()
            loss.backward()
            spent = time.thread_time() - c
            if prof is not None:
                prof.__exit__(None, None, None)
                for e in prof.key_averages():
                    if not e.key.startswith("_AllToAll") and "barrier" not in e.key:  # waits, not work
                        ops_ms[mode][e.key] = ops_ms[mode].get(e.key, 0.0) + e.self_cpu_time_total / 1e3 / reps
            if serial["on"] and rank == 0:
                dist.barrier()  # pairs with rank 1's barrier after the last exchange
            serial["on"] = False
            model.zero_grad(set_to_none=True)
            if i:
                busy[mode].append(spent)
    return {"busy": busy, "ops_ms": ops_ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--top", type=int, default=0, help="profile and list the N ops that grew most")
    ap.add_argument("--out", default="runs/bench/balanced_overhead.json")
    args = ap.parse_args()
    res = run_distributed(_worker, 2, args.reps, args.top, timeout=1800)
    sums = {m: sum(statistics.mean(r["busy"][m]) for r in res) for m in MODES}
    print("backward thread CPU time, summed over 2 ranks (mean of reps):")
    for m in MODES:
        per = "/".join(f"{statistics.mean(r['busy'][m]):.3f}" for r in res)
        print(f"  {m:22s} {sums[m]:7.3f} s  (per rank {per})  {sums[m] / sums['unbalanced']:.3f}x unbalanced")
    if args.top:
        keys = {k for r in res for m in ("balanced, serialised", "unbalanced") for k in r["ops_ms"][m]}
        rows = sorted(
            ((sum(r["ops_ms"]["balanced, serialised"].get(k, 0) for r in res),
              sum(r["ops_ms"]["unbalanced"].get(k, 0) for r in res), k) for k in keys),
            key=lambda t: t[1] - t[0],
        )
        print("ops that grew most (serialised vs unbalanced, ms per backward, both ranks):")
        for b_ms, u_ms, k in rows[: args.top]:
            print(f"  {b_ms - u_ms:+8.1f}  {k[:60]:60s} {u_ms:8.1f} -> {b_ms:8.1f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"backward_cpu_s": sums, "args": vars(args)}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
