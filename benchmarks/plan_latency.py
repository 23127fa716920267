"""Planner latency from 8 to 4,096 ranks: default solver vs the paper's rule.

    python benchmarks/plan_latency.py [--repeats 3] [--out runs/bench/plan_latency.json]

32 sequences per rank (paper-lowres tiled) and the mixed-resolution mix (paper-mixres tiled),
mixed layouts with 1-, 2-, 4- and 8-rank bags. Median of ``--repeats`` runs, in ms.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import print_table, write_json  # noqa: E402

from knapformer.data import sample_seq_lens  # noqa: E402
from knapformer.plan import plan_sequences  # noqa: E402
from knapformer.workload import WorkloadModel  # noqa: E402


def layout_for(ranks: int) -> str:
    if ranks == 8:
        return "g1n2+g2n1+g4n1"
    if ranks == 16:
        return "g1n4+g2n2+g4n2"
    q = ranks // 4
    return f"g1n{q}+g2n{q // 2}+g4n{q // 4}+g8n{q // 8}"


def timed(lens, layout, model, solver, repeats):
    times, plan = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        plan = plan_sequences(lens, layout, model, solver=solver)
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times), plan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-ranks", type=int, default=4096)
    ap.add_argument("--out", default="runs/bench/plan_latency.json")
    args = ap.parse_args()
    model = WorkloadModel(d_model=3072)
    plan_sequences([[1], [1]], "g1n2", model)  # warm-up
    rows = []
    ranks = 8
    while ranks <= args.max_ranks:
        for mix in ("paper-lowres", "paper-mixres"):
            # tile the 32-rank mix; for 8/16 ranks take its first ranks
            lens = sample_seq_lens(mix, num_ranks=max(32, ranks))[:ranks]
            layout = layout_for(ranks)
            ms_paper, p = timed(lens, layout, model, "paper", args.repeats)
            ms_ours, o = timed(lens, layout, model, "lpt", args.repeats)
            rows.append(
                {
                    "ranks": ranks,
                    "mix": mix,
                    "seqs": sum(map(len, lens)),
                    "paper_ms": ms_paper,
                    "ours_ms": ms_ours,
                    "ours/paper_time": ms_ours / ms_paper,
                    "paper/bound": p.gap_to_bound,
                    "ours/bound": o.gap_to_bound,
                }
            )
            print(".", end="", flush=True)
        ranks *= 2
    print()
    print_table(
        rows,
        [
            ("ranks", "d"),
            ("mix", "s"),
            ("seqs", "d"),
            ("paper_ms", ".1f"),
            ("ours_ms", ".1f"),
            ("ours/paper_time", ".2f"),
            ("paper/bound", ".5f"),
            ("ours/bound", ".5f"),
        ],
    )
    write_json(args.out, rows, model=model.to_dict())


if __name__ == "__main__":
    main()
