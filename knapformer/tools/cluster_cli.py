"""``knapformer cluster``: predict step time, HFU and speedup of layouts before you have the GPUs.

    knapformer cluster --mix paper-joint --gpus 32 --model flux --hardware h100 --bags g8n4
    knapformer cluster --mix paper-mixres --gpus 256 --model flux --hardware h200 --bags auto
    knapformer cluster --mix paper-mixres --gpus 256 --model flux --hardware h200 --bags search
    knapformer cluster --input lens.json --gpus 8 --model flux --hardware a100 --bags g2n4 --json
    knapformer cluster --manifest data.csv --gpus 512 --model diffusers-wan-14b --bags auto

``--bags auto`` plans every sampled step with the moldable planner (each sequence's group
chosen per step, communication priced by this hardware's links); ``--bags search`` plans each
uniform and mixed bag layout and keeps the best one for all steps (a static choice).

Every report compares against two baselines: ``none`` (plain data parallel) and the best
*static* uniform layout (every rank in k-rank Ulysses groups, rings of them beyond a node:
what a team configures by hand), with each one's memory (the most tokens a rank holds) and,
under ``--max-tokens``, whether it fits. ``--manifest`` describes the data itself: per-sample
pixels, frames, fps and text (or token counts), turned into tokens by the model family's
tokenizer and dealt over the GPUs by the token-budget sampler
(:mod:`knapformer.tools.manifest_args`).

Torch-free: the plan and the comm model are numpy. ``--profile`` is the planner's cost model,
as in every subcommand; ``--compute-profile`` makes the predicted compute seconds come from a
calibrated profile instead of FLOPs at an assumed efficiency (and plans with it unless
``--profile`` or ``--gamma`` is given).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from knapformer.cluster import ModelShape, evaluate, hardware, search_layouts
from knapformer.cluster.search import best_static
from knapformer.config import BalancerConfig
from knapformer.data import sample_seq_lens
from knapformer.data.codes import mix_num_ranks, resolve_mix
from knapformer.integrations.registry import model_config
from knapformer.plan import validate_seq_lens
from knapformer.tools.cli_support import (
    CliError,
    add_balancer_args,
    balancer_settings,
    cost_model_from_args,
    load_seq_lens,
    nonneg_float,
    positive_float,
    positive_int,
    run_tool,
)
from knapformer.tools.manifest_args import add_manifest_args, manifest_steps
from knapformer.tools.plots import plot_layouts
from knapformer.workload import WorkloadModel

__all__ = ["add_args", "run"]

SEARCH = ("search",)
"""``--bags`` value that searches uniform and mixed layouts for one static choice."""


def add_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--mix", help="mix name or data codes (tiled to --gpus)")
    src.add_argument("--input", help='JSON {"seq_lens": [[...], ...]} with one list per GPU (one step)')
    src.add_argument(
        "--manifest",
        help="dataset manifest (.csv, .jsonl, .parquet): per-sample width, height, frames, fps, text_tokens, or tokens",
    )
    p.add_argument("--gpus", type=positive_int, required=True, help="number of GPUs")
    p.add_argument(
        "--model",
        required=True,
        help="model preset: flux, mmdit-small, ..., or a family's size (diffusers-flux-dev, diffusers-flux2-dev, "
        "diffusers-wan-1.3b, diffusers-wan-14b, torchtitan-flux-dev, ...)",
    )
    p.add_argument("--hardware", default="h100", help="h100, h200, a100, cpu-gloo")
    p.add_argument(
        "--compute-profile",
        default=None,
        help="calibrated profile: predicted compute seconds come from it (else FLOPs x efficiency)",
    )
    p.add_argument("--steps", type=positive_int, default=3, help="sampled steps of the mix")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scale", type=positive_int, default=1, help="resolution divisor of the mix")
    p.add_argument("--recompute", action="store_true", help="activation checkpointing (+1 forward)")
    p.add_argument("--efficiency", type=positive_float, default=None, help="override: achievable fraction of peak")
    p.add_argument("--peak-tflops", type=positive_float, default=None, help="override: dense bf16 TFLOP/s per GPU")
    p.add_argument("--gpus-per-node", type=positive_int, default=None, help="override: GPUs per node")
    p.add_argument(
        "--intra-gbps", type=positive_float, default=None, help="override: GB/s per GPU per direction in a node"
    )
    p.add_argument(
        "--inter-gbps", type=positive_float, default=None, help="override: GB/s per GPU per direction between nodes"
    )
    p.add_argument(
        "--sync-jitter", type=nonneg_float, default=None, help="override: share of a synced segment lost to jitter"
    )
    p.add_argument(
        "--fixed-s", type=nonneg_float, default=0.0, help="per-step seconds outside the blocks (optimizer, FSDP)"
    )
    p.add_argument("--allow-cross-node", action="store_true", help="the layout search may use bags spanning nodes")
    p.add_argument(
        "--planning",
        choices=("ahead", "inline"),
        default="ahead",
        help="plans made ahead (DataLoader workers: nothing on the critical path) or inline (bal.plan: "
        "each step adds its planning time, measured on this machine)",
    )
    p.add_argument("--no-static", action="store_true", help="leave out the best static uniform layout baseline")
    add_manifest_args(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--plot", metavar="FILE", default=None, help="write a PNG of the layouts' step times and HFU")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_balancer_args(
        p,
        bags_default="search",
        bags_help="layout, 'auto' (per-step per-sequence groups), 'search' (try uniform and mixed layouts, "
        "keep the best) or 'none' (data parallel)",
    )
    p.set_defaults(gamma=None)  # None: plan with --compute-profile when given, else γ=1


def _steps(args) -> list:
    if args.input:
        lens = [list(r) for r in validate_seq_lens(load_seq_lens(args.input), args.gpus)]
        return [lens]
    codes = resolve_mix(args.mix)
    if args.gpus % mix_num_ranks(codes):
        raise ValueError(f"the mix describes {mix_num_ranks(codes)} GPUs; --gpus {args.gpus} is not a multiple of it")
    return [
        sample_seq_lens(args.mix, seed=args.seed, step=s, scale=args.scale, num_ranks=args.gpus)
        for s in range(args.steps)
    ]


def _balancer(args, shape: ModelShape, hw, compute_profile: WorkloadModel | None, layout: str) -> BalancerConfig:
    in_seconds = True  # a calibrated profile's units are seconds; the FLOP form's forward FLOPs
    if args.profile is None and args.gamma is None and compute_profile is not None:
        cost = compute_profile
    elif args.profile is not None:
        cost = cost_model_from_args(args, d_model=shape.dim, causal=shape.causal, num_layers=shape.layers)
    else:  # the model's own FLOP form (its FFN, cross-attention) at γ
        cost = dataclasses.replace(shape.workload(), gamma=1.0 if args.gamma is None else args.gamma)
        in_seconds = False
    if cost.num_heads is None:  # the degrees auto may choose follow the model's heads
        cost = dataclasses.replace(cost, num_heads=shape.heads, num_kv_heads=shape.kv_heads)
    link = hw.link(shape, units_per_second=1.0 if in_seconds else hw.flop_units_per_second)
    if args.rank_speed is not None and len(args.rank_speed) != args.gpus:
        raise CliError(f"--rank-speed has {len(args.rank_speed)} entries for --gpus {args.gpus}")
    return BalancerConfig(layout=layout, cost=cost, link=link, **balancer_settings(args))


def run(args: argparse.Namespace) -> int:
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
    shape = ModelShape.from_config(model_config(args.model), recompute=args.recompute)
    compute_profile = WorkloadModel.from_profile(args.compute_profile) if args.compute_profile else None
    if compute_profile is not None and compute_profile.d_model != shape.dim:
        raise ValueError(
            f"--compute-profile d_model {compute_profile.d_model} does not match model {args.model!r} (dim {shape.dim})"
        )
    source = manifest_steps(args, args.model, args.gpus, args.steps) if args.manifest else None
    steps = source.steps if source is not None else _steps(args)
    if source is not None:  # cross-attention over the manifest's typical text
        shape = shape.with_context(source.context_len)
    search = args.bags in SEARCH
    # the layout of the config is a placeholder while searching (each candidate replaces it)
    layout = f"g1n{args.gpus}" if search or args.bags == "none" else args.bags
    cfg = _balancer(args, shape, hw, compute_profile, layout)
    kw = {"profile": compute_profile, "fixed_s": args.fixed_s, "progress": not args.quiet}
    if search:
        best, results, base = search_layouts(
            steps, shape, hw, cfg, allow_cross_node=args.allow_cross_node, planning=args.planning, **kw
        )
    else:
        base = evaluate(steps, "none", shape, hw, rank_speed=cfg.rank_speed, attn_backend=cfg.attn_backend, **kw)
        results = [] if args.bags == "none" else [evaluate(steps, cfg, shape, hw, planning=args.planning, **kw)]
        best = results[0] if results else base
    cap = cfg.max_tokens_per_rank
    base.over_cap = None if cap is None else base.max_tokens > cap
    static, _ = (None, []) if args.no_static else best_static(steps, shape, hw, cfg, planning=args.planning, **kw)
    for r in [*results, *([static] if static is not None else [])]:
        r.speedup = base.step_s / r.step_s
        if static is not None:
            r.speedup_static = static.step_s / r.step_s
        if r.over_cap is None and cap is not None:
            r.over_cap = r.max_tokens > cap
    rows = [base.row()] + [r.row() for r in results]
    if args.plot:
        what = f"{args.model} on {args.gpus} x {hw.name} ({hw.gpus_per_node}/node), {len(steps)} sampled step(s)"
        plot_layouts(args.plot, rows, title=what, best=best.bags)
    if args.json:
        doc = {"hardware": hw.__dict__, "model": args.model, "gpus": args.gpus, "best": best.row(), "rows": rows}
        doc["static"] = static.row() if static is not None else None
        if source is not None:
            doc["manifest"] = {"samples": source.num_samples, "context_len": source.context_len}
            doc["manifest"]["tokenizer"] = source.tokenizer.name if source.tokenizer else None
        print(json.dumps(doc, indent=1))
        if args.plot:  # stdout stays JSON
            print(f"wrote {args.plot}", file=sys.stderr)
        return 0
    shown = [base] + ([static] if static is not None and static.bags not in {r.bags for r in results} else [])
    _print_table(args, hw, steps, [r.row() for r in shown] + rows[1:], source)
    for r in rows:
        if r.get("largest_group", 1) > 1 and r["bags"] == "auto":
            ring = f"; rings (r × Ulysses u): {r['rings']}" if r["rings"] else "; no rings"
            print(f"{r['bags']}: largest group {r['largest_group']} ranks{ring}")
    if static is not None and results and len(steps) > 1:
        for r in results:
            each = " ".join(f"{a / b:.3f}" for a, b in zip(r.step_times, static.step_times))
            print(f"{r.bags} / {static.bags} per step: {each}")
    if search:
        print(f"best: {best.bags} ({best.speedup:.3f}x vs none)")
    if args.plot:
        print(f"wrote {args.plot}")
    return 0


def _print_table(args, hw, steps, rows, source) -> None:
    what = f"{len(steps)} sampled step(s)"
    if source is not None:
        tok = source.tokenizer.name if source.tokenizer else "token counts"
        what += f" of {args.manifest} ({source.num_samples} samples, {tok}, {args.budget} tokens/GPU)"
    print(f"{args.model} on {args.gpus} x {hw.name} ({hw.gpus_per_node}/node), {what}")
    print(
        f"{'bags':26s}{'step (s)':>10s}{'tokens/s':>12s}{'HFU':>8s}{'comm':>7s}{'imbal':>8s}"
        f"{'vs none':>9s}{'vs static':>10s}{'max tok':>9s}{'plan ms':>9s}"
    )
    for r in rows:
        vs = f"{r['speedup_static']:10.3f}" if r.get("speedup_static") is not None else f"{'':>10s}"
        tok = f"{r['max_tokens']:9d}" + ("!" if r.get("over_cap") else "")
        print(
            f"{r['bags']:26s}{r['step_s']:10.3f}{r['tokens_per_s']:12.0f}{r['hfu']:8.1%}{r['comm_share']:7.1%}"
            f"{r['imbalance']:8.3f}{r['speedup']:9.3f}{vs}{tok}{r['plan_ms']:9.1f}"
        )
    if any(r.get("over_cap") for r in rows):
        print(f"! more than --max-tokens {args.max_tokens} tokens on some rank")


def main(argv: list[str] | None = None) -> int:
    return run_tool("cluster", add_args, run, argv, description=__doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
