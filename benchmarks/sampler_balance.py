"""What the data loader hands the balancer: per-rank token imbalance before balancing and the
planner's predicted epoch time, a token-budget sampler vs a plain fixed-batch-size
``DistributedSampler``.

    python benchmarks/sampler_balance.py [--mixes paper-mixres paper-joint] [--ranks 32] [--pool-steps 40]

Dataset: the samples of ``--pool-steps`` steps of the paper's mix at ``--ranks`` ranks (each
step of the mix as :func:`knapformer.data.sample_seq_lens` draws it, all ranks' samples pooled:
the mix's proportions of resolutions and videos, one epoch = every sample once). For each
token budget B (× the longest sample) the sampler packs batches under B; the plain sampler
takes a fixed number of samples per rank per step — as many as the token-budget sampler's
batches hold on average, so both run about the same number of steps per epoch (``seen``:
samples drawn per epoch; the plain sampler repeats a few to give every rank as many).

Columns: steps per epoch; ``imbalance``: median over steps of max ÷ mean per-rank predicted
time without balancing (``Plan.time_before``: every sequence at home); ``epoch_none``: the
predicted epoch time without balancing (Σ of each step's slowest rank); ``epoch_auto``: with
layout ``auto`` (Σ of each step's makespan, exchanges included); both ÷ the plain sampler's
``epoch_none`` at the same budget. Model: Flux (d = 3072, 24 heads, 57 blocks), ``h100`` links (8 GPUs per node).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import flux_h100, print_table, write_json  # noqa: E402

from knapformer.data import TokenBudgetBatchSampler, sample_seq_lens  # noqa: E402
from knapformer.plan import plan_sequences  # noqa: E402


def pool(mix: str, ranks: int, steps: int) -> np.ndarray:
    return np.array(
        [n for s in range(steps) for rank in sample_seq_lens(mix, seed=0, step=s, num_ranks=ranks) for n in rank],
        dtype=np.int64,
    )


def plain_steps(n: int, ranks: int, batch: int, seed: int = 0) -> list[list[list[int]]]:
    """torch's DistributedSampler (shuffled; it pads the ranks to equal counts by repeating
    samples) cut into batches of ``batch`` per rank, the last one partial (DataLoader's
    ``drop_last=False``)."""
    from torch.utils.data import DistributedSampler

    per_rank = []
    for r in range(ranks):
        idx = list(DistributedSampler(range(n), num_replicas=ranks, rank=r, shuffle=True, seed=seed))
        per_rank.append([idx[i : i + batch] for i in range(0, len(idx), batch)])
    return [list(step) for step in zip(*per_rank)]


def price(steps, lengths, model, link) -> dict:
    imb, none, auto = [], 0.0, 0.0
    for step in steps:
        lens = [[int(lengths[i]) for i in b] for b in step]
        plan = plan_sequences(lens, "auto", model, link=link)
        before = plan.time_before  # every sequence at home, nothing exchanged
        imb.append(before.max() / before.mean())
        none += before.max()
        auto += plan.makespan
    seen = sum(len(b) for step in steps for b in step)
    return {"steps": len(steps), "seen": seen, "imbalance": statistics.median(imb), "none": none, "auto": auto}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mixes", nargs="+", default=["paper-mixres", "paper-joint"])
    ap.add_argument("--ranks", type=int, default=32)
    ap.add_argument("--pool-steps", type=int, default=40)
    ap.add_argument("--budgets", type=float, nargs="+", default=[1.0, 2.0], help="× the longest sample")
    ap.add_argument("--out", default="runs/bench/sampler_balance.json")
    args = ap.parse_args()
    model, link = flux_h100()
    rows = []
    for mix in args.mixes:
        lengths = pool(mix, args.ranks, args.pool_steps)
        for mult in args.budgets:
            budget = int(mult * lengths.max())
            sampler = TokenBudgetBatchSampler(lengths, budget, num_replicas=args.ranks, rank=0, seed=0)
            tb_steps = sampler.steps()
            per_batch = np.mean([len(b) for step in tb_steps for b in step])
            batch = max(1, round(per_batch))
            ours = price(tb_steps, lengths, model, link)
            plain = price(plain_steps(len(lengths), args.ranks, batch), lengths, model, link)
            for name, r, extra in (("plain", plain, f"{batch} samples"), ("token budget", ours, f"{budget} tokens")):
                rows.append(
                    {
                        "mix": mix,
                        "budget": f"{mult:g}× longest",
                        "sampler": name,
                        "per_rank": extra,
                        "samples": len(lengths),
                        "seen": r["seen"],
                        "steps": r["steps"],
                        "imbalance": r["imbalance"],
                        "epoch_none": r["none"] / plain["none"],
                        "epoch_auto": r["auto"] / plain["none"],
                    }
                )
            print(".", end="", flush=True)
    print()
    print_table(
        rows,
        [
            ("mix", "s"),
            ("budget", "s"),
            ("sampler", "s"),
            ("per_rank", "s"),
            ("samples", "d"),
            ("seen", "d"),
            ("steps", "d"),
            ("imbalance", ".2f"),
            ("epoch_none", ".3f"),
            ("epoch_auto", ".3f"),
        ],
    )
    write_json(args.out, rows, ranks=args.ranks, pool_steps=args.pool_steps, model="flux", hardware="h100")


if __name__ == "__main__":
    main()
