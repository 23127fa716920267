"""The ``knapformer`` command line.

    knapformer plan --input lens.json --bags g1n4+g2n2 [--solver lpt] [--output plan.json]
    knapformer simulate [--ranks 2] [--mix ...] [--bags ...] [--model ...] [--report FILE]
    knapformer demo [--out runs/demo]          (the planner demo; `make demo` runs the simulator)

Bad input exits with status 2 and one line on stderr (no traceback).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from knapformer.layout import parse_layout
from knapformer.plan import DEFAULT_SOLVER, SOLVERS, plan_sequences
from knapformer.workload import WorkloadModel

__all__ = ["main"]


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


def _load_seq_lens(path: str) -> list:
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise CliError(f"cannot read input file {path!r}: {exc.strerror or exc}") from exc
    except json.JSONDecodeError as exc:
        raise CliError(f"input file {path!r} is not valid JSON: {exc.msg} (line {exc.lineno})") from exc
    if not isinstance(data, dict) or "seq_lens" not in data:
        raise CliError(f"input file {path!r} must be a JSON object with key 'seq_lens'")
    return data["seq_lens"]


def _model_from_args(args: argparse.Namespace) -> WorkloadModel:
    if getattr(args, "profile", None):
        return WorkloadModel.from_profile(args.profile)
    return WorkloadModel(d_model=args.d_model, gamma=args.gamma, causal=args.causal)


def _summary(plan, layout_spec: str) -> str:
    st = plan.stats()
    tok = plan.tokens_per_rank()
    lines = [
        f"layout {layout_spec}  solver {plan.solver}  ranks {plan.num_ranks}  "
        f"sequences {len(plan.seq_bag)}  chunks {len(plan.chunks)}",
        f"imbalance (max/mean-1): before {st['imbalance_before']:.4f}  after {st['imbalance_after']:.4f}",
        f"makespan / lower bound: {st['gap_to_bound']:.5f}",
        f"tokens moved: {plan.tokens_moved} of {int(tok.sum())}  max tokens/rank: {int(tok.max()) if tok.size else 0}",
        f"planning time: {st['plan_ms']:.2f} ms",
        "rank  time_before     time_after      tokens",
    ]
    for r in range(plan.num_ranks):
        lines.append(f"{r:4d}  {plan.time_before[r]:.4e}  {plan.time_after[r]:.4e}  {int(tok[r]):8d}")
    return "\n".join(lines)


def cmd_plan(args: argparse.Namespace) -> int:
    seq_lens = _load_seq_lens(args.input)
    layout = parse_layout(args.bags)
    if not isinstance(seq_lens, list):
        raise CliError("'seq_lens' must be a list of per-rank lists")
    plan = plan_sequences(
        seq_lens, layout, _model_from_args(args), solver=args.solver, max_tokens_per_rank=args.max_tokens
    )
    if args.output:
        Path(args.output).write_text(plan.to_json() + "\n")
        print(f"wrote {args.output}")
    else:
        print(_summary(plan, layout.spec()))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from knapformer.tools.plan_demo import run_demo

    run_demo(Path(args.out))
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from knapformer.tools.simulate import run_cli

    return run_cli(args)


def cmd_cluster(args: argparse.Namespace) -> int:
    from knapformer.tools.cluster_cli import run_cli

    return run_cli(args)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from knapformer.tools.calibrate import run_cli

    return run_cli(args)


def _add_calibrate_args(p: argparse.ArgumentParser) -> None:
    # mirrors knapformer.tools.calibrate.build_parser without importing torch here
    p.add_argument("--model", required=True, help="model preset (mmdit-tiny, mmdit-small, transformer-tiny, flux)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--mode", default="fwd+bwd", choices=["fwd", "fwd+bwd"], help="what to time")
    p.add_argument("--causal", action="store_true", help="causal attention (transformer presets)")
    p.add_argument("--lengths", type=int, nargs="+", default=None, help="fit lengths (single sequences)")
    p.add_argument("--holdout", type=int, nargs="+", default=None, help="held-out lengths (never fitted)")
    p.add_argument("--repeats", type=int, default=7, help="timed rounds over all batches (median per batch)")
    p.add_argument("--output", required=True, help="profile JSON to write")
    p.add_argument("--plot", default=None, help="PNG of measured vs predicted")
    p.add_argument("--report", default=None, help="JSON with every timing and error")
    p.add_argument("--no-progress", action="store_true")


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="knapformer", description="Balance variable-length DiT training.")
    sub = p.add_subparsers(dest="command", required=True)
    pl = sub.add_parser("plan", help="plan one step from a JSON file of sequence lengths")
    pl.add_argument("--input", required=True, help='JSON file {"seq_lens": [[...rank 0...], ...]}')
    pl.add_argument("--bags", required=True, help="bag layout, e.g. g1n4+g2n2")
    pl.add_argument("--d-model", type=_positive_int, default=3072, help="model width d (paper cost form)")
    pl.add_argument("--gamma", type=float, default=1.0, help="attention cost factor γ")
    pl.add_argument("--causal", action="store_true", help="causal attention (half the quadratic cost)")
    pl.add_argument("--profile", help="workload profile JSON (overrides --d-model/--gamma/--causal)")
    pl.add_argument("--solver", default=DEFAULT_SOLVER, choices=sorted(SOLVERS), help="planner")
    pl.add_argument("--max-tokens", type=_positive_int, default=None, help="memory cap: tokens per rank")
    pl.add_argument("--output", help="write the plan as JSON here instead of printing a summary")
    pl.set_defaults(func=cmd_plan)
    from knapformer.tools.sim_config import build_parser as simulate_parser

    si = sub.add_parser("simulate", help="train a reference DiT with and without balancing and compare")
    simulate_parser(si)
    si.set_defaults(func=cmd_simulate)
    from knapformer.tools.cluster_cli import add_args as cluster_args

    cl = sub.add_parser("cluster", help="predict step time / HFU / speedup of layouts on a GPU cluster")
    cluster_args(cl)
    cl.set_defaults(func=cmd_cluster)
    ca = sub.add_parser("calibrate", help="time the model's blocks and fit a workload profile")
    _add_calibrate_args(ca)
    ca.set_defaults(func=cmd_calibrate)
    de = sub.add_parser("demo", help="plan the paper's mixes and write a table and a chart")
    de.add_argument("--out", default="runs/demo", help="output folder")
    de.set_defaults(func=cmd_demo)
    return p


def run_tool(name: str, parser: argparse.ArgumentParser, run, argv: Sequence[str] | None = None) -> int:
    """Entry point of a tool module run on its own (``python -m knapformer.tools.X``): the
    same one-line error contract as the ``knapformer`` CLI."""
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (ValueError, TypeError, OSError) as exc:
        print(f"knapformer {name}: error: {exc}", file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (CliError, ValueError, TypeError, OSError) as exc:
        print(f"knapformer {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
