"""Does the cost model matter? Wrong γ vs the offline calibrated profile vs online
recalibration from the wrong γ, measured on real gloo ranks.

    python benchmarks/profile_vs_gamma.py [--profile profiles/cpu-mmdit-tiny.json] [--ranks 4]

Runs the simulator three times on the same data and layout (1- and 2-rank bags, so the cost
model decides which sequences share a bag): planning with the paper form at ``--gamma``; with
the profile; and starting from ``--gamma`` with ``recalibrate`` (the balancer times each step
and refits its model online, so its first steps plan with the wrong γ). Compares the balanced
run's *measured* busy time max/mean over the measured steps (thread CPU time per rank, which
stays meaningful when 4 ranks time-share 2 cores) and the predicted imbalance.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import print_table, write_json  # noqa: E402

from knapformer.tools.sim_config import SimConfig  # noqa: E402
from knapformer.tools.simulate import simulate  # noqa: E402

MIX = "g2b6i256f1s0,g1b1i512f2s0,g1b2i384f1s0"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="profiles/cpu-mmdit-tiny.json")
    ap.add_argument("--model", default="mmdit-tiny")
    ap.add_argument("--gamma", type=float, default=2.0, help="γ of the comparison run")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--bags", default="g1n2+g2n1")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured steps (the online fit learns from them too)")
    ap.add_argument("--out", default="runs/bench/profile_vs_gamma.json")
    args = ap.parse_args()
    rows = []
    runs = (
        (f"gamma={args.gamma}", {"gamma": args.gamma}),
        ("profile", {"profile": args.profile}),
        (f"online from gamma={args.gamma}", {"gamma": args.gamma, "recalibrate": True}),
    )
    for label, extra in runs:
        cfg = SimConfig(
            ranks=args.ranks,
            mix=MIX,
            scale=2,
            bags=args.bags,
            model=args.model,
            steps=args.steps,
            warmup=args.warmup,
            peak_tflops=0.05,
            progress=False,
            **extra,
        )
        rep = simulate(cfg)
        b, u = rep["modes"]["balanced"], rep["modes"]["unbalanced"]
        rows.append(
            {
                "cost model": label,
                "unbal busy max/mean": u["busy_max_over_mean"],
                "bal busy max/mean": b["busy_max_over_mean"],
                "pred imb before": b["predicted_imbalance_before"],
                "pred imb after": b["predicted_imbalance_after"],
                "loss_match": str(rep["loss_match"]),
            }
        )
        print(".", end="", flush=True)
    print()
    print_table(
        rows,
        [
            ("cost model", "s"),
            ("unbal busy max/mean", ".3f"),
            ("bal busy max/mean", ".3f"),
            ("pred imb before", ".3f"),
            ("pred imb after", ".4f"),
            ("loss_match", "s"),
        ],
    )
    write_json(args.out, rows, mix=MIX, bags=args.bags, model=args.model)


if __name__ == "__main__":
    main()
