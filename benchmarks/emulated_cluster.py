"""Emulated cluster: does a step take what its plan predicts, at 8–32 ranks on 2 cores?

    python benchmarks/emulated_cluster.py [--ranks 8 16 32] [--steps 3] [--repeats 3] [--layers 1]
        [--step-seconds 12] [--mix realistic] [--model diffusers-flux-dev]
        [--baseline-ref REF] [--out runs/bench/emulated_cluster.json]

Every rank is a real gloo process and every exchange is real (route, the Ulysses exchanges of
``attention``, reverse, and their backward passes, on small tensors). The compute is replaced
by sleeps of the seconds the cost model predicts for that rank, so sleeping ranks do not
compete for the 2 cores and the
synchronisation structure is what the measurement shows:

- each layer sleeps the rank's linear work before ``attention`` (a third forward, two thirds
  in the backward, through an autograd function that sleeps in both), its attention work in
  the attention kernel (the same split; the kernel is replaced by the sleep), and the seconds
  ``h100`` links price its Ulysses exchanges beside the exchanges themselves (route's at route
  and reverse); the plans are made with those links (``auto`` then keeps short sequences whole
  beside its groups, as on a cluster; no plan here needs a ring);
- the steps are the first ``--steps`` steps of a manifest (``--mix``, the realistic mix by
  default) tokenised for ``--model`` and dealt by the token-budget sampler to as many ranks
  as the run has (65,536 tokens per rank), lengths divided by 32 and the quadratic cost
  multiplied by 32 (the same cost shape on small tensors: bf16, 24 heads of 1 value); the
  cost is the model's own FLOP form, scaled so that ``auto``'s steps take about
  ``--step-seconds`` on average;
- each layout (``auto`` and the static Ulysses layouts g4 and g8, the best static layouts of
  these steps: g1 and g2 take 2–4× longer, 16 ranks do not divide Flux's 24 heads) runs one warm-up step (the
  first step of a kind agrees at every call) and then each step, planned in the parent
  process by the code under test and executed with ``use_plan``;
- measured = from a barrier before ``route`` to the last rank's end of ``backward``, the median
  of ``--repeats`` runs of the step;
  predicted = ``Plan.makespan`` × layers, in the same seconds (each version's own: before this
  change the planner priced no waiting); ``whole_group_s`` = what the plan takes if every rank
  waits for the slowest rank of the whole group at every exchange (the sum over a layer's
  segments of the group's maximum: the executor before point-to-point); ``no_sleep_s`` = the
  same step with every sleep 0 (what this machine's exchanges and host work cost: the
  prediction has no term for them, so it bounds how close the ratio can get to 1 here).

``--baseline-ref`` (a git commit, e.g. the one before the exchanges became point-to-point)
runs the same script on that commit's code first (a ``git worktree`` in a temporary
folder), so one run prints before and after side by side: its executor and its planner's
prediction (which priced no waiting). Writes JSON next to the printed table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

SCALE = 32
"""Lengths ÷ SCALE and the quadratic cost × SCALE: the same cost shape on small tensors."""
H, D = 24, 1
"""Heads (Flux's 24) and a tiny head dim: the exchanges are real but small."""


# -- the rank's side ---------------------------------------------------------------------------
def _sleeper():
    import torch

    class Sleep(torch.autograd.Function):
        """Identity that sleeps ``fwd`` seconds in the forward and ``bwd`` in the backward."""

        @staticmethod
        def forward(ctx, x, fwd: float, bwd: float):  # type: ignore[override]
            ctx.bwd = bwd
            if fwd > 0:
                time.sleep(fwd)
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):  # type: ignore[override]
            if ctx.bwd > 0:
                time.sleep(ctx.bwd)
            return grad, None, None

    return Sleep


