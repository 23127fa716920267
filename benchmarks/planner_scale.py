"""Layout ``auto`` from 32 to 4,096 ranks: quality against the lower bound and the best fixed
layout, warm planning latency, and (``--three-size``) the default solver against the proven
optimum on 16-rank three-size bag layouts (``three_size_rows``).

    python benchmarks/planner_scale.py [--gpus 32 256 1024 4096] [--steps 3] [--baseline DIR]
        [--three-size] [--out runs/bench/planner_scale.json]

Model and links: Flux (d = 3072, 24 heads, 57 blocks), the paper's FLOP form, ``h100`` links
(8 GPUs per node, NVLink inside, InfiniBand across). Mixes per step (seeded, fresh lengths
every step):

- ``giant``: 4 images per rank (256, 1,024 or 4,096 tokens + U{0..392} text) and 1–4 videos
  of U(128k, 256k) tokens on distinct random ranks (``benchmarks/giant_mix.py``);
- ``paper-mixres``, ``paper-joint``: the paper's mixes, tiled to the cluster;
- ``lognormal``: 8 sequences per rank, lognormal(μ = 7, σ = 1.2) tokens clipped to 16–65,536;
- ``lognormal32``: the same with 32 sequences per rank (131k sequences at 4,096 ranks).

Columns (means over steps unless marked):

- ``auto/bound`` (and its worst step): predicted step ÷ :attr:`PlanProblem.lower_bound` (the
  allotment bound over every group size the cluster allows, ring exchanges priced);
- ``fixed/bound``: the best bag layout of the menu a user picks from (uniform and mixed
  layouts of 1, 2, 4, 8-rank bags inside nodes, :func:`~knapformer.plan.solvers.moldable.layout_menu`),
  each planned by the default solver, best per step; ``auto/fixed`` the ratio (not computed
  for ``giant``: no bag layout holds a video beyond a node);
- ``today/bound`` (with ``--baseline DIR``, a checkout of an earlier revision): that
  revision's ``auto`` plan on the same lengths re-priced by this revision's cost function and
  divided by this revision's bound, so the two columns compare planners;
- ``auto_ms``: warm planning latency — one call on the first step's lengths, then each step's
  own lengths planned once (no plan is reused), the median over steps; ``max_ms`` the worst;
- ``moved``: share of tokens that leave their rank; ``home_ok``: every step's plan predicted
  no slower than keeping every sequence at home.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import flux_h100, print_table, write_json  # noqa: E402
from giant_mix import mix_lens, today_plans  # noqa: E402

from knapformer.plan import PlanProblem, plan_sequences  # noqa: E402
from knapformer.plan.plan import build_plan  # noqa: E402
from knapformer.plan.solvers.menu import fits_nodes, layout_menu  # noqa: E402
from knapformer.plan.solvers.uniform import solve_bags as _solve_bags  # noqa: E402

MIXES = ["giant", "paper-mixres", "paper-joint", "lognormal", "lognormal32"]
THREE_SIZE = ["g1n4+g2n2+g8n1", "g1n8+g2n2+g4n1", "g1n2+g2n3+g8n1"]


def step_lens(mix: str, ranks: int, step: int) -> list[list[int]]:
    if mix == "lognormal32":
        rng = np.random.default_rng([step, ranks, 32])
        return np.clip(rng.lognormal(7, 1.2, size=(ranks, 32)), 16, 65536).astype(int).tolist()
    return mix_lens(mix, ranks, step)


def best_fixed(problem: PlanProblem) -> tuple[float, str]:
    """The best menu layout's makespan (default solver) and its spec."""
    S = problem.num_ranks
    node = problem.link.gpus_per_node
    menu = [s for s in layout_menu(S, [k for k in (1, 2, 4, 8) if k <= node and S % k == 0]) if fits_nodes(problem, s)]
    best = (np.inf, "")
    for spec in menu:
        plan = _solve_bags(problem, spec)
        if plan is not None and plan.makespan < best[0]:
            best = (plan.makespan, spec)
    return best


