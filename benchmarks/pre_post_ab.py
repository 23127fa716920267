"""Per-call time of the Ulysses exchanges around attention (pre and post), for A/B runs of two
checkouts on the same bag plans.

    python benchmarks/pre_post_ab.py --ranks 2                      # this checkout
    cd OLD && PYTHONPATH=. python /path/to/benchmarks/pre_post_ab.py --ranks 2   # another one

Data: paper-mixres scaled 4× (ranks 0 and 28 of its 32 for 2 ranks, layout g2n1; ranks 0, 16,
20, 28 for 4 ranks, layout g1n2+g2n1), routed tokens with 8 heads of 32 (fp32). Each rank
times 60 calls of pre and of post (thread CPU time, a barrier before each) and reports the
median; the line printed is the mean over ranks. Run the checkouts alternately a few times:
this VM's speed drifts ±13%. Uses ``SequenceBalancer._pre/_post`` (what ``attention`` runs)
where they exist, else the public ``pre_attn``/``post_attn`` of older checkouts.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from knapformer.testing import run_distributed


def worker(rank, world, layout, ranks_of):
    from knapformer import SequenceBalancer, WorkloadModel
    from knapformer.attention import varlen_attention
    from knapformer.data import sample_seq_lens

    torch.set_num_threads(1)
    mix = sample_seq_lens("paper-mixres", scale=4, seed=0)
    lens = [mix[r] for r in ranks_of]
    bal = SequenceBalancer(layout, WorkloadModel(d_model=1024))
    bal.plan(lens[rank])
    y = bal.route(torch.randn(sum(lens[rank]), 4))
    q = torch.randn(y.shape[0], 8, 32)
    if hasattr(bal, "_pre"):

        def pre():
            return bal._pre(q, q, q)

        call = pre()
        outs = [varlen_attention(b.q, b.k, b.v, b.cu_seqlens, b.max_len) for b in call.batches]

        def post():
            return bal._post(call, outs)
    else:

        def pre():
            return bal.pre_attn(q, q, q)

        q2, k2, v2, cu, mx = pre()
        o2 = varlen_attention(q2, k2, v2, cu, mx)

        def post():
            return bal.post_attn(o2)

    out = {}
    for name, fn in (("pre", pre), ("post", post)):
        fn()
        ts = []
        for _ in range(60):
            dist.barrier()
            t = time.thread_time()
            fn()
            ts.append(time.thread_time() - t)
        out[name] = statistics.median(ts) * 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2, choices=[2, 4])
    ap.add_argument("--out", default=None, help="append the result as one JSON line here")
    args = ap.parse_args()
    layout, ranks_of = ("g2n1", [0, 28]) if args.ranks == 2 else ("g1n2+g2n1", [0, 16, 20, 28])
    res = run_distributed(worker, args.ranks, layout, ranks_of, timeout=300)
    row = {k: sum(r[k] for r in res) / len(res) for k in ("pre", "post")}
    print(f"ranks {args.ranks} layout {layout}: pre {row['pre']:.3f} ms  post {row['post']:.3f} ms (mean over ranks)")
    if args.out:
        with Path(args.out).open("a") as f:
            f.write(json.dumps({"ranks": args.ranks, **row, "checkout": str(Path.cwd())}) + "\n")


if __name__ == "__main__":
    sys.exit(main())
