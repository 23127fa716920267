"""The ``knapformer`` command line: it only dispatches to the tools.

    knapformer plan --input lens.json --bags g1n4+g2n2 [--solver lpt] [--output plan.json]
    knapformer simulate [--ranks 2] [--mix ...] [--bags ...] [--model ...] [--report FILE]
    knapformer cluster --mix paper-joint --gpus 32 --model flux --bags g8n4
    knapformer cluster --manifest data.csv --gpus 64 --model diffusers-wan-14b --bags auto
    knapformer manifest --mix realistic --samples 20000 --out data.csv
    knapformer calibrate --model mmdit-tiny --output profile.json
    knapformer show plan.json -o plan.png
    knapformer demo                            (what `make demo` runs: simulate on the built-in default)
    knapformer plan-demo [--out runs/plan-demo] (the planner on the paper's three mixes)
    knapformer --version

Each subcommand is a tool module with ``add_args(parser)`` (torch-free) and ``run(args)``
(imported only when that subcommand runs). Bad input exits with status 2 and one line on
stderr (no traceback).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from knapformer.tools.cli_support import Parser, run_command

__all__ = ["COMMANDS", "build_parser", "main"]


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    args_module: str
    """Module with ``add_args(parser)``: torch-free, imported to build the parser."""
    run_module: str
    """Module with ``run(args) -> int``: imported when the subcommand runs."""


COMMANDS = (
    Command(
        "plan",
        "plan one step from a JSON file of sequence lengths",
        "knapformer.tools.plan_cli",
        "knapformer.tools.plan_cli",
    ),
    Command(
        "simulate",
        "train a reference DiT with and without balancing and compare",
        "knapformer.tools.sim_config",
        "knapformer.tools.simulate",
    ),
    Command(
        "cluster",
        "predict step time / HFU / speedup of layouts on a GPU cluster",
        "knapformer.tools.cluster_cli",
        "knapformer.tools.cluster_cli",
    ),
    Command(
        "calibrate",
        "time the model's blocks and fit a workload profile",
        "knapformer.tools.calibrate_args",
        "knapformer.tools.calibrate",
    ),
    Command(
        "manifest",
        "write a synthetic dataset manifest (CSV, JSONL or Parquet) for cluster and plan",
        "knapformer.tools.manifest_args",
        "knapformer.tools.manifest_args",
    ),
    Command("show", "draw a plan file as a PNG", "knapformer.tools.show", "knapformer.tools.show"),
    Command(
        "demo",
        "what `make demo` runs: 2 CPU ranks train the demo model with and without balancing",
        "knapformer.tools.demo",
        "knapformer.tools.demo",
    ),
    Command(
        "plan-demo",
        "plan the paper's mixes and write a table and a chart",
        "knapformer.tools.plan_demo",
        "knapformer.tools.plan_demo",
    ),
)


def build_parser() -> Parser:
    from knapformer import __version__

    p = Parser(prog="knapformer", description="Balance variable-length DiT training.")
    p.add_argument("--version", action="version", version=f"knapformer {__version__}")
    sub = p.add_subparsers(dest="command", parser_class=Parser, metavar="command")
    for c in COMMANDS:
        sp = sub.add_parser(c.name, help=c.help, description=c.help)
        importlib.import_module(c.args_module).add_args(sp)
        sp.set_defaults(_command=c)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # bare `knapformer`: the usage and the commands
        parser.print_help()
        return 0
    command: Command = args._command
    run = importlib.import_module(command.run_module).run
    return run_command(command.name, run, args)


if __name__ == "__main__":
    sys.exit(main())