def scale_rows(gpus: list[int], steps: int, mixes: list[str], baseline: str | None) -> list[dict]:
    model, link = flux_h100()
    rows = []
    for mix in mixes:
        for S in gpus:
            all_lens = [step_lens(mix, S, s) for s in range(steps)]
            today = today_plans(baseline, all_lens, model, link) if baseline else None
            plan_sequences(all_lens[0], "auto", model, link=link)  # warm-up
            acc: dict[str, list] = {k: [] for k in ("auto", "fixed", "today", "ms", "moved", "home", "spec")}
            for s, lens in enumerate(all_lens):
                t0 = time.perf_counter()
                plan = plan_sequences(lens, "auto", model, link=link)
                acc["ms"].append((time.perf_counter() - t0) * 1e3)
                problem = PlanProblem(seq_lens=lens, layout="auto", model=model, link=link)
                bound = problem.lower_bound
                acc["auto"].append(plan.makespan / bound)
                acc["moved"].append(plan.tokens_moved / max(int(problem.lengths.sum()), 1))
                acc["home"].append(plan.makespan <= plan.time_before.max() * (1 + 1e-9))
                if mix != "giant":
                    fixed, spec = best_fixed(problem)
                    acc["fixed"].append(fixed / bound)
                    acc["spec"].append(spec)
                if today is not None:
                    old = today[s]
                    old = build_plan(problem, np.asarray(old["seq_group"]), solver="today", groups=old["groups"])
                    acc["today"].append(old.makespan / bound)
            ratio = np.asarray(acc["auto"]) / np.asarray(acc["fixed"]) if acc["fixed"] else None
            row = {
                "mix": mix,
                "gpus": S,
                "auto/bound": float(np.mean(acc["auto"])),
                "worst/bound": float(np.max(acc["auto"])),
                "fixed/bound": float(np.mean(acc["fixed"])) if acc["fixed"] else None,
                "auto/fixed": float(np.mean(ratio)) if ratio is not None else None,
                "today/bound": float(np.mean(acc["today"])) if acc["today"] else None,
                "auto_ms": statistics.median(acc["ms"]),
                "max_ms": max(acc["ms"]),
                "moved": float(np.mean(acc["moved"])),
                "home_ok": str(all(acc["home"])),
                "best_layout": "/".join(sorted(set(acc["spec"]))) if acc["spec"] else "",
            }
            if row["today/bound"] is not None:
                row["auto/today"] = row["auto/bound"] / row["today/bound"]
            rows.append(row)
            print(".", end="", flush=True)
    print()
    return rows


def three_size_rows(seeds: int, seconds: float) -> list[dict]:
    """The default solver vs the exact MILP (scipy/HiGHS) on 16-rank three-size layouts, 2–5
    sequences per rank, lengths lognormal(7, 1.2) clipped to 16–65,536 or videos drawn from
    {256, 1k, 4k, 16k, 32k} tokens at 30/30/20/15/5% (many equal lengths); instances the MILP
    does not prove within ``seconds`` are left out."""
    from knapformer.workload import WorkloadModel

    model = WorkloadModel(d_model=3072)
    rows = []
    for layout in THREE_SIZE:
        for kind in ("lognormal", "videos"):
            ratios, ms, sizes = [], [], []
            for seed in range(seeds):
                rng = np.random.default_rng([seed, 5, len(layout)])
                per = rng.integers(2, 6, size=16)
                if kind == "lognormal":
                    lens = [np.clip(rng.lognormal(7, 1.2, size=c), 16, 65536).astype(int).tolist() for c in per]
                else:
                    sizes_p = [0.3, 0.3, 0.2, 0.15, 0.05]
                    lens = [rng.choice([256, 1024, 4096, 16384, 32768], p=sizes_p, size=c).tolist() for c in per]
                t0 = time.perf_counter()
                plan = plan_sequences(lens, layout, model)
                ms.append((time.perf_counter() - t0) * 1e3)
                try:
                    exact = plan_sequences(lens, layout, model, solver="exact", time_budget_s=seconds)
                except TimeoutError:
                    continue
                ratios.append(plan.makespan / exact.makespan)
                sizes.append(int(per.sum()))
            rows.append(
                {
                    "layout": layout,
                    "lengths": kind,
                    "seqs": f"{min(sizes)}-{max(sizes)}" if sizes else "",
                    "proven": len(ratios),
                    "worst/opt": max(ratios) if ratios else None,
                    "over_0.2%": sum(r > 1.002 for r in ratios),
                    "lpt_ms": statistics.median(ms),
                }
            )
            print(".", end="", flush=True)
    print()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, nargs="+", default=[32, 256, 1024, 4096])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--mixes", nargs="+", default=MIXES, choices=MIXES)
    ap.add_argument("--baseline", default=None, help="checkout of an earlier revision: its auto as 'today'")
    ap.add_argument("--three-size", action="store_true", help="also the default solver vs the proven optimum")
    ap.add_argument("--three-seeds", type=int, default=20)
    ap.add_argument("--exact-seconds", type=float, default=5.0)
    ap.add_argument("--out", default="runs/bench/planner_scale.json")
    args = ap.parse_args()
    rows = scale_rows(args.gpus, args.steps, args.mixes, args.baseline)
    print_table(
        rows,
        [
            ("mix", "s"),
            ("gpus", "d"),
            ("auto/bound", ".4f"),
            ("worst/bound", ".4f"),
            ("fixed/bound", ".4f"),
            ("auto/fixed", ".4f"),
            ("today/bound", ".4f"),
            ("auto/today", ".4f"),
            ("auto_ms", ".1f"),
            ("max_ms", ".1f"),
            ("moved", ".3f"),
            ("home_ok", "s"),
        ],
    )
    three = []
    if args.three_size:
        three = three_size_rows(args.three_seeds, args.exact_seconds)
        cols = [("layout", "s"), ("lengths", "s"), ("seqs", "s"), ("proven", "d"), ("worst/opt", ".5f")]
        print_table(three, [*cols, ("over_0.2%", "d"), ("lpt_ms", ".1f")])
    write_json(args.out, rows, three_size=three, steps=args.steps, model="flux", hardware="h100")


if __name__ == "__main__":
    main()
