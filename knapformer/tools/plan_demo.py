"""Plan the paper's three mixes under four layouts and show what balancing predicts.

    python -m knapformer.tools.plan_demo --out runs/plan-demo     (or: knapformer plan-demo)

Prints one row per (mix, layout, solver): imbalance before/after, makespan over the lower
bound, tokens moved and planning time; writes ``table.json`` and a PNG of per-rank work.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from knapformer.data import MIXES, sample_seq_lens
from knapformer.plan import plan_sequences
from knapformer.tools.cli_support import run_tool
from knapformer.tools.plots import plot_rank_work
from knapformer.workload import WorkloadModel

LAYOUTS = ("g1n32", "g2n16", "g4n8", "g8n4")
SOLVERS = ("paper", "lpt")
CHART = ("paper-mixres", "g4n8")


def run_demo(out: Path, *, seed: int = 0, d_model: int = 3072) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    model = WorkloadModel(d_model=d_model)
    plan_sequences([[1], [1]], "g1n2", model)  # warm numpy code paths before timing
    rows, chart = [], {}
    header = (
        f"{'mix':13s} {'layout':7s} {'solver':6s} {'imb before':>10s} {'imb after':>10s} "
        f"{'/bound':>8s} {'moved':>9s} {'ms':>7s}"
    )
    print(header)
    print("-" * len(header))
    for mix in MIXES:
        lens = sample_seq_lens(mix, seed=seed)
        for layout in LAYOUTS:
            for solver in SOLVERS:
                plan = plan_sequences(lens, layout, model, solver=solver)
                plan.validate()
                st = plan.stats()
                rows.append({"mix": mix, "layout": layout, "solver": solver, **st})
                print(
                    f"{mix:13s} {layout:7s} {solver:6s} {st['imbalance_before']:10.4f} "
                    f"{st['imbalance_after']:10.5f} {st['gap_to_bound']:8.5f} {plan.tokens_moved:9d} "
                    f"{st['plan_ms']:7.2f}"
                )
                if (mix, layout) == CHART:
                    chart.setdefault("before", plan.time_before)
                    chart[f"after ({solver})"] = plan.time_after
    (out / "table.json").write_text(json.dumps(rows, indent=1) + "\n")
    png = out / "rank_work.png"
    plot_rank_work(png, f"{CHART[0]} on {CHART[1]}: predicted per-rank work", chart)
    print(f"\nwrote {out / 'table.json'} and {png}")
    return rows


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="runs/plan-demo", help="output folder")
    p.add_argument("--seed", type=int, default=0, help="data seed")


def run(args: argparse.Namespace) -> int:
    run_demo(Path(args.out), seed=args.seed)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_tool("plan-demo", add_args, run, argv, description=__doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
