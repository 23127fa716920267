"""Routing overhead on real gloo ranks: route, reverse, pre/post attention vs attention itself.

    python benchmarks/route_overhead.py [--ranks 2 4] [--iters 5] [--out runs/bench/route_overhead.json]

A heterogeneous batch (paper-mixres scaled down 4×, 1,024-dim tokens in bf16 plus an int64
feature routed in the same call) is balanced under a layout with 1- and 2-rank bags. Each
rank counts its ``all_to_all_single`` calls per operation and the bytes it sends to *other*
ranks; the minimum is (tokens whose destination differs from their source) × bytes per token.
Route and reverse move a bf16 tensor and an int64 tensor in one call: one collective per dtype
(2), never a promotion. Times are per-rank medians of thread CPU time (2 ranks share 2 cores; 4 ranks time-share).
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
from knapformer.data import sample_seq_lens  # noqa: E402
from knapformer.distributed import ops  # noqa: E402
from knapformer.testing import run_distributed  # noqa: E402

HEADS, HEAD_DIM = 8, 32
FEAT = HEADS * HEAD_DIM * 4  # 1,024


def _counting(counter: dict):
    real = dist.all_to_all_single

    def wrapped(out, inp, output_split_sizes=None, input_split_sizes=None, group=None, **kw):
        me = dist.get_rank(group)
        counter["calls"] += 1
        per_row = inp[0].numel() * inp.element_size() if inp.shape[0] else 0
        counter["bytes"] += sum(s for r, s in enumerate(input_split_sizes) if r != me) * per_row
        return real(
            out, inp, output_split_sizes=output_split_sizes, input_split_sizes=input_split_sizes, group=group, **kw
        )

    return wrapped


def worker(rank: int, world: int, layout: str, iters: int) -> dict:
    mix = sample_seq_lens("paper-mixres", scale=4, seed=0)
    lens = [mix[r] for r in ([0, 28] if world == 2 else [0, 16, 20, 28])]  # low-res ... 2048² ranks
    bal = SequenceBalancer(layout, WorkloadModel(d_model=FEAT))
    plan = bal.plan(lens[rank])
    T = sum(lens[rank])
    x = torch.randn(T, FEAT, dtype=torch.bfloat16)
    ids = torch.arange(T, dtype=torch.int64)
    counter = {"calls": 0, "bytes": 0}
    ops.dist.all_to_all_single = _counting(counter)
    stats = {}

    def measure(name, fn):
        times = []
        for _ in range(iters):
            counter.update(calls=0, bytes=0)
            dist.barrier()
            t = time.thread_time()
            out = fn()
            times.append(time.thread_time() - t)
        stats[name] = {"ms": 1e3 * statistics.median(times), "calls": counter["calls"], "bytes": counter["bytes"]}
        return out

    y, yid = measure("route", lambda: bal.route(x, ids))
    measure("reverse", lambda: bal.reverse_route(y, yid))
    q = y.view(-1, FEAT // (HEADS * HEAD_DIM), HEADS, HEAD_DIM)[:, 0].contiguous()
    q2, k2, v2, cu, mx = measure("pre_attn", lambda: bal.pre_attn(q, q, q))
    from knapformer.attention import varlen_attention

    o2 = measure("attention_kernel", lambda: varlen_attention(q2, k2, v2, cu, mx))
    measure("post_attn", lambda: bal.post_attn(o2))
    bytes_per_token = FEAT * 2 + 8
    me = bal.group_rank
    sent_off = sum(int(c[3]) for c in plan.chunks if c[0] == me and c[4] != me) * bytes_per_token
    recv_off = sum(int(c[3]) for c in plan.chunks if c[4] == me and c[0] != me) * bytes_per_token
    return {
        "stats": stats,
        "min_bytes": {"route": sent_off, "reverse": recv_off},
        "tokens": T,
        "routed": int(y.shape[0]),
        "tokens_moved": plan.tokens_moved,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default="runs/bench/route_overhead.json")
    args = ap.parse_args()
    rows = []
    for world in args.ranks:
        layout = "g2n1" if world == 2 else "g1n2+g2n1"
        res = run_distributed(worker, world, layout, args.iters, timeout=600)
        for rank, r in enumerate(res):
            for op, s in r["stats"].items():
                row = {
                    "ranks": world,
                    "layout": layout,
                    "rank": rank,
                    "op": op,
                    "ms": s["ms"],
                    "a2a_calls": s["calls"],
                    "bytes_sent": s["bytes"],
                }
                if op in ("route", "reverse"):
                    m = r["min_bytes"][op]
                    row["min_bytes"] = m
                    row["bytes/min"] = s["bytes"] / m if m else (1.0 if s["bytes"] == 0 else float("inf"))
                rows.append(row)
    print_table(
        rows,
        [
            ("ranks", "d"),
            ("layout", "s"),
            ("rank", "d"),
            ("op", "s"),
            ("ms", ".2f"),
            ("a2a_calls", "d"),
            ("bytes_sent", "d"),
            ("min_bytes", "d"),
            ("bytes/min", ".3f"),
        ],
    )
    write_json(args.out, rows)


if __name__ == "__main__":
    main()
