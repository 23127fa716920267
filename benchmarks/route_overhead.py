"""Exchange overhead on real gloo ranks: route, reverse, pre/post attention vs attention itself,
collectives per call, bytes sent vs the minimum, and what the cross-rank checks cost.

    python benchmarks/route_overhead.py [--ranks 2 4] [--iters 7] [--out runs/bench/route_overhead.json]
    python benchmarks/route_overhead.py --baseline OLD.json   # ratios vs a run of another checkout

Separate runs drift more on this VM than the executors differ: for the time against the
bag-only executor use ``benchmarks/pre_post_ab.py --baseline c97b554`` (paired calls in the
same ranks).

Cases (the same data on every rank count: paper-mixres scaled down 4×, 1,024-dim tokens in bf16
plus an int64 feature routed in the same call; attention with 8 heads of 32 in fp32):

- ``bags``: a bag layout (g2n1 on 2 ranks, g1n2+g2n1 on 4) planned by the default solver;
- ``mixed``: a per-sequence plan where every rank runs some sequences alone and chunks of
  others in groups of 2 (and 4 on 4 ranks) with different partners in the same step.

Each rank counts its ``all_to_all_single`` calls per operation and the bytes it sends to
*other* ranks. The minimum for route/reverse is (tokens leaving their rank) × bytes per token;
for pre attention, each member's own tokens of each group × the heads of every *other* member
(q, k, v), for post attention the same for the outputs. ``attention (per degree)`` is one
varlen call per parallel degree (what ``SequenceBalancer.attention`` runs); ``attention
(pairs)`` is pre_attn's single flattened call over (sequence, head) pairs for custom kernels.
``agree`` is the agreement that precedes every exchange (one tiny all-reduce: error flag, the
call and its index, plan digest, dtype/shape digest); ``pre_attn``/``post_attn`` include theirs.
Times are per-rank medians of thread CPU time over ``--iters`` (2 ranks share 2 cores; 4 time-share).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _common import mixres_rank_lens, print_table, write_json  # noqa: E402

from knapformer import SequenceBalancer, WorkloadModel  # noqa: E402
from knapformer.attention import varlen_attention  # noqa: E402
from knapformer.distributed import ops  # noqa: E402
from knapformer.distributed.agree import Call, agree  # noqa: E402
from knapformer.distributed.ulysses import member_heads  # noqa: E402
from knapformer.plan import plan_from_groups  # noqa: E402
from knapformer.testing import run_distributed  # noqa: E402

HEADS, HEAD_DIM = 8, 32
FEAT = HEADS * HEAD_DIM * 4  # 1,024


def _counting(counter: dict):
    real = dist.all_to_all_single

    def wrapped(out, inp, output_split_sizes=None, input_split_sizes=None, group=None, **kw):
        me = dist.get_rank(group)
        counter["calls"] += 1
        per_row = inp[0].numel() * inp.element_size() if inp.dim() > 1 and inp.shape[0] else inp.element_size()
        counter["bytes"] += sum(s for r, s in enumerate(input_split_sizes) if r != me) * per_row
        return real(
            out, inp, output_split_sizes=output_split_sizes, input_split_sizes=input_split_sizes, group=group, **kw
        )

    return wrapped


def mixed_plan(world: int, model: WorkloadModel):
    """Every rank keeps its short sequences alone; each long sequence goes to a group of 2
    (and on 4 ranks the longest to a group of 4) whose members differ from sequence to sequence."""
    lens = mixres_rank_lens(world)
    groups, seq_group = [], []
    flat = sorted(((n, r, i) for r, row in enumerate(lens) for i, n in enumerate(row)), reverse=True)
    long = {(r, i): j for j, (_, r, i) in enumerate(flat[: max(2, len(flat) // 4)])}
    for r, row in enumerate(lens):
        for i, _ in enumerate(row):
            j = long.get((r, i))
            if j is None:
                g = (r,)
            elif world >= 4 and j == 0:
                g = (3, 1, 0, 2)
            else:
                g = (r, (r + 1 + j) % world) if (r + 1 + j) % world != r else (r, (r + 1) % world)
            if g not in groups:
                groups.append(g)
            seq_group.append(groups.index(g))
    return plan_from_groups(lens, groups, seq_group, model)


def ulysses_min_bytes(plan, rank: int, h: int, h_kv: int, d: int, dv: int, elem: int) -> tuple[int, int]:
    """(pre, post) bytes this rank must send to other members, from the plan alone."""
    pre = post = 0
    for g, members in enumerate(plan.groups):
        k = len(members)
        if k == 1 or rank not in members:
            continue
        sel = np.flatnonzero(plan.seq_group[plan.chunk_gid] == g)
        mine = int(plan.chunks[sel[plan.chunks[sel, 4] == rank], 3].sum())  # my tokens of this group
        for j, m in enumerate(members):
            if m == rank:
                continue
            qh, kvh = member_heads(k, j, h, h_kv)
            hq, hkv = qh.stop - qh.start, kvh.stop - kvh.start
            pre += mine * (hq * d + hkv * d + hkv * dv) * elem
            post += int(plan.chunks[sel[plan.chunks[sel, 4] == m], 3].sum()) * (h // k) * dv * elem
    return pre, post


def worker(rank: int, world: int, case: str, iters: int) -> dict:
    model = WorkloadModel(d_model=FEAT)
    bal = SequenceBalancer(f"g{world}n1" if world == 2 else "g1n2+g2n1", model)
    lens = mixres_rank_lens(world)
    if case == "bags":
        plan = bal.plan(lens[rank])
    else:
        plan = bal.use_plan(mixed_plan(world, model))
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
    q = torch.randn(y.shape[0], HEADS, HEAD_DIM)
    call = bal._pre(q, q, q)  # a layer's pre exchange (its agreement included)
    measure("pre_attn", lambda: bal._pre(q, q, q))
    measure(
        "attention (per degree)",
        lambda: [varlen_attention(b.q, b.k, b.v, b.cu_seqlens, b.max_len) for b in call.batches],
    )
    outs = [varlen_attention(b.q, b.k, b.v, b.cu_seqlens, b.max_len) for b in call.batches]
    measure("post_attn", lambda: bal._post(call, outs))
    from knapformer.distributed import ulysses

    fq, fk, fv, fcu, fmax = ulysses.flatten_pairs(call)
    measure("attention (pairs)", lambda: varlen_attention(fq, fk, fv, fcu, fmax))
    measure("agree", lambda: agree(bal.group, Call("bench", 0, 0, (("dtypes", "float32 (·, 4)"),))))
    bytes_per_token = FEAT * 2 + 8
    me = bal.group_rank
    sent_off = sum(int(c[3]) for c in plan.chunks if c[0] == me and c[4] != me) * bytes_per_token
    recv_off = sum(int(c[3]) for c in plan.chunks if c[4] == me and c[0] != me) * bytes_per_token
    pre_min, post_min = ulysses_min_bytes(plan, me, HEADS, HEADS, HEAD_DIM, HEAD_DIM, 4)
    degrees = sorted({e.degree for e in bal.spec.entries})
    return {
        "stats": stats,
        "min_bytes": {"route": sent_off, "reverse": recv_off, "pre_attn": pre_min, "post_attn": post_min},
        "degrees": degrees,
        "routed": int(y.shape[0]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--cases", nargs="+", default=["bags", "mixed"])
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--baseline", default=None, help="JSON of a run of another checkout: print time ratios")
    ap.add_argument("--out", default="runs/bench/route_overhead.json")
    args = ap.parse_args()
    rows = []
    for world in args.ranks:
        for case in args.cases:
            res = run_distributed(worker, world, case, args.iters, timeout=900)
            for rank, r in enumerate(res):
                for op, s in r["stats"].items():
                    row = {
                        "ranks": world,
                        "case": case,
                        "rank": rank,
                        "degrees": ",".join(map(str, r["degrees"])),
                        "op": op,
                        "ms": s["ms"],
                        "a2a_calls": s["calls"],
                        "bytes_sent": s["bytes"],
                    }
                    if op in r["min_bytes"]:
                        m = r["min_bytes"][op]
                        row["min_bytes"] = m
                        row["bytes/min"] = s["bytes"] / m if m else (1.0 if s["bytes"] == 0 else float("inf"))
                    rows.append(row)
    if args.baseline:
        renamed = {"attention_kernel": "attention (per degree)"}  # the bag executor's benchmark called it so
        base = {
            (b["ranks"], b.get("case", "bags"), b["rank"], renamed.get(b["op"], b["op"])): b["ms"]
            for b in json.load(open(args.baseline))["rows"]
        }
        for r in rows:
            old = base.get((r["ranks"], r["case"], r["rank"], r["op"]))
            r["ms/baseline"] = r["ms"] / old if old else None
    cols = [
        ("ranks", "d"),
        ("case", "s"),
        ("rank", "d"),
        ("degrees", "s"),
        ("op", "s"),
        ("ms", ".2f"),
        ("a2a_calls", "d"),
        ("bytes_sent", "d"),
        ("min_bytes", "d"),
        ("bytes/min", ".3f"),
    ]
    if args.baseline:
        cols.append(("ms/baseline", ".3f"))
    print_table(rows, cols)
    write_json(args.out, rows)


if __name__ == "__main__":
    main()
