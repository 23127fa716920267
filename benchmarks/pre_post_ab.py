"""Per-call time of the Ulysses exchanges around attention (pre and post): this checkout against
a baseline checkout, both loaded in the same ranks and timed in paired, interleaved calls.

    python benchmarks/pre_post_ab.py --baseline c97b554        # the last bag-only executor
    python benchmarks/pre_post_ab.py --baseline /path/to/checkout --ranks 2 4 --iters 300

Why in one process: single runs of two checkouts drift ±30% on this VM (vCPU speed changes for
seconds at a time), more than the difference being measured. Here every iteration times the
six calls (pre, post, trip of each checkout) back to back, in a random order that is the same
on every rank (the collectives must match) and new each iteration: with a fixed order the same
code measured ``post`` at 1.09–1.10× the baseline, with a random order 0.99–1.01×. The baseline
package is copied from ``git archive REV knapformer`` (or a checkout's ``knapformer/``) into a
temporary folder as ``knapformer_baseline``, its absolute imports renamed; nothing else of it
is used.

Data: paper-mixres scaled 4× (ranks 0 and 28 of its 32 for 2 ranks, layout g2n1; ranks 0, 16,
20, 28 for 4 ranks, layout g1n2+g2n1), routed tokens, q = k = v with 8 heads of 32 (fp32). Both
executors plan the same lengths with their default solver; the run refuses a ratio unless the
plans and the routed tensors are identical.

Ops: ``pre`` and ``post`` as ``attention`` runs them (``SequenceBalancer._pre/_post`` where a
checkout has them, else its public ``pre_attn``/``post_attn``); ``trip`` is pre -> post ->
backward of both, with q = k = v needing gradients and a contiguous copy of q standing in for
the attention output. Time: thread CPU time per call (a barrier before each), median over
``--iters``; ``paired`` is the median over iterations of new/old. ``*_faults`` are minor page
faults per call (mean): fresh pages zero-filled by the kernel. By default each rank first
calls ``knapformer.testing.keep_freed_memory()``, as the demo's ranks do: with glibc's adaptive
thresholds (``--default-malloc``) which call takes the page faults depends on the order of
large allocations and frees, which differs between checkouts and can dominate a
sub-millisecond call. The summary line per rank count is the mean over ranks.
"""

from __future__ import annotations

import argparse
import random
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _common import mixres_rank_lens, print_table, write_json  # noqa: E402

from knapformer.testing import run_distributed  # noqa: E402

BASE = "knapformer_baseline"
HEADS, HEAD_DIM = 8, 32
OPS = ("pre", "post", "trip")
LAYOUTS = {2: "g2n1", 4: "g1n2+g2n1"}


def stage_baseline(ref: str, into: Path) -> Path:
    """Copy the baseline's ``knapformer`` package to ``into/knapformer_baseline`` with its
    imports renamed; ``ref`` is a checkout folder or a git revision of this repository."""
    dst = into / BASE
    src = Path(ref)
    if src.is_dir():
        shutil.copytree(src / "knapformer", dst)
    else:
        repo = Path(__file__).resolve().parent.parent
        tar = subprocess.run(["git", "-C", str(repo), "archive", ref, "knapformer"], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(into)], input=tar.stdout, check=True)
        (into / "knapformer").rename(dst)
    pattern = re.compile(r"\b(from|import) knapformer\b")
    for f in dst.rglob("*.py"):
        f.write_text(pattern.sub(rf"\1 {BASE}", f.read_text()))
    return into


def _calls(bal, q):
    """(pre, post, round trip) closures for one checkout's balancer, whatever its executor API.
    The round trip is pre -> identity "attention" (a contiguous copy of q, as a kernel's fresh
    output would be) -> post, then backward."""
    from knapformer.attention import varlen_attention

    qg = q.detach().requires_grad_()
    grad = torch.ones_like(q)
    if hasattr(bal, "_post_run"):  # 0.2: the checks (_pre) and the exchange after attention (_post_run)

        def pre(x):
            return bal._pre(x, x, x, "attention", False)

        post = bal._post_run
    elif hasattr(bal, "_pre"):  # earlier checkouts: _pre(q, k, v) and _post(call, outs)

        def pre(x):
            return bal._pre(x, x, x)

        post = bal._post
    else:
        pre = post = None
    if pre is not None:
        call = pre(q)
        outs = [varlen_attention(b.q, b.k, b.v, b.cu_seqlens, b.max_len) for b in call.batches]

        def trip():
            c = pre(qg)
            post(c, [b.q.contiguous() for b in c.batches]).backward(grad)

        return (lambda: pre(q)), (lambda: post(call, outs)), trip
    args = bal.pre_attn(q, q, q)  # a 5-tuple in older checkouts, VarlenArgs (7 fields) now
    q2, k2, v2, cu, mx = args[:4] + (args[-1],)
    o2 = varlen_attention(q2, k2, v2, cu, mx)

    def trip_old():
        bal.post_attn(bal.pre_attn(qg, qg, qg)[0].contiguous()).backward(grad)

    return (lambda: bal.pre_attn(q, q, q)), (lambda: bal.post_attn(o2)), trip_old


