"""Per-step moldable plans (``--bags auto``) vs the best static layout (``--bags search``) on
predicted GPU clusters.

    python benchmarks/cluster_auto.py [--gpus 32 256 1024] [--steps 3] [--out runs/bench/cluster_auto.json]

Flux (d=3072, 24 heads, 19 double + 38 single blocks) on the ``h100`` preset (8 GPUs per
node, NVLink inside, InfiniBand across; 50% of peak assumed, nothing outside the blocks), the
paper's ``paper-mixres`` and ``paper-joint`` mixes tiled to the cluster, ``--steps`` sampled
steps each. ``search`` evaluates every uniform and mixed layout of bag sizes dividing the
heads inside a node and keeps the one with the best mean step time; ``auto`` plans every step
with the moldable planner (without a budget, and with ``--time-budget`` seconds, which adds the
layout menu as candidates). All are predicted by the same cost function.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import print_table, write_json  # noqa: E402

from knapformer.cli import main as cli  # noqa: E402


def run(mix: str, gpus: int, steps: int, bags: str, *extra: str) -> dict:
    import contextlib
    import io
    import json

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        args = ["cluster", "--mix", mix, "--gpus", str(gpus), "--model", "flux", "--hardware", "h100"]
        code = cli([*args, "--bags", bags, "--steps", str(steps), "--json", *extra])
    assert code == 0
    return json.loads(buf.getvalue())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, nargs="+", default=[32, 256, 1024])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--budget", type=float, default=1.0, help="time budget of the second auto row (s)")
    ap.add_argument("--out", default="runs/bench/cluster_auto.json")
    args = ap.parse_args()
    rows = []
    for mix in ("paper-mixres", "paper-joint"):
        for gpus in args.gpus:
            search = run(mix, gpus, args.steps, "search")
            auto = run(mix, gpus, args.steps, "auto")
            budget = run(mix, gpus, args.steps, "auto", "--time-budget", str(args.budget))
            none = search["rows"][0]
            best, a, ab = search["best"], auto["rows"][1], budget["rows"][1]
            rows.append(
                {
                    "mix": mix,
                    "gpus": gpus,
                    "none_s": none["step_s"],
                    "best_layout": best["bags"],
                    "best_s": best["step_s"],
                    "auto_s": a["step_s"],
                    "speedup_best": none["step_s"] / best["step_s"],
                    "speedup_auto": none["step_s"] / a["step_s"],
                    "auto/best": a["step_s"] / best["step_s"],
                    "auto_plan_ms": a["plan_ms"],
                    "budget/best": ab["step_s"] / best["step_s"],
                    "budget_plan_ms": ab["plan_ms"],
                }
            )
            print(".", end="", flush=True)
    print()
    print_table(
        rows,
        [
            ("mix", "s"),
            ("gpus", "d"),
            ("none_s", ".3f"),
            ("best_layout", "s"),
            ("best_s", ".3f"),
            ("auto_s", ".3f"),
            ("speedup_best", ".3f"),
            ("speedup_auto", ".3f"),
            ("auto/best", ".4f"),
            ("auto_plan_ms", ".1f"),
            ("budget/best", ".4f"),
            ("budget_plan_ms", ".0f"),
        ],
    )
    write_json(args.out, rows)


if __name__ == "__main__":
    main()
