"""``knapformer plan``: plan one step from a JSON file of sequence lengths (torch-free).

knapformer plan --input lens.json --bags g1n4+g2n2 [--solver lpt] [--output plan.json]
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
    add_balancer_args,
    cost_model_from_args,
    load_seq_lens,
    positive_int,
    run_tool,
)

__all__ = ["add_args", "run", "summary"]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", required=True, help='JSON file {"seq_lens": [[...rank 0...], ...]}')
    p.add_argument("--d-model", type=positive_int, default=3072, help="model width d (paper cost form)")
    p.add_argument("--causal", action="store_true", help="causal attention (half the quadratic cost)")
    p.add_argument(
        "--layers",
        type=positive_int,
        default=1,
        help="layers of the model: a step's route exchanges are priced against this many layers of compute",
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
    p.add_argument("--output", help="write the plan as JSON here instead of printing a summary")
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


def run(args: argparse.Namespace) -> int:
    seq_lens = load_seq_lens(args.input)
    layout = parse_layout(args.bags)
    model = cost_model_from_args(
        args, d_model=args.d_model, causal=args.causal, num_layers=args.layers, check_dim=False
    )
    if args.heads is not None or args.kv_heads is not None:
        model = dataclasses.replace(model, num_heads=args.heads, num_kv_heads=args.kv_heads)
    link = None
    if args.hardware is not None:
        hw = hardware(args.hardware)
        link = hw.link(units_per_second=1.0 if model.linear is not None else hw.flop_units_per_second)
    plan = plan_sequences(
        seq_lens,
        layout,
        model,
        solver=args.solver,
        max_tokens_per_rank=args.max_tokens,
        rank_speed=args.rank_speed,
        link=link,
        time_budget_s=args.time_budget,
        kv_gather=args.attn_path == "pre_attn",
    )
    if args.output:
        Path(args.output).write_text(plan.to_json() + "\n")
        print(f"wrote {args.output}")
    else:
        print(summary(plan, layout.spec()))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_tool("plan", add_args, run, argv, description=__doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
