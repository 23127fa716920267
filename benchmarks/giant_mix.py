"""Sequences beyond one node: ``auto`` with rings vs without (the heads cap groups at 8) vs a
reproduction of Megatron-Core's hybrid context-parallel scheduler, all priced by the planner's
one cost function, against a moldable lower bound that prices the ring the same way.

    python benchmarks/giant_mix.py [--gpus 32 256 1024] [--steps 3] [--out runs/bench/giant_mix.json]

Model: Flux (d = 3072, 24 heads, 57 blocks), the paper's FLOP form (γ = 1), ``h100`` links (8
GPUs per node). Mixes, per step (seeded):

- ``giant``: 4 images per rank (256², 512² or 1024² pixels uniformly: 256, 1,024 or 4,096
  tokens, + U{0..392} text tokens) and 1–4 videos (uniform) of U(128k, 256k) tokens on
  distinct random ranks;
- ``paper-mixres``, ``paper-joint`` (the paper's mixes, tiled) and ``lognormal`` (8 sequences
  per rank, lognormal μ = 7, σ = 1.2 tokens clipped to 16–65,536).

Columns, each the mean over steps of the predicted step (planner units) ÷ the step's bound:

- ``auto``: layout ``auto`` (rings where the heads cannot split a group: Ulysses over 8 inside a
  node × ring across nodes); ``noring``: ``auto:noring`` (what ``auto`` was before rings);
- ``megatron``: Megatron-Core's dynamic (hybrid) context parallelism as published: each
  sequence gets the power-of-two CP size ⌈L / cap⌉ rounds up to, sequences in decreasing cost
  go to the aligned block of that size whose busiest member is least loaded; run on the same
  executor (so the same Ulysses × ring pricing), best cap of 1k … 256k tokens per rank per step;
- bound: :func:`knapformer.plan.bound.moldable_lower_bound` over every allowed degree, ring
  exchanges priced like the plans' (Ulysses inside a node × ring across nodes);
- ``today`` (with ``--baseline DIR``, a checkout of an earlier revision): that revision's
  ``auto`` on the same lengths, priced by *this* revision's cost function (its plan's groups
  and chunks re-priced here), so the columns compare planners, not pricing.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import flux_h100, print_table, write_json  # noqa: E402

from knapformer.data import sample_seq_lens  # noqa: E402
from knapformer.plan import plan_sequences  # noqa: E402
from knapformer.plan.plan import build_plan  # noqa: E402
from knapformer.plan.problem import PlanProblem  # noqa: E402
from knapformer.plan.solvers.hybrid_cp import hybrid_cp_plan  # noqa: E402
from knapformer.workload import WorkloadModel  # noqa: E402

CAPS = [1024 * 2**i for i in range(9)]  # 1k … 256k tokens per rank


def giant_lens(ranks: int, seed: int) -> list[list[int]]:
    """4 images per rank + 1–4 videos of 128k–256k tokens (module docstring)."""
    rng = np.random.default_rng([seed, ranks])
    res = rng.choice([256, 512, 1024], size=(ranks, 4))
    lens = [[int((r // 16) ** 2 + rng.integers(0, 393)) for r in row] for row in res]
    n_videos = int(rng.integers(1, 5))
    for r in rng.choice(ranks, size=n_videos, replace=False).tolist():
        lens[r].append(int(rng.integers(128_000, 256_001)))
    return lens


def lognormal_lens(ranks: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng([seed, ranks, 7])
    L = np.clip(rng.lognormal(7, 1.2, size=(ranks, 8)), 16, 65536).astype(int)
    return L.tolist()


def mix_lens(mix: str, ranks: int, seed: int) -> list[list[int]]:
    if mix == "giant":
        return giant_lens(ranks, seed)
    if mix == "lognormal":
        return lognormal_lens(ranks, seed)
    return sample_seq_lens(mix, seed=seed, step=0, num_ranks=ranks)


def megatron_plan(problem: PlanProblem, cap: int):
    """Megatron-Core's hybrid CP assignment (module docstring) as a plan of ``problem``."""
    return hybrid_cp_plan(problem, cap)


