"""Workers for the default link model: measured on the group at construction."""

from __future__ import annotations

import dataclasses

import torch

from knapformer import SequenceBalancer, WorkloadModel


def default_link(rank: int, world: int) -> dict:
    m = WorkloadModel(d_model=64, num_heads=4)
    lens = [256] * 4 if rank == 0 else [256]  # rank 0 holds four small images, the others one
    bal = SequenceBalancer("auto", m)
    link = bal.planning_config.link
    priced = bal.plan(lens)
    free = SequenceBalancer("auto", m, link="free")
    free_plan = free.plan(lens)
    # bytes per value follow the tensors: a bf16 step is priced at 2 bytes from the next plan on
    before = link.bytes_per_value if link is not None else None
    x = bal.route(torch.zeros(sum(lens), 4, 16, dtype=torch.bfloat16))
    bal.attention(x, x, x)
    return {
        "link": dataclasses.asdict(link) if link is not None else None,
        "free_link": free.planning_config.link,
        "priced_sizes": sorted(set(priced.group_sizes().tolist())),
        "free_sizes": sorted(set(free_plan.group_sizes().tolist())),
        "bytes": (before, bal.planning_config.link.bytes_per_value),
    }
