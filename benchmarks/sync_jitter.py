"""Sync jitter: how much time ranks doing *identical* work lose waiting for each other at
every synchronous collective (Ulysses does 4 per layer in a multi-rank bag).

    python benchmarks/sync_jitter.py [--ranks 2] [--iters 40] [--out runs/bench/sync_jitter.json]

Each rank (pinned to its own core, one thread) runs the same attention-like segment (SDPA
forward + backward, then an MLP), timed with thread CPU time, then waits in a one-element
all-reduce. ``jitter = mean(wait) / mean(compute)`` is the fraction of a synchronised segment
lost to the slowest rank when the work is perfectly balanced. The cluster model charges it per
multi-rank bag (hardware field ``sync_jitter``; the ``cpu-gloo`` preset quotes this
benchmark). On GPUs kernel times are far steadier; their presets carry an assumed value.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from knapformer.testing import keep_freed_memory, pin_to_core, run_distributed


def _worker(rank: int, world: int, iters: int, seq_len: int) -> dict:
    torch.set_num_threads(1)
    pin_to_core(rank, world)
    keep_freed_memory()
    g = torch.Generator().manual_seed(0)  # identical work and data on every rank
    q = torch.randn(1, 2, seq_len, 32, generator=g, requires_grad=True)
    x = torch.randn(seq_len, 128, generator=g)
    w1 = torch.randn(128, 512, generator=g, requires_grad=True)
    w2 = torch.randn(512, 128, generator=g, requires_grad=True)
    flag = torch.zeros(1)
    compute, wait = [], []
    for it in range(iters + 3):
        c0 = time.thread_time()
        F.scaled_dot_product_attention(q, q, q).sum().backward()
        (F.gelu(x @ w1) @ w2).sum().backward()
        c1 = time.thread_time()
        w0 = time.perf_counter()
        dist.all_reduce(flag)
        if it >= 3:
            compute.append(c1 - c0)
            wait.append(time.perf_counter() - w0)
    return {"compute": compute, "wait": wait}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--seq-len", type=int, default=2000)
    ap.add_argument("--out", default="runs/bench/sync_jitter.json")
    args = ap.parse_args()
    res = run_distributed(_worker, args.ranks, args.iters, args.seq_len, timeout=900)
    rows = []
    for r, d in enumerate(res):
        c, w = statistics.mean(d["compute"]), statistics.mean(d["wait"])
        cv = statistics.pstdev(d["compute"]) / c
        rows.append({"rank": r, "compute_ms": 1e3 * c, "wait_ms": 1e3 * w, "cv": cv, "jitter": w / c})
        print(f"rank {r}: segment {1e3 * c:7.1f} ms (cv {cv:.1%})  wait {1e3 * w:6.2f} ms  -> {w / c:.2%} of compute")
    jitter = statistics.mean(r["jitter"] for r in rows)
    print(f"sync jitter (mean over ranks): {jitter:.2%} of each synchronised segment")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"ranks": rows, "jitter": jitter, "args": vars(args)}, indent=1) + "\n")


if __name__ == "__main__":
    main()
