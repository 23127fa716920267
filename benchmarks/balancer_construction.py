"""What building a ``SequenceBalancer`` costs as the group grows: time, sockets and memory per rank.

    python benchmarks/balancer_construction.py [--ranks 4 8 16 32] [--lazy] [--out FILE.json]

Each rank (a gloo CPU process) builds ``SequenceBalancer(BalancerConfig(layout="auto", cost=...))``
over the world, as a training script does, and reports: the wall time of the constructor (after
a barrier; the median over ranks), the file descriptors it opened (TCP sockets to the peers of
the process groups it creates: the balancing group and, over NCCL, a gloo twin), and its
resident memory growth. ``--lazy`` sets ``TORCH_GLOO_LAZY_INIT=1`` (gloo then connects a pair
on its first message), to compare. The world's own group (``init_process_group``) is not
counted: it exists before the balancer.

Ranks beyond the 2 cores of this VM time-share, so the wall times grow with contention as well
as with the group; the descriptors and memory do not depend on load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import print_table, write_json  # noqa: E402


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _rank(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from knapformer import BalancerConfig, SequenceBalancer, WorkloadModel

    dist.barrier()
    fds, rss = _fds(), _rss_mb()
    t = time.perf_counter()
    bal = SequenceBalancer(BalancerConfig(layout="auto", cost=WorkloadModel(d_model=3072, num_heads=24)))
    seconds = time.perf_counter() - t
    out = {"s": seconds, "fds": _fds() - fds, "rss_mb": _rss_mb() - rss}
    bal.plan([64 * (rank + 1)])  # it works
    dist.barrier()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[4, 8, 16, 32])
    ap.add_argument("--lazy", action="store_true", help="TORCH_GLOO_LAZY_INIT=1")
    ap.add_argument("--out", default="runs/bench/balancer_construction.json")
    args = ap.parse_args()
    if args.lazy:
        os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
    from knapformer.testing import run_distributed

    rows = []
    for world in args.ranks:
        res = run_distributed(_rank, world, timeout=600, pg_timeout=300, start_method="spawn")
        rows.append(
            {
                "ranks": world,
                "median_s": statistics.median(r["s"] for r in res),
                "max_s": max(r["s"] for r in res),
                "fds": max(r["fds"] for r in res),
                "fds_per_peer": max(r["fds"] for r in res) / (world - 1),
                "rss_mb": statistics.median(r["rss_mb"] for r in res),
            }
        )
        print(rows[-1], flush=True)
    print(f"SequenceBalancer(layout='auto') over the world, gloo CPU ranks{' (lazy gloo init)' if args.lazy else ''}")
    print_table(
        rows,
        [
            ("ranks", "d"),
            ("median_s", ".3f"),
            ("max_s", ".3f"),
            ("fds", "d"),
            ("fds_per_peer", ".2f"),
            ("rss_mb", ".1f"),
        ],
    )
    write_json(args.out, rows, lazy=args.lazy)


if __name__ == "__main__":
    main()
