"""``knapformer plan``: plan one step from a JSON file of sequence lengths, or sampled steps of a
dataset manifest (torch-free).

    knapformer plan --input lens.json --bags g1n4+g2n2 [--solver lpt] [--output plan.json]
    knapformer plan --manifest data.csv --gpus 64 --model diffusers-wan-14b --hardware h100 --bags auto --steps 3

``--model`` names the model as ``knapformer cluster`` does (a reference preset or a family's
size): its width, heads, layers and cost terms (Wan's FFN and cross-attention) make the cost
model, in place of ``--d-model``/``--heads``/``--kv-heads``/``--layers``/``--causal``.
``--manifest`` deals the manifest's samples over ``--gpus`` GPUs with the token-budget sampler
(:mod:`knapformer.tools.manifest_args`) and plans its first ``--steps`` steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from knapformer.cluster.hardware import hardware
from knapformer.layout import parse_layout
from knapformer.plan import Plan, plan_sequences
from knapformer.tools.cli_support import (
    CliError,
    add_balancer_args,
    cost_model_from_args,
    load_seq_lens,
    positive_int,
    run_tool,
)
from knapformer.tools.manifest_args import add_manifest_args, manifest_steps

__all__ = ["add_args", "run", "summary"]


def add_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", help='JSON file {"seq_lens": [[...rank 0...], ...]}')
    src.add_argument(
        "--manifest",
        help="dataset manifest (.csv, .jsonl, .parquet): per-sample width, height, frames, fps, "
        "text_tokens, or tokens (with --gpus)",
    )
    p.add_argument(
        "--model",
        default=None,
        help="model preset or family size (flux, diffusers-wan-14b, ...): its sizes and cost terms make the cost model",
    )
    p.add_argument("--d-model", type=positive_int, default=None, help="model width d (paper cost form; default 3072)")
    p.add_argument("--causal", action="store_true", help="causal attention (half the quadratic cost)")
    p.add_argument(
        "--layers",
        type=positive_int,
        default=None,
        help="layers of the model: a step's route exchanges are priced against this many layers of compute (default 1)",
    )
    p.add_argument(
        "--heads",
        type=positive_int,
        default=None,
        help="attention heads: a group of --bags auto whose size does not split them runs as a ring of "
        "Ulysses sub-groups whose size does (without --heads: power-of-two sizes, rings beyond 8)",
    )
    p.add_argument("--kv-heads", type=positive_int, default=None, help="key/value heads (GQA/MQA)")
    p.add_argument(
        "--hardware", default=None, help="hardware preset (h100, h200, a100, cpu-gloo) whose links price the exchanges"
    )
    p.add_argument("--gpus", type=positive_int, default=None, help="with --manifest: GPUs the samples are dealt over")
    p.add_argument("--steps", type=positive_int, default=1, help="with --manifest: sampled steps to plan")
    p.add_argument("--seed", type=int, default=0, help="with --manifest: the sampler's seed")
    p.add_argument("--output", help="write the (first) plan as JSON here instead of printing a summary")
    add_manifest_args(p)
    add_balancer_args(p, bags_default=None, bags_help="bag layout, e.g. g1n4+g2n2", bags_required=True, execution=False)


def summary(plan: Plan, layout_spec: str) -> str:
    """The plan's stats and per-rank times as a short table."""
    st = plan.stats()
    tok = plan.tokens_per_rank()
    lines = [
        f"layout {layout_spec}  solver {plan.solver}  ranks {plan.num_ranks}  "
        f"sequences {len(plan.seq_group)}  chunks {len(plan.chunks)}",
        f"imbalance (max/mean-1): before {st['imbalance_before']:.4f}  after {st['imbalance_after']:.4f}",
        f"makespan / lower bound: {st['gap_to_bound']:.5f}",
        f"tokens moved: {plan.tokens_moved} of {int(tok.sum())}  max tokens/rank: {int(tok.max()) if tok.size else 0}",
        f"planning time: {st['plan_ms']:.2f} ms",
        "rank  time_before     time_after      tokens",
    ]
    for r in range(plan.num_ranks):
        lines.append(f"{r:4d}  {plan.time_before[r]:.4e}  {plan.time_after[r]:.4e}  {int(tok[r]):8d}")
    return "\n".join(lines)


