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

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import demo_batch, demo_loss, demo_rank  # noqa: E402

from knapformer.distributed import ops  # noqa: E402
from knapformer.testing import run_distributed  # noqa: E402

MODES = ("unbalanced", "balanced", "balanced, serialised")


def _worker(rank: int, world: int, reps: int, top: int) -> dict:
    model, bal, mcfg, cfg = demo_rank(rank, world)
    serial = {"on": False}
    exchange = ops._exchange

    def handshake_exchange(x, send, recv, group, **kw):
        # rank 0 finishes its segment, then releases rank 1 (barrier) and waits in the exchange
        # while rank 1 computes the same segment; rank 1 waits for the next release afterwards
        if not serial["on"]:
            return exchange(x, send, recv, group, **kw)
        if rank == 0:
            dist.barrier()
            return exchange(x, send, recv, group, **kw)
        out = exchange(x, send, recv, group, **kw)
        dist.barrier()
        return out

    ops._exchange = handshake_exchange
    b = demo_batch(rank, world, 1, mcfg, cfg)
    busy: dict[str, list[float]] = {m: [] for m in MODES}
    ops_ms: dict[str, dict[str, float]] = {m: {} for m in MODES}
    for i in range(reps + 1):  # the first round warms up
        for mode in MODES:
            dist.barrier()
            loss = demo_loss(model, b, bal, mode)
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
            (
                (
                    sum(r["ops_ms"]["balanced, serialised"].get(k, 0) for r in res),
                    sum(r["ops_ms"]["unbalanced"].get(k, 0) for r in res),
                    k,
                )
                for k in keys
            ),
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
