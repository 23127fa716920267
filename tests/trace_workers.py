"""Worker for the profiler-range test: one profiled step on a plan with a ring group, a
Ulysses-only group and one-rank sequences."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from knapformer import SequenceBalancer, WorkloadModel
from knapformer.plan import plan_from_groups

MODEL = WorkloadModel(d_model=16)


def profiled_step(rank: int, world: int) -> list[str]:
    """Names of the knapformer ranges of one profiled step (plan, route, attention, reverse,
    backward)."""
    lens = [[40, 6], [9, 3]]
    groups = [(0, 1), (1, 0), (0,), (1,)]
    plan = plan_from_groups(lens, groups, [0, 1, 3, 2], MODEL, ring=[2, 1, 1, 1])
    bal = SequenceBalancer(f"g1n{world}", MODEL)
    x = torch.randn(sum(lens[rank]), 3, 2, 4, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        bal.use_plan(plan)
        q, k, v = bal.route(x).unbind(1)
        out = bal.reverse_route(bal.attention(q, k, v, causal=True))
        out.sum().backward()
    return sorted({e.name for e in prof.events() if e.name.startswith("knapformer.")})
