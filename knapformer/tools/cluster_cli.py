"""``knapformer cluster``: predict step time, HFU and speedup of layouts before you have the GPUs.

    knapformer cluster --mix paper-joint --gpus 32 --model flux --hardware h100 --bags g8n4
    knapformer cluster --mix paper-mixres --gpus 256 --model flux --hardware h200 --bags auto
    knapformer cluster --input lens.json --gpus 8 --model flux --hardware a100 --bags g2n4 --json

Torch-free: the plan and the comm model are numpy.
"""

from __future__ import annotations

import argparse
import json
import sys

from knapformer.cluster import ModelShape, evaluate, hardware, search_layouts
from knapformer.data import sample_seq_lens
from knapformer.data.codes import mix_num_ranks, resolve_mix
from knapformer.model_configs import preset
from knapformer.plan import validate_seq_lens
from knapformer.workload import WorkloadModel

__all__ = ["add_args", "run_cli"]


def add_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--mix", help="mix name or data codes (tiled to --gpus)")
    src.add_argument("--input", help='JSON {"seq_lens": [[...], ...]} with one list per GPU (one step)')
    p.add_argument("--gpus", type=int, required=True, help="number of GPUs")
    p.add_argument("--model", required=True, help="model preset (flux, mmdit-small, ...)")
    p.add_argument("--hardware", default="h100", help="h100, h200, a100, cpu-gloo")
    p.add_argument("--bags", default="auto", help="layout, 'auto' (search) or 'none' (data parallel)")
    p.add_argument("--gamma", type=float, default=None, help="(planning only) γ of the paper cost form")
    p.add_argument("--profile", default=None, help="calibrated profile: compute seconds come from it")
    p.add_argument("--steps", type=int, default=3, help="sampled steps of the mix")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scale", type=int, default=1, help="resolution divisor of the mix")
    p.add_argument("--recompute", action="store_true", help="activation checkpointing (+1 forward)")
    p.add_argument("--efficiency", type=float, default=None, help="override: achievable fraction of peak")
    p.add_argument("--peak-tflops", type=float, default=None, help="override: dense bf16 TFLOP/s per GPU")
    p.add_argument("--gpus-per-node", type=int, default=None, help="override: GPUs per node")
    p.add_argument("--intra-gbps", type=float, default=None, help="override: GB/s per GPU per direction in a node")
    p.add_argument("--inter-gbps", type=float, default=None, help="override: GB/s per GPU per direction between nodes")
    p.add_argument("--sync-jitter", type=float, default=None, help="override: share of a synced segment lost to jitter")
    p.add_argument("--fixed-s", type=float, default=0.0, help="per-step seconds outside the blocks (optimizer, FSDP)")
    p.add_argument("--allow-cross-node", action="store_true", help="auto may use bags spanning nodes")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _steps(args) -> list:
    if args.input:
        try:
            data = json.load(open(args.input))
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read input file {args.input!r}: {exc}") from exc
        if not isinstance(data, dict) or "seq_lens" not in data:
            raise ValueError(f"input file {args.input!r} must be a JSON object with key 'seq_lens'")
        lens = [list(r) for r in validate_seq_lens(data["seq_lens"], args.gpus)]
        return [lens]
    codes = resolve_mix(args.mix)
    if args.gpus % mix_num_ranks(codes):
        raise ValueError(f"the mix describes {mix_num_ranks(codes)} GPUs; --gpus {args.gpus} is not a multiple of it")
    return [
        sample_seq_lens(args.mix, seed=args.seed, step=s, scale=args.scale, num_ranks=args.gpus)
        for s in range(args.steps)
    ]


def run_cli(args: argparse.Namespace) -> int:
    if args.gpus < 1 or args.steps < 1:
        raise ValueError("--gpus and --steps must be >= 1")
    hw = hardware(args.hardware).with_overrides(
        efficiency=args.efficiency,
        peak_flops=args.peak_tflops and args.peak_tflops * 1e12,
        gpus_per_node=args.gpus_per_node,
        intra_bw=args.intra_gbps and args.intra_gbps * 1e9,
        inter_bw=args.inter_gbps and args.inter_gbps * 1e9,
        sync_jitter=args.sync_jitter,
    )
    if args.gpus > hw.gpus_per_node and args.gpus % hw.gpus_per_node:
        raise ValueError(f"{args.gpus} GPUs is not a whole number of {hw.gpus_per_node}-GPU nodes")
    shape = ModelShape.from_config(preset(args.model), recompute=args.recompute)
    profile = WorkloadModel.from_profile(args.profile) if args.profile else None
    if profile is not None and profile.d_model != shape.dim:
        raise ValueError(f"profile d_model {profile.d_model} does not match model {args.model!r} (dim {shape.dim})")
    # γ only steers the planner; compute time still comes from FLOPs (or the profile)
    plan_model = None if args.gamma is None else WorkloadModel(d_model=shape.dim, gamma=args.gamma, causal=shape.causal)
    steps = _steps(args)
    kw = {"profile": profile, "fixed_s": args.fixed_s}
    if args.bags == "auto":
        best, results, base = search_layouts(
            steps, shape, hw, plan_model=plan_model, allow_cross_node=args.allow_cross_node, **kw
        )
    else:
        base = evaluate(steps, "none", shape, hw, **kw)
        results = [] if args.bags == "none" else [evaluate(steps, args.bags, shape, hw, plan_model=plan_model, **kw)]
        for r in results:
            r.speedup = base.step_s / r.step_s
        best = results[0] if results else base
    rows = [base.row()] + [r.row() for r in results]
    if args.json:
        print(
            json.dumps(
                {"hardware": hw.__dict__, "model": args.model, "gpus": args.gpus, "best": best.row(), "rows": rows},
                indent=1,
            )
        )
        return 0
    print(f"{args.model} on {args.gpus} x {hw.name} ({hw.gpus_per_node}/node), {len(steps)} sampled step(s)")
    print(
        f"{'bags':26s}{'step (s)':>10s}{'tokens/s':>12s}{'HFU':>8s}{'comm':>7s}{'imbal':>8s}"
        f"{'speedup':>9s}{'plan ms':>9s}"
    )
    for r in rows:
        print(
            f"{r['bags']:26s}{r['step_s']:10.3f}{r['tokens_per_s']:12.0f}{r['hfu']:8.1%}{r['comm_share']:7.1%}"
            f"{r['imbalance']:8.3f}{r['speedup']:9.3f}{r['plan_ms']:9.1f}"
        )
    if args.bags == "auto":
        print(f"best: {best.bags} ({best.speedup:.3f}x vs none)")
    return 0


def main(argv: list[str] | None = None) -> int:
    from knapformer.cli import run_tool

    p = argparse.ArgumentParser(prog="knapformer cluster", description=__doc__.splitlines()[0])
    add_args(p)
    return run_tool("cluster", p, run_cli, argv)


if __name__ == "__main__":
    sys.exit(main())
