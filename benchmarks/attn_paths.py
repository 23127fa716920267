"""The two ways a ring group attends, as the planner prices them: ``bal.attention``'s ring
rounds vs ``pre_attn``'s K/V all-gather (your own kernel, one varlen call) — bytes, memory and
predicted step time.

    python benchmarks/attn_paths.py [--gpus 32 256 1024] [--steps 3] [--out runs/bench/attn_paths.json]

Model: Flux (d = 3072, 24 heads, 57 blocks), the paper's FLOP form (γ = 1), ``h100`` links (8
GPUs per node), bf16 on the wire. Predictions of the project's cost model, not measurements.

Table 1 — one sequence of L = 8k … 256k tokens alone on 32 ranks (4 nodes), planned by
``auto`` for each path; per member of the sequence's group: the K/V values moved per layer
forward (the same volume on both paths: r − 1 blocks of L/r tokens × its kv heads × (D + Dv)),
the attention memory it holds per layer beyond its own block (the ring: two blocks in flight;
the all-gather: the gathered keys and values, causal ≈ L·(2r − 1)/(2r) rows, else
(r − 1)/r·L), and the predicted step time of each path's plan (planner units), with their
ratio. ``causal`` doubles the rows.

Table 2 — mixes (``benchmarks/giant_mix.py``'s: ``giant`` = 4 images per rank + 1–4 videos of
128k–256k tokens; ``paper-mixres``, ``paper-joint``) at 32–1,024 ranks, ``steps`` seeded steps:
``auto`` planned for each path, mean predicted step ÷ the step's ring-path bound (and the
gather plan ÷ the bound priced for the all-gather, ``own_bound``: the planner's own gap), the
gather/ring ratio of the predicted step (mean and worst step), and the largest memory a rank
holds on the pre_attn path (routed tokens + gathered K/V as tokens, ``knapformer.plan.memory``)
against its routed tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import flux_h100, print_table, write_json  # noqa: E402
from giant_mix import mix_lens  # noqa: E402

from knapformer.plan import plan_sequences  # noqa: E402
from knapformer.plan.cost import kv_values  # noqa: E402
from knapformer.plan.memory import gather_share, gathered_memory, gathered_rows  # noqa: E402
from knapformer.plan.problem import PlanProblem  # noqa: E402

LENGTHS = [8_192, 16_384, 32_768, 65_536, 131_072, 262_144]


def _group_of_longest(plan):
    g = int(plan.seq_group[int(np.argmax(plan.index.lengths))])
    return len(plan.groups[g]), int(plan.rings[g])


def single_rows(model, link, gpus: int) -> list[dict]:
    rows = []
    for causal in (False, True):
        m = dataclasses.replace(model, causal=causal)
        for L in LENGTHS:
            lens = [[L]] + [[]] * (gpus - 1)
            ring = plan_sequences(lens, "auto", m, link=link)
            gather = plan_sequences(lens, "auto", m, link=link, kv_gather=True)
            row = {"L": L, "causal": "yes" if causal else "no", "ranks": gpus}
            for name, plan in (("ring", ring), ("gather", gather)):
                k, r = _group_of_longest(plan)
                u = k // r
                kv = float(kv_values(u, m))  # values per token of one member's kv heads, K and V
                row[f"{name}_group"] = f"{k}={u}x{r}" if r > 1 else f"{k}"
                row[f"{name}_time"] = plan.makespan
                row[f"{name}_kv_MB"] = (r - 1) * (L / r) * kv * link.bytes_per_value / 1e6 if r > 1 else 0.0
                if name == "ring":  # a few blocks of L/r: the next in flight and the send buffer
                    row["ring_extra_MB"] = 2 * (L / r) * kv * link.bytes_per_value / 1e6 if r > 1 else 0.0
                else:
                    _, _, extra = gathered_rows(plan, causal)
                    row["gather_extra_MB"] = float(extra.max()) * kv * link.bytes_per_value / 1e6 if extra.size else 0.0
                    held = gathered_memory(plan, m.num_heads, m.num_kv_heads, causal)
                    row["gather_mem_tok"] = int(held.max())
                    row["routed_tok"] = int(plan.tokens_per_rank().max())
                    row["share"] = float(gather_share(u, m.num_heads, m.num_kv_heads)) if r > 1 else 0.0
            row["gather/ring"] = row["gather_time"] / row["ring_time"]
            rows.append(row)
    return rows


def mix_rows(model, link, gpus_list, steps: int, mixes) -> list[dict]:
    rows = []
    for mix in mixes:
        for gpus in gpus_list:
            ratios, ring_gap, gather_gap, own_gap, mem, routed, rings = [], [], [], [], [], [], set()
            for step in range(steps):
                lens = mix_lens(mix, gpus, step)
                bound = PlanProblem(seq_lens=lens, layout="auto", model=model, link=link).lower_bound
                own = PlanProblem(seq_lens=lens, layout="auto", model=model, link=link, kv_gather=True).lower_bound
                ring = plan_sequences(lens, "auto", model, link=link)
                gather = plan_sequences(lens, "auto", model, link=link, kv_gather=True)
                ratios.append(gather.makespan / ring.makespan)
                ring_gap.append(ring.makespan / bound)
                gather_gap.append(gather.makespan / bound)
                own_gap.append(gather.makespan / own)
                mem.append(int(gather.memory_per_rank().max()))
                routed.append(int(gather.tokens_per_rank().max()))
                rings |= {int(r) for r in gather.rings if r > 1}
            rows.append(
                {
                    "mix": mix,
                    "gpus": gpus,
                    "ring/bound": float(np.mean(ring_gap)),
                    "gather/bound": float(np.mean(gather_gap)),
                    "gather/own_bound": float(np.mean(own_gap)),
                    "gather/ring": float(np.mean(ratios)),
                    "worst": float(np.max(ratios)),
                    "rings": "/".join(map(str, sorted(rings))) or "-",
                    "mem_tok": max(mem),
                    "routed_tok": max(routed),
                }
            )
            print(".", end="", flush=True)
    print()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, nargs="+", default=[32, 256, 1024])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--mixes", nargs="+", default=["giant", "paper-mixres", "paper-joint"])
    ap.add_argument("--out", default="runs/bench/attn_paths.json")
    args = ap.parse_args()
    model, link = flux_h100()
    single = single_rows(model, link, 32)
    print("one sequence on 32 ranks (h100, Flux): per member of its group, per layer")
    print_table(
        single,
        [
            ("L", "d"),
            ("causal", "s"),
            ("ring_group", "s"),
            ("gather_group", "s"),
            ("ring_kv_MB", ".1f"),
            ("gather_kv_MB", ".1f"),
            ("ring_extra_MB", ".1f"),
            ("gather_extra_MB", ".1f"),
            ("routed_tok", "d"),
            ("gather_mem_tok", "d"),
            ("ring_time", ".4g"),
            ("gather_time", ".4g"),
            ("gather/ring", ".4f"),
        ],
    )
    mixes = mix_rows(model, link, args.gpus, args.steps, args.mixes)
    print(f"mixes, {args.steps} steps each: predicted step of auto planned for each path")
    print_table(
        mixes,
        [
            ("mix", "s"),
            ("gpus", "d"),
            ("ring/bound", ".3f"),
            ("gather/bound", ".3f"),
            ("gather/own_bound", ".3f"),
            ("gather/ring", ".4f"),
            ("worst", ".4f"),
            ("rings", "s"),
            ("routed_tok", "d"),
            ("mem_tok", "d"),
        ],
    )
    write_json(args.out, single + mixes, steps=args.steps, model="flux", hardware="h100")


if __name__ == "__main__":
    main()
