"""Predicted step time and speedup vs GPU count (32 -> 4,096) for the paper's three mixes.

    python benchmarks/cluster_scaling.py [--gpus 32 128 512 1024 4096] [--hardware h100]

For each mix and GPU count (the 32-GPU mix tiled), one sampled step is planned under the
uniform layouts g1/g2/g4/g8 and a mixed g1+g2+g4+g8 layout; the best is reported against plain
data parallel. Writes a table, JSON and ``cluster_scaling.png``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import print_table, write_json  # noqa: E402

from knapformer.cluster import ModelShape, hardware  # noqa: E402
from knapformer.cluster.search import evaluate  # noqa: E402
from knapformer.data import MIXES, sample_seq_lens  # noqa: E402
from knapformer.model_configs import preset  # noqa: E402


def layouts(n: int) -> list[str]:
    q = n // 4
    return [f"g{k}n{n // k}" for k in (1, 2, 4, 8)] + [f"g1n{q}+g2n{q // 2}+g4n{q // 4}+g8n{q // 8}"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, nargs="+", default=[32, 128, 512, 1024, 4096])
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--model", default="flux")
    ap.add_argument("--out", default="runs/bench/cluster_scaling.json")
    args = ap.parse_args()
    shape = ModelShape.from_config(preset(args.model))
    hw = hardware(args.hardware)
    rows = []
    for mix in MIXES:
        for n in args.gpus:
            steps = [sample_seq_lens(mix, seed=0, num_ranks=n)]
            t = time.perf_counter()
            base = evaluate(steps, "none", shape, hw)
            best = min((evaluate(steps, spec, shape, hw) for spec in layouts(n)), key=lambda r: r.step_s)
            rows.append(
                {
                    "mix": mix,
                    "gpus": n,
                    "none_s": base.step_s,
                    "best": best.bags,
                    "best_s": best.step_s,
                    "speedup": base.step_s / best.step_s,
                    "hfu_none": base.hfu,
                    "hfu_best": best.hfu,
                    "comm": best.comm_share,
                    "plan_ms": best.plan_ms,
                    "eval_s": time.perf_counter() - t,
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
            ("best", "s"),
            ("best_s", ".3f"),
            ("speedup", ".2f"),
            ("hfu_none", ".3f"),
            ("hfu_best", ".3f"),
            ("comm", ".3f"),
            ("plan_ms", ".0f"),
            ("eval_s", ".1f"),
        ],
    )
    write_json(args.out, rows, hardware=hw.name, model=args.model)
    from knapformer.tools.plots import _plt

    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for mix in MIXES:
        r = [x for x in rows if x["mix"] == mix]
        a1.plot([x["gpus"] for x in r], [x["best_s"] for x in r], marker="o", label=f"{mix} (best layout)")
        a1.plot([x["gpus"] for x in r], [x["none_s"] for x in r], ls="--", marker="x", label=f"{mix} (none)")
        a2.plot([x["gpus"] for x in r], [x["speedup"] for x in r], marker="o", label=mix)
    for ax in (a1, a2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs")
    a1.set_ylabel("predicted step time (s)")
    a2.set_ylabel("speedup vs data parallel")
    a1.legend(fontsize=7)
    a2.legend(fontsize=7)
    fig.suptitle(f"{args.model} on {hw.name}: predicted, per-GPU batch fixed (weak scaling)", fontsize=9)
    fig.tight_layout()
    png = Path(args.out).with_suffix(".png")
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