def run_rank(rank: int, world: int, layouts: dict, layers: int, repeats: int) -> dict:
    """One rank: for each layout, a warm-up step and the measured steps (module docstring).
    ``layouts``: name -> [(plan, (S, 4) seconds per layer of linear work, attention, Ulysses
    exchanges, route) per step]."""
    import torch
    import torch.distributed as dist

    from knapformer import SequenceBalancer, WorkloadModel

    torch.set_num_threads(1)
    Sleep = _sleeper()
    clock = dist.new_group(backend="gloo")  # barrier and timings, apart from the balancer's groups
    model = WorkloadModel(d_model=H * D, num_heads=H)
    import importlib

    import knapformer
    import knapformer.distributed.ring as ring

    budget = [0.0, 0.0]  # this layer's attention sleep (forward, backward): the first kernel call takes it

    def take(x):
        fwd, bwd = budget
        budget[0] = budget[1] = 0.0
        return Sleep.apply(x, fwd, bwd)

    def kernel(q, k, v, cu_seqlens, max_len, causal=False, backend="auto"):
        return take(q * 1.0)  # the output: q itself, after its sleep

    # what `attention` runs per degree on this rank (the module that calls it: the balancer, or
    # before the attention methods moved into it, their mixin's module)
    for name in ("knapformer.distributed.balancer", "knapformer.distributed.attention_calls"):
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(mod, "varlen_attention"):
            mod.varlen_attention = kernel
    real_ring = ring.ring_attention

    def ring_attention(batches, outs, *args, **kwargs):  # a rank with ring batches only sleeps here
        outs, anchor = real_ring(batches, outs, *args, **kwargs)
        i = next(i for i, b in enumerate(batches) if b.ring is not None)
        outs = list(outs)
        outs[i] = take(outs[i])
        return outs, anchor

    ring.ring_attention = ring_attention
    out: dict = {"knapformer": knapformer.__file__}
    for name, steps in layouts.items():
        bal = SequenceBalancer(f"g1n{world}", model, link="free")
        times, bare = [], []
        # the first: warm-up (its kind's first step agrees at every call); then each step twice:
        # without sleeps (what the exchanges and the host cost on this machine), then measured
        runs = [(*steps[0], 0.0, None)]
        for i, st in enumerate(steps):
            times.append([])
            bare.append([])
            runs += [(*st, scale, into[i]) for _ in range(repeats) for scale, into in ((0.0, bare), (1.0, times))]
        for plan, seconds, scale, into in runs:
            bal.use_plan(plan)
            lin, att, uly, route = (float(v) * scale for v in seconds[rank])
            x = torch.zeros(sum(plan.seq_lens[rank]), H * D, dtype=torch.bfloat16, requires_grad=True)
            dist.barrier(group=clock)
            t0 = time.perf_counter()
            h = bal.route(Sleep.apply(x, route / 4, route / 4))  # route's 4 exchanges: 2 here, 2 at reverse
            for _ in range(layers):
                h = Sleep.apply(h, lin / 3, 2 * lin / 3)  # linear work: a third forward, the rest backward
                q = h.view(-1, H, D)
                # attention (a third forward) after the pre exchange's time, in the kernel; then the post's
                budget[:] = [att / 3 + uly / 4, 2 * att / 3 + uly / 4]
                o = bal.attention(q, q, q)
                h = h + Sleep.apply(o, uly / 4, uly / 4).reshape(h.shape)
            y = bal.reverse_route(Sleep.apply(h, route / 4, route / 4))
            y.float().sum().backward()
            t1 = time.perf_counter()
            row = torch.tensor([t0, t1], dtype=torch.float64)
            rows = [torch.empty_like(row) for _ in range(world)]
            dist.all_gather(rows, row, group=clock)
            if into is not None:
                table = torch.stack(rows)
                into.append(float(table[:, 1].max() - table[:, 0].min()))
        out[name] = ([statistics.median(t) for t in times], [statistics.median(b) for b in bare])
    return out


