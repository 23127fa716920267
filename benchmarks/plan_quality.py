"""Planner quality: default solver vs the paper's rule vs the exact optimum / lower bound, and
layout ``auto`` vs the best fixed layout.

    python benchmarks/plan_quality.py [--seeds 3] [--exact-seconds 20] [--out runs/bench/plan_quality.json]
    python benchmarks/plan_quality.py --auto-only [--auto-ranks 32 256 1024]

``auto`` rows: Flux-size cost model (d=3072, 24 heads, 57 layers, the paper form) with the
exchanges priced by the ``h100`` preset's links (NVLink in a node, InfiniBand across), on the
paper's three mixes and random long-tailed mixes (lognormal μ=7, σ=1.2 tokens, clipped to
16–65,536, 32 sequences per rank), 32 to 1,024 ranks. ``auto/best_fixed`` compares auto's
makespan with the best of every uniform layout and the cluster search's mixed layouts, all
planned by the default solver and priced by the same cost function; ``auto/bound`` is its gap
to the moldable lower bound (communication included).

Rows: the paper's three mixes under uniform layouts (32 ranks) and a mixed layout (64 ranks),
plus small random instances where the exact MILP (scipy/HiGHS) proves the optimum. Columns:
imbalance (max/mean-1) after, makespan / lower bound, makespan / optimum (when proven), and
makespan / best bound, where the best bound is the optimum when proven, else the larger of
the plan's lower bound and the proven optimum of the 24 largest sequences alone (a valid
lower bound that is tight when a few huge sequences dominate).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import print_table, write_json  # noqa: E402

from knapformer.data import MIXES, sample_seq_lens  # noqa: E402
from knapformer.plan import plan_sequences  # noqa: E402
from knapformer.workload import WorkloadModel  # noqa: E402

LAYOUTS = [("g1n32", 32), ("g2n16", 32), ("g4n8", 32), ("g8n4", 32), ("g1n16+g2n8+g4n4+g8n2", 64)]


def exact_makespan(lens, layout, model, seconds):
    try:
        return plan_sequences(lens, layout, model, solver="exact", time_budget_s=seconds).makespan
    except TimeoutError:
        return None


def subset_bound(lens, layout, model, m, seconds):
    """A lower bound stronger than the plan's when a few huge sequences dominate: the proven
    fluid optimum of only the m largest sequences (dropping sequences never raises the
    optimum, and a plan's exact makespan is never below its fluid makespan)."""
    from knapformer.plan import PlanProblem

    flat = sorted(((model.cost(v), r, i) for r, row in enumerate(lens) for i, v in enumerate(row)), reverse=True)
    keep = {(r, i) for _, r, i in flat[:m]}
    sub = [[v for i, v in enumerate(row) if (r, i) in keep] for r, row in enumerate(lens)]
    try:
        plan = plan_sequences(sub, layout, model, solver="exact", time_budget_s=seconds)
    except TimeoutError:
        return None
    p = PlanProblem(seq_lens=sub, layout=layout, model=model)
    load = np.bincount(plan.seq_group, weights=p.work, minlength=len(p.bags))
    return float((load / p.bag_capacity).max())


def row(name, layout, lens, model, exact_seconds):
    paper = plan_sequences(lens, layout, model, solver="paper")
    ours = plan_sequences(lens, layout, model)
    opt = exact_makespan(lens, layout, model, exact_seconds) if exact_seconds > 0 else None
    if opt is None and exact_seconds > 0 and ours.gap_to_bound > 1.002:
        sub = subset_bound(lens, layout, model, 24, exact_seconds)
        bound = max(ours.lower_bound, sub or 0.0)
    else:
        bound = ours.lower_bound
    best_known = min(x for x in (opt, ours.makespan) if x is not None)
    return {
        "instance": name,
        "layout": layout,
        "imb_before": paper.imbalance_before,
        "imb_paper": paper.imbalance_after,
        "imb_ours": ours.imbalance_after,
        "paper/bound": paper.gap_to_bound,
        "ours/bound": ours.gap_to_bound,
        "paper/opt": paper.makespan / opt if opt else None,
        "ours/opt": ours.makespan / opt if opt else None,
        "ours/paper": ours.makespan / paper.makespan,
        "ours/best_bound": ours.makespan / (opt or bound),
        "ours/best": ours.makespan / best_known,
        "moved_paper": paper.tokens_moved,
        "moved_ours": ours.tokens_moved,
    }


def lognormal_lens(ranks: int, seed: int, per_rank: int = 32) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    L = np.clip(rng.lognormal(7, 1.2, size=ranks * per_rank), 16, 65536).astype(int)
    return [L[r * per_rank : (r + 1) * per_rank].tolist() for r in range(ranks)]


def auto_rows(ranks_list, seeds) -> list[dict]:
    from knapformer.cluster import candidate_layouts, hardware

    hw = hardware("h100")
    model = WorkloadModel(d_model=3072, num_heads=24, num_layers=57)
    link = hw.link(units_per_second=hw.flop_units_per_second)
    rows = []
    for ranks in ranks_list:
        fixed = candidate_layouts(ranks, 24, hw.gpus_per_node)
        for mix in (*MIXES, "lognormal"):
            for seed in range(seeds):
                lens = (
                    lognormal_lens(ranks, seed)
                    if mix == "lognormal"
                    else sample_seq_lens(mix, seed=seed, num_ranks=ranks)
                )
                auto = plan_sequences(lens, "auto", model, link=link)
                plans = {spec: plan_sequences(lens, spec, model, link=link) for spec in fixed}
                best = min(plans, key=lambda s: plans[s].makespan)
                rows.append(
                    {
                        "instance": f"{mix}/s{seed}",
                        "ranks": ranks,
                        "best_fixed": best,
                        "auto/best_fixed": auto.makespan / plans[best].makespan,
                        "auto/bound": auto.gap_to_bound,
                        "auto_degrees": ",".join(map(str, sorted(set(auto.group_sizes().tolist())))),
                        "overlapping": str(not auto.is_partition),
                        "auto_ms": 1e3 * auto.plan_seconds,
                    }
                )
                print(".", end="", flush=True)
    print()
    return rows


AUTO_COLS = [
    ("instance", "s"),
    ("ranks", "d"),
    ("best_fixed", "s"),
    ("auto/best_fixed", ".4f"),
    ("auto/bound", ".4f"),
    ("auto_degrees", "s"),
    ("overlapping", "s"),
    ("auto_ms", ".1f"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--random", type=int, default=20, help="small random instances")
    ap.add_argument("--exact-seconds", type=float, default=20.0, help="MILP time limit per instance (0 = skip)")
    ap.add_argument("--auto-ranks", type=int, nargs="+", default=[32, 256, 1024])
    ap.add_argument("--auto-seeds", type=int, default=2)
    ap.add_argument("--auto-only", action="store_true", help="only the auto vs fixed layouts table")
    ap.add_argument("--out", default="runs/bench/plan_quality.json")
    args = ap.parse_args()
    autos = auto_rows(args.auto_ranks, args.auto_seeds)
    print_table(autos, AUTO_COLS)
    worst = max(r["auto/best_fixed"] for r in autos)
    print(
        f"\nauto vs best fixed layout: worst {worst:.4f}, median {np.median([r['auto/best_fixed'] for r in autos]):.4f}"
    )
    if args.auto_only:
        write_json(args.out.replace(".json", "_auto.json"), autos)
        return
    model = WorkloadModel(d_model=3072)
    rows = []
    for mix in MIXES:
        for layout, ranks in LAYOUTS:
            for seed in range(args.seeds):
                lens = sample_seq_lens(mix, seed=seed, num_ranks=ranks)
                # the exact MILP is hopeless on 1,000+ sequences: only the mixres/joint mixes
                ex = args.exact_seconds if sum(map(len, lens)) <= 300 else 0
                rows.append(row(f"{mix}/s{seed}", layout, lens, model, ex))
                print(".", end="", flush=True)
    rng = np.random.default_rng(0)
    small_layouts = ["g1n4+g2n2", "g1n2+g2n1+g4n1", "g2n4", "g1n8"]
    for i in range(args.random):
        layout = small_layouts[i % len(small_layouts)]
        lens = [rng.integers(1, 9000, size=rng.integers(0, 5)).tolist() for _ in range(8)]
        rows.append(row(f"random/{i}", layout, lens, model, args.exact_seconds))
        print(".", end="", flush=True)
    print()
    cols = [
        ("instance", "s"),
        ("layout", "s"),
        ("imb_before", ".4f"),
        ("imb_paper", ".5f"),
        ("imb_ours", ".5f"),
        ("paper/bound", ".5f"),
        ("ours/bound", ".5f"),
        ("paper/opt", ".5f"),
        ("ours/opt", ".5f"),
        ("ours/paper", ".5f"),
        ("ours/best_bound", ".5f"),
        ("moved_paper", "d"),
        ("moved_ours", "d"),
    ]
    print_table(rows, cols)
    worse = [r for r in rows if r["ours/paper"] > 1 + 1e-12]
    ratios = [r["ours/opt"] for r in rows if r["ours/opt"] is not None]
    best = max(r["ours/best_bound"] for r in rows)
    print(
        f"\ninstances: {len(rows)}; ours worse than paper: {len(worse)}; "
        f"ours/opt where proven: max {max(ratios):.5f} over {len(ratios)}; "
        f"ours / best bound (optimum, or the larger of the plan's bound and the top-24 subset optimum): "
        f"max {best:.5f}"
        if ratios
        else ""
    )
    write_json(args.out, rows, model=model.to_dict(), auto=autos)


if __name__ == "__main__":
    main()
