"""``knapformer demo``: exactly what ``make demo`` runs — the simulator on its built-in default
(2 CPU ranks, the demo model and mix, ``--bags auto``, 2 warm-up + 10 measured steps), writing
``runs/demo/report.json`` and its charts. ``make demo`` also creates the virtual environment
first; this command assumes knapformer is installed.

    knapformer demo [--out runs/demo]
"""

from __future__ import annotations

import argparse
import sys

from knapformer.tools.cli_support import run_tool

__all__ = ["DEMO_ARGS", "add_args", "run"]

DEMO_ARGS = ("--bags", "auto", "--steps", "10", "--warmup", "2")
"""The simulator flags of ``make demo`` (the Makefile passes the same)."""


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="runs/demo", help="folder of the report and the charts")


def run(args: argparse.Namespace) -> int:
    from knapformer.tools import sim_config, simulate

    p = argparse.ArgumentParser()
    sim_config.add_args(p)
    sim_args = p.parse_args([*DEMO_ARGS, "--report", f"{args.out}/report.json", "--plot-dir", args.out])
    return simulate.run(sim_args)


def main(argv: list[str] | None = None) -> int:
    return run_tool("demo", add_args, run, argv, description=__doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