def _model(args):
    """(cost model, model shape or None) from ``--model`` or the width/heads flags."""
    sized = [f for f in ("d_model", "heads", "kv_heads", "layers") if getattr(args, f) is not None]
    if args.model is None:
        d = args.d_model or 3072
        model = cost_model_from_args(args, d_model=d, causal=args.causal, num_layers=args.layers or 1, check_dim=False)
        if args.heads is not None or args.kv_heads is not None:
            model = dataclasses.replace(model, num_heads=args.heads, num_kv_heads=args.kv_heads)
        return model, None
    if sized or args.causal:
        flags = ", ".join("--" + f.replace("_", "-") for f in sized) or "--causal"
        raise CliError(f"--model {args.model!r} gives the model's sizes; drop {flags}")
    from knapformer.cluster.model import ModelShape
    from knapformer.integrations.registry import model_config

    shape = ModelShape.from_config(model_config(args.model))
    if args.profile:
        model = cost_model_from_args(args, d_model=shape.dim, num_layers=shape.layers)
        model = dataclasses.replace(model, num_heads=shape.heads, num_kv_heads=shape.kv_heads)
    else:
        model = dataclasses.replace(shape.workload(), gamma=args.gamma)
    return model, shape


def run(args: argparse.Namespace) -> int:
    layout = parse_layout(args.bags)
    model, shape = _model(args)
    if args.manifest:
        if args.gpus is None:
            raise CliError("--manifest needs --gpus (the GPUs its samples are dealt over)")
        source = manifest_steps(args, args.model or "", args.gpus, args.steps)
        steps = source.steps
        if source.context_len and model.context_len:  # cross-attention over the manifest's typical text
            model = dataclasses.replace(model, context_len=source.context_len)
    else:
        if args.gpus is not None or args.steps != 1:
            raise CliError("--gpus and --steps go with --manifest (--input is one step of its own ranks)")
        steps = [load_seq_lens(args.input)]
    link = None
    if args.hardware is not None:
        hw = hardware(args.hardware)
        in_seconds = bool(args.profile)
        link = hw.link(shape, units_per_second=1.0 if in_seconds else hw.flop_units_per_second)
    plans = [
        plan_sequences(
            lens,
            layout,
            model,
            solver=args.solver,
            max_tokens_per_rank=args.max_tokens,
            rank_speed=args.rank_speed,
            link=link,
            time_budget_s=args.time_budget,
            kv_gather=args.attn_path == "pre_attn",
        )
        for lens in steps
    ]
    if args.output:
        Path(args.output).write_text(plans[0].to_json() + "\n")
        print(f"wrote {args.output}")
    elif len(plans) == 1:
        print(summary(plans[0], layout.spec()))
    else:
        print(
            f"{'step':>4s}{'seqs':>8s}{'per rank':>9s}{'imbal before':>14s}{'after':>8s}{'/ bound':>9s}"
            f"{'moved':>7s}{'max tok':>9s}{'ms':>8s}"
        )
        for i, p in enumerate(plans):
            st, tok = p.stats(), p.tokens_per_rank()
            moved = p.tokens_moved / max(int(tok.sum()), 1)
            print(
                f"{i:4d}{len(p.seq_group):8d}{len(p.seq_group) / p.num_ranks:9.1f}{st['imbalance_before']:14.3f}"
                f"{st['imbalance_after']:8.4f}{st['gap_to_bound']:9.4f}{moved:7.1%}{int(tok.max()):9d}{st['plan_ms']:8.1f}"
            )
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_tool("plan", add_args, run, argv, description=__doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
