"""Workers for plans made ahead (issue 57): the plans a DataLoader worker makes from the
sampler equal the balancer's gather-then-plan, and training on them is exact."""

from __future__ import annotations

import copy
import multiprocessing

import torch
from torch.utils.data import DataLoader

from knapformer import SequenceBalancer, WorkloadModel
from knapformer.data import PackedCollate, PlannedSteps, TokenBudgetBatchSampler
from knapformer.errors import BalancerInputError
from knapformer.models import build_model, preset

CFG = preset("mmdit-tiny")
SHAPES = [(1, 4, 4), (1, 8, 8), (1, 6, 10), (2, 4, 4), (4, 6, 8)]


class Mixed:
    """Samples of 5 shapes (images and short clips) with 3-11 text tokens, fp64."""

    def __len__(self) -> int:
        return 30

    def length(self, i: int) -> int:
        f, h, w = SHAPES[i % 5]
        return 3 + (5 * i) % 9 + f * h * w

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(i)
        n = self.length(i)
        return {
            "tokens": torch.randn(n, CFG.in_dim, generator=g, dtype=torch.float64),
            "target": torch.randn(n, CFG.out_dim, generator=g, dtype=torch.float64),
            "txt_len": 3 + (5 * i) % 9,
            "t": torch.rand((), generator=g, dtype=torch.float64),
            "vec": torch.randn(CFG.vec_dim, generator=g, dtype=torch.float64),
        }


def _step(model, batch, bal):
    out = model(batch["tokens"], batch["seq_lens"], batch["txt_len"], batch["t"], batch["vec"], executor=bal)
    ((out - batch["target"]) ** 2).sum().backward()
    grads = [p.grad.clone() if p.grad is not None else None for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out.detach(), grads


def plans_ahead(rank: int, world: int, workers: int) -> dict:
    """Two epochs through a DataLoader with ``workers`` processes planning: per step, the plan
    from the loader against ``bal.plan`` of the same lengths (digest), then the step run on
    each (outputs and gradients compared exactly); then one rank hands another step's plan."""
    if workers:  # the harness's rank processes are daemonic, and DataLoader workers are their children
        multiprocessing.current_process().daemon = False
    torch.manual_seed(0)
    model = build_model(CFG).double()
    other = copy.deepcopy(model)
    bal = SequenceBalancer("auto", WorkloadModel(d_model=CFG.dim, num_heads=CFG.num_heads), link="free")
    ds = Mixed()
    sampler = TokenBudgetBatchSampler(ds.length, 240, num_samples=len(ds), buckets=lambda i: SHAPES[i % 5], seed=3)
    steps = PlannedSteps(
        sampler, bal.planner(), dataset=ds, collate_fn=PackedCollate(("tokens", "target"), example=ds[0])
    )
    loader = DataLoader(steps, batch_size=None, num_workers=workers)
    same, exact, seen, moved, plans = 0, 0, [], 0, []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for step in loader:
            gathered = bal.plan(step.batch["seq_lens"])
            same += gathered.digest() == step.plan.digest()
            out_a, grads_a = _step(other, step.batch, bal)
            bal.use_plan(step.plan)
            out_b, grads_b = _step(model, step.batch, bal)
            exact += torch.equal(out_a, out_b) and all(
                (a is None and b is None) or torch.equal(a, b) for a, b in zip(grads_a, grads_b)
            )
            seen.append((epoch, step.step))
            moved += step.plan.tokens_moved
            plans.append(step.plan)
    expected = [(e, s) for e in range(2) for s in range(len(sampler.steps(e)))]
    try:  # rank 1 runs the previous step's plan: every rank raises, none runs a step apart
        bal.use_plan(plans[-1] if rank == 0 else plans[-2])
        mismatch = ""
    except BalancerInputError as exc:
        mismatch = str(exc)
    return {
        "steps": len(seen),
        "same": same,
        "exact": exact,
        "in_order": seen == expected,
        "moved": moved,
        "mismatch": mismatch,
    }