def _faults() -> int:
    """Minor page faults of this thread so far (fresh pages the allocator handed out)."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def worker(rank: int, world: int, staged: str, iters: int, seed: int, keep_memory: bool) -> dict:
    sys.path.insert(0, staged)
    import knapformer
    from knapformer.testing import keep_freed_memory

    base = __import__(BASE)
    torch.set_num_threads(1)
    if keep_memory:
        keep_freed_memory()
    layout, lens = LAYOUTS[world], mixres_rank_lens(world)[rank]
    fns, plans, routed = {}, [], []
    torch.manual_seed(0)
    x = torch.randn(sum(lens), 4)
    for name, mod in (("new", knapformer), ("old", base)):
        bal = mod.SequenceBalancer(layout, mod.WorkloadModel(d_model=1024))
        plans.append(np.asarray(bal.plan(lens).chunks))
        routed.append(bal.route(x))
        q = torch.randn(routed[-1].shape[0], HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(1))
        fns[f"{name}_pre"], fns[f"{name}_post"], fns[f"{name}_trip"] = _calls(bal, q)
    same = bool(np.array_equal(*plans) and torch.equal(*routed))
    for f in fns.values():  # warm
        f()
    times: dict[str, list[float]] = {k: [] for k in fns}
    faults: dict[str, list[int]] = {k: [] for k in fns}
    rng = random.Random(seed)  # the same order on every rank
    for _ in range(iters):
        order = list(fns)
        rng.shuffle(order)
        for k in order:
            dist.barrier()
            f0, t = _faults(), time.thread_time()
            fns[k]()
            times[k].append(time.thread_time() - t)
            faults[k].append(_faults() - f0)
    out = {"same_plan": same}
    for op in OPS:
        new, old = times[f"new_{op}"], times[f"old_{op}"]
        out[op] = {
            "new_ms": 1e3 * statistics.median(new),
            "old_ms": 1e3 * statistics.median(old),
            "paired": statistics.median(a / b for a, b in zip(new, old) if b > 0),
            "new_faults": statistics.mean(faults[f"new_{op}"]),
            "old_faults": statistics.mean(faults[f"old_{op}"]),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", required=True, help="a git revision of this repository or a checkout folder")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4], choices=sorted(LAYOUTS))
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0, help="of the call order")
    ap.add_argument(
        "--default-malloc",
        action="store_true",
        help="leave glibc's adaptive mmap/trim thresholds (default: keep freed memory, as the demo ranks do)",
    )
    ap.add_argument("--out", default="runs/bench/pre_post_ab.json")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        staged = str(stage_baseline(args.baseline, Path(tmp)))
        for world in args.ranks:
            res = run_distributed(worker, world, staged, args.iters, args.seed, not args.default_malloc, timeout=900)
            for rank, r in enumerate(res):
                for op in OPS:
                    s = r[op]
                    ratio = s["new_ms"] / s["old_ms"] if r["same_plan"] else None
                    rows.append({"ranks": world, "rank": rank, "op": op, **s, "new/old": ratio, "same": r["same_plan"]})
                    if not r["same_plan"]:
                        rows[-1]["paired"] = None
    print_table(
        rows,
        [
            ("ranks", "d"),
            ("rank", "d"),
            ("op", "s"),
            ("new_ms", ".3f"),
            ("old_ms", ".3f"),
            ("new/old", ".3f"),
            ("paired", ".3f"),
            ("new_faults", ".1f"),
            ("old_faults", ".1f"),
            ("same", "d"),
        ],
    )
    print()
    for world in args.ranks:
        for op in OPS:
            sel = [r for r in rows if r["ranks"] == world and r["op"] == op]
            if all(r["same"] for r in sel):
                ratio = statistics.mean(r["new/old"] for r in sel)
                paired = statistics.mean(r["paired"] for r in sel)
                print(f"{world} ranks {op:>4}: new/old {ratio:.3f}  paired {paired:.3f}  (mean over ranks)")
            else:
                print(f"{world} ranks {op:>4}: plans or routed tensors differ between the checkouts; no ratio")
    write_json(args.out, rows, baseline=args.baseline, iters=args.iters, keep_freed_memory=not args.default_malloc)


if __name__ == "__main__":
    sys.exit(main())
