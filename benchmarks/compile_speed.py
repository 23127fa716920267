"""Compiled vs eager step time of the demo model on CPU: 2 gloo ranks, the demo's MMDiT
(``mmdit-small``) on the demo mix, balanced with ``auto``; every block compiled with
``torch.compile(dynamic=True)`` (inductor) against the same blocks eager.

    python benchmarks/compile_speed.py [--steps 8] [--out runs/bench/compile_speed.json]

Per step and rank: thread CPU time of forward + backward (what the rank computes). Reported:
the first compiled step (compile time included), the warm per-step median of each mode, their
ratio, how many compiled frames exist after the first step and after the last (a recompile
would add one), and the largest output difference between the two modes (fp32).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import demo_batch, demo_rank, print_table, write_json  # noqa: E402

from knapformer.testing import run_distributed  # noqa: E402


def _worker(rank: int, world: int, steps: int) -> dict:
    import torch
    import torch._dynamo.testing as dynamo_testing

    from knapformer import SequenceBalancer, WorkloadModel

    model, _, mcfg, cfg = demo_rank(rank, world)
    compiled = copy.deepcopy(model)
    counter = dynamo_testing.CompileCounterWithBackend("inductor")
    for blocks in (compiled.double_blocks, compiled.single_blocks):
        for i, b in enumerate(blocks):
            blocks[i] = torch.compile(b, dynamic=True, backend=counter)
    bal = SequenceBalancer(
        "auto", WorkloadModel(d_model=mcfg.dim, num_layers=mcfg.num_layers, num_heads=mcfg.num_heads)
    )
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    frames, diff = [], 0.0
    for step in range(steps):
        batch = demo_batch(rank, world, step, mcfg, cfg)
        outs = {}
        for mode, m in (("eager", model), ("compiled", compiled)):
            bal.plan(batch.seq_lens)
            t = time.thread_time()
            out = m(batch.x, batch.seq_lens, batch.txt_lens, batch.t, batch.vec, executor=bal)
            ((out - batch.target) ** 2).mean().backward()
            times[mode].append(time.thread_time() - t)
            outs[mode] = out.detach()
            m.zero_grad(set_to_none=True)
        diff = max(diff, (outs["eager"] - outs["compiled"]).abs().max().item())
        frames.append(counter.frame_count)
    return {"times": times, "frames": frames, "diff": diff}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8, help="steps per mode (the first compiled one compiles)")
    ap.add_argument("--out", default="runs/bench/compile_speed.json")
    args = ap.parse_args()
    res = run_distributed(_worker, 2, args.steps, timeout=3600)
    # per step: the slower rank's CPU time (the step's critical path)
    crit = {m: [max(r["times"][m][s] for r in res) for s in range(args.steps)] for m in ("eager", "compiled")}
    warm = {m: statistics.median(v[1:]) for m, v in crit.items()}
    rows = [
        {"mode": "eager", "first_s": crit["eager"][0], "warm_median_s": warm["eager"], "ratio": 1.0},
        {
            "mode": "compiled (inductor)",
            "first_s": crit["compiled"][0],
            "warm_median_s": warm["compiled"],
            "ratio": warm["compiled"] / warm["eager"],
        },
    ]
    print_table(rows, [("mode", "s"), ("first_s", ".2f"), ("warm_median_s", ".3f"), ("ratio", ".3f")])
    frames = res[0]["frames"]
    print(f"compiled frames after step 1: {frames[0]}, after step {args.steps}: {frames[-1]}")
    print(f"max |eager - compiled| output: {max(r['diff'] for r in res):.2e}")
    write_json(args.out, rows, frames=frames, per_step=crit, model="mmdit-small", mix="demo", ranks=2)


if __name__ == "__main__":
    main()
