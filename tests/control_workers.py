"""Workers for the per-step costs of every family's packed forward that must not grow with the
group (issue 57): rank 0's forward FLOPs whatever the other rank holds, and device
synchronisations in the forward and backward (the CPU emulation of CUDA's sync debug mode)."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from knapformer import BalancerConfig, SequenceBalancer
from knapformer.data.batches import batch_from_lens
from knapformer.integrations.registry import FAMILIES, resolve_model
from knapformer.testing.syncs import SyncSites

PRESETS = {name: "mmdit-tiny" if name == "reference" else f"{name}-tiny" for name in FAMILIES}


def _inputs(family, lens: list[int], rank: int, step: int = 0):
    d = family.dims()
    txts = [min(3, n - 1) for n in lens]
    batch = batch_from_lens(
        lens, txts, seed=5, rank=rank, step=step, in_dim=d.in_dim, vec_dim=d.vec_dim, out_dim=d.out_dim
    )
    return family.inputs(batch)


def _balancer(family) -> SequenceBalancer:
    return SequenceBalancer(BalancerConfig(layout="g1n2", cost=family.workload(), link="free"))


def modulation_flops(rank: int, world: int) -> dict:
    """Per family: rank 0's forward FLOPs (one long sample, alone on its rank: the plan moves
    nothing) with 1 and with 12 short samples on rank 1, and the tokens the plans moved."""
    out = {}
    for name, preset in PRESETS.items():
        family = resolve_model(preset)
        torch.manual_seed(0)
        model = family.build()
        bal = _balancer(family)
        row = {}
        for case, many in (("few", 1), ("many", 12)):
            lens = [96] if rank == 0 else [6] * many
            inputs = _inputs(family, lens, rank)
            plan = bal.plan(inputs.seq_lens)
            with FlopCounterMode(display=False) as fc:
                family.forward(model, inputs, bal)
            row[case] = int(fc.get_total_flops())
            row[f"{case} moved"] = int(plan.tokens_moved)
        out[name] = row
    return out


def count_family_syncs(rank: int, world: int) -> dict:
    """Per family: device-synchronisation sites of a packed forward and backward, by step, on
    2 ranks under ``auto``-like mixing (g2n1: every sample split over both ranks, and rank 1
    without samples in the last step)."""
    out = {}
    for name, preset in PRESETS.items():
        family = resolve_model(preset)
        torch.manual_seed(0)
        model = family.build()
        bal = SequenceBalancer(BalancerConfig(layout="g2n1", cost=family.workload(), link="free"))
        steps = [([39, 19], [33]), ([28], [23, 19]), ([39, 19], [])]  # (text 3 + whole patch grids)
        with SyncSites() as syncs:
            for step, lens in enumerate(steps):
                syncs.phase(f"inputs {step}")  # (the synthetic batch's conversion: not the forward)
                inputs = _inputs(family, lens[rank], rank, step)
                syncs.phase(f"plan {step}")
                bal.plan(inputs.seq_lens)
                syncs.phase(f"forward {step}")
                y = family.forward(model, inputs, bal)
                syncs.phase(f"backward {step}")
                (y.float().square().sum() + 0 * sum(p.sum() for p in model.parameters())).backward()
        out[name] = (dict(syncs.counts), syncs.report())
    return out