# -- the parent's side -------------------------------------------------------------------------
def _steps(mix: str, model: str, ranks: int, steps: int) -> list[list[list[int]]]:
    from realistic_mix import steps_of

    dealt, _ = steps_of(mix, model, ranks, steps)
    return [[[max(1, n // SCALE) for n in r] for r in step] for step in dealt]


def _seconds(plan, cost, link) -> np.ndarray:
    """(S, 4) planner units per layer of each rank's linear work, attention (with the ring's
    exposed exchanges), Ulysses exchanges and route: the cost functions every version of the
    planner prices a plan with (``knapformer.plan.cost``)."""
    from knapformer.plan.cost import comm_features, ring_seconds, route_seconds, ulysses_seconds

    f = plan.features()
    att = f.attn * cost.quad_coef
    lin = f.cost(cost) - att
    comm = comm_features(plan.index, plan.groups, plan.seq_group, plan.chunks, cost, link.gpus_per_node, plan.ring)
    ups = link.units_per_second
    uly = ulysses_seconds(comm, link) * ups
    route = route_seconds(comm, link) / cost.num_layers * ups
    att = att + ring_seconds(comm, link, cost, 1.0) * ups
    return np.stack([lin, att, uly, route], axis=1)


def _whole_group(seconds: np.ndarray) -> float:
    """The step if every rank waited for the slowest of the whole group at every exchange (the
    executor before point-to-point): per layer, the sum over segments of the group's maximum."""
    return float(seconds[:, :3].max(axis=0).sum() + seconds[:, 3].max())


def measure(ranks: int, args) -> list[dict]:
    """Plan every step of every layout with this process's code, run them, one row per layout."""
    import dataclasses

    from knapformer.cluster import ModelShape, hardware
    from knapformer.integrations.registry import model_config
    from knapformer.plan import plan_sequences
    from knapformer.testing import run_distributed

    shape = ModelShape.from_config(model_config(args.model))
    hw = hardware("h100")
    flop = shape.workload()
    # the model's own FLOP form, the quadratic term × SCALE (lengths ÷ SCALE); h100 links price the
    # exchanges (without sync jitter: the sleeps have none)
    cost = dataclasses.replace(flop, quadratic=flop.quad_coef * SCALE)
    link = dataclasses.replace(hw.link(shape, units_per_second=hw.flop_units_per_second), sync_jitter=0.0)
    steps = _steps(args.mix, args.model, ranks, args.steps)
    static = [f"g{k}n{ranks // k}" for k in (4, 8) if ranks % k == 0 and H % k == 0]
    plans = {name: [plan_sequences(lens, name, cost, link=link) for lens in steps] for name in ["auto", *static]}
    seconds = {name: [_seconds(p, cost, link) for p in ps] for name, ps in plans.items()}
    # seconds per planner unit: auto's steps take about --step-seconds on average
    mean_auto = statistics.mean(p.makespan for p in plans["auto"])
    spu = args.step_seconds / (mean_auto * args.layers)
    layouts = {name: [(p, sec * spu) for p, sec in zip(plans[name], seconds[name])] for name in plans}
    res = run_distributed(run_rank, ranks, layouts, args.layers, args.repeats, timeout=3600)
    import knapformer

    if res[0]["knapformer"] != knapformer.__file__:  # the ranks must run the code that planned
        raise RuntimeError(f"the ranks imported {res[0]['knapformer']}, the planner {knapformer.__file__}")
    rows = []
    for name, ps in plans.items():
        measured, bare = res[0][name]
        predicted = [p.makespan * spu * args.layers for p in ps]
        whole = [_whole_group(sec) * spu * args.layers for sec in seconds[name]]
        ratios = [m / p for m, p in zip(measured, predicted)]
        rows.append(
            {
                "ranks": ranks,
                "layout": name,
                "measured_s": statistics.mean(measured),
                "predicted_s": statistics.mean(predicted),
                "measured/predicted_worst": max(ratios),
                "measured/predicted_mean": statistics.mean(ratios),
                "whole_group_s": statistics.mean(whole),
                "no_sleep_s": statistics.mean(bare),
                "per_step_measured_s": measured,
                "per_step_predicted_s": predicted,
            }
        )
    best = min((r for r in rows if r["layout"] != "auto"), key=lambda r: r["measured_s"])
    for r in rows:
        r["vs_best_static_measured"] = r["measured_s"] / best["measured_s"]
        r["best_static"] = best["layout"]
    return rows


def _baseline(ref: str, argv: list[str]) -> list[dict]:
    """The same measurement on commit ``ref``'s code (a temporary git worktree)."""
    root = HERE.parent
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "baseline"
        subprocess.run(["git", "-C", str(root), "worktree", "add", "--detach", str(tree), ref], check=True)
        try:
            out = Path(tmp) / "baseline.json"
            env = {**os.environ, "PYTHONPATH": str(tree)}
            cmd = [sys.executable, str(HERE / "emulated_cluster.py"), *argv, "--out", str(out), "--no-baseline"]
            # run from the worktree: the ranks' process server puts its working folder first on its
            # path, and would import this checkout's knapformer from here
            subprocess.run(cmd, check=True, env=env, cwd=tree)
            return json.loads(out.read_text())["rows"]
        finally:
            subprocess.run(["git", "-C", str(root), "worktree", "remove", "--force", str(tree)], check=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 32])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3, help="runs of each step; its median counts")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--step-seconds", type=float, default=12.0)
    p.add_argument("--mix", default="realistic")
    p.add_argument("--model", default="diffusers-flux-dev")
    p.add_argument("--baseline-ref", default=None, help="a git commit to measure first, on its own code")
    p.add_argument("--no-baseline", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default="runs/bench/emulated_cluster.json")
    args = p.parse_args()
    own = [a for a in sys.argv[1:] if a not in ("--no-baseline",)]
    if "--out" in own:
        i = own.index("--out")
        del own[i : i + 2]
    if "--baseline-ref" in own:
        i = own.index("--baseline-ref")
        del own[i : i + 2]
    before = _baseline(args.baseline_ref, own) if args.baseline_ref and not args.no_baseline else []
    rows = [r for n in args.ranks for r in measure(n, args)]
    for r in before:
        r["code"] = f"before ({args.baseline_ref})"
    for r in rows:
        r["code"] = "after"
    cols = [
        ("code", "s"),
        ("ranks", "d"),
        ("layout", "s"),
        ("measured_s", ".3f"),
        ("predicted_s", ".3f"),
        ("measured/predicted_worst", ".3f"),
        ("measured/predicted_mean", ".3f"),
        ("whole_group_s", ".3f"),
        ("no_sleep_s", ".3f"),
        ("vs_best_static_measured", ".3f"),
        ("best_static", "s"),
    ]
    from _common import print_table, write_json

    print_table(before + rows, cols)
    write_json(args.out, before + rows, args=vars(args))


if __name__ == "__main__":
    main()