_TODAY = """
import json, sys
sys.path.insert(0, sys.argv[1])
from knapformer.plan import plan_sequences
from knapformer.workload import WorkloadModel
from knapformer.plan.cost import LinkModel
job = json.load(sys.stdin)
model = WorkloadModel(**job["model"])
link = LinkModel(**job["link"])
out = []
for lens in job["steps"]:
    p = plan_sequences(lens, "auto", model, link=link)
    groups, seq_group = (p.groups, p.seq_group) if hasattr(p, "groups") else (p.bags, p.seq_bag)
    out.append({"groups": [list(g) for g in groups], "seq_group": seq_group.tolist()})
print(json.dumps(out))
"""


def today_plans(baseline: str, steps: list, model: WorkloadModel, link) -> list[dict]:
    """The baseline checkout's ``auto`` plans (groups, seq_group) for each step's lengths."""
    import dataclasses
    import json
    import subprocess

    job = {
        "steps": steps,
        "model": {"d_model": model.d_model, "num_heads": model.num_heads, "num_layers": model.num_layers},
        "link": dataclasses.asdict(link),
    }
    res = subprocess.run(
        [sys.executable, "-c", _TODAY, str(Path(baseline).resolve())],
        input=json.dumps(job),
        capture_output=True,
        text=True,
    )
    if res.returncode:
        raise RuntimeError(f"baseline {baseline} failed:\n{res.stderr}")
    return json.loads(res.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, nargs="+", default=[32, 256, 1024])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--mixes", nargs="+", default=["giant", "paper-mixres", "paper-joint", "lognormal"])
    ap.add_argument("--out", default="runs/bench/giant_mix.json")
    ap.add_argument("--baseline", default=None, help="checkout of an earlier revision: its auto as 'today'")
    args = ap.parse_args()
    model, link = flux_h100()
    rows = []
    for mix in args.mixes:
        for gpus in args.gpus:
            acc: dict[str, list[float]] = {
                k: [] for k in ("auto", "noring", "megatron", "today", "auto_ms", "noring_ms")
            }
            caps, rings, kmax = [], set(), 0
            all_lens = [mix_lens(mix, gpus, step) for step in range(args.steps)]
            today = today_plans(args.baseline, all_lens, model, link) if args.baseline else None
            for step, lens in enumerate(all_lens):
                problem = PlanProblem(seq_lens=lens, layout="auto", model=model, link=link)
                bound = problem.lower_bound
                for name, layout in (("auto", "auto"), ("noring", "auto:noring")):
                    plan_sequences(lens, layout, model, link=link)  # warm
                    t0 = time.perf_counter()
                    plan = plan_sequences(lens, layout, model, link=link)
                    acc[f"{name}_ms"].append((time.perf_counter() - t0) * 1e3)
                    acc[name].append(plan.makespan / bound)
                    if name == "auto":
                        rings |= {int(r) for r in plan.rings}
                        kmax = max(kmax, int(plan.group_sizes().max()))
                best = min((p.makespan, c) for c in CAPS if (p := megatron_plan(problem, c)) is not None)
                acc["megatron"].append(best[0] / bound)
                caps.append(best[1])
                if today is not None:
                    t = today[step]
                    old = build_plan(problem, np.asarray(t["seq_group"]), solver="today", groups=t["groups"])
                    acc["today"].append(old.makespan / bound)
            row = {"mix": mix, "gpus": gpus, **{k: float(np.mean(v)) if v else None for k, v in acc.items()}}
            row["megatron_cap"] = "/".join(str(c // 1024) + "k" for c in caps)
            row["auto/megatron"] = row["auto"] / row["megatron"]
            row["largest_group"] = kmax
            row["rings"] = "/".join(str(r) for r in sorted(rings))
            rows.append(row)
            print(".", end="", flush=True)
    print()
    print_table(
        rows,
        [
            ("mix", "s"),
            ("gpus", "d"),
            ("auto", ".3f"),
            ("noring", ".3f"),
            ("megatron", ".3f"),
            ("today", ".3f"),
            ("auto/megatron", ".3f"),
            ("megatron_cap", "s"),
            ("largest_group", "d"),
            ("rings", "s"),
            ("auto_ms", ".1f"),
            ("noring_ms", ".1f"),
        ],
    )
    write_json(args.out, rows, steps=args.steps, model="flux", hardware="h100")


if __name__ == "__main__":
    main()
