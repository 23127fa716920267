"""``knapformer show``: draw a plan file as a PNG.

knapformer plan --input lens.json --bags auto --heads 24 --hardware h100 --output plan.json
knapformer show plan.json -o plan.png

One bar per rank up to 64 ranks; beyond, one bar per band of ranks (whole nodes when the plan
carries its links), so the picture stays under 2,000 px wide at any scale. Seconds on the
y-axis when the plan carries its links (``--hardware``) or a cost model in seconds.
"""

from __future__ import annotations

import argparse
import sys

from knapformer.plan import Plan
from knapformer.tools.cli_support import positive_int, read_json, run_tool

__all__ = ["add_args", "run"]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", help="plan JSON (knapformer plan --output)")
    p.add_argument("-o", "--output", required=True, help="PNG to write")
    p.add_argument("--title", default=None, help="a line above the plan's stats in the picture's title")
    p.add_argument(
        "--ranks-per-band",
        type=positive_int,
        default=None,
        help="ranks per bar (1: every rank, up to 128 ranks); default: every rank up to 64 ranks, "
        "else the fewest whole nodes giving at most 64 bars",
    )


def run(args: argparse.Namespace) -> int:
    plan = Plan.from_dict(read_json(args.plan, "plan file"))
    plan.validate()
    plan.plot(args.output, title=args.title, ranks_per_band=args.ranks_per_band)
    print(f"wrote {args.output}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_tool("show", add_args, run, argv, description=__doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
