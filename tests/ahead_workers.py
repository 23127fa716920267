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


def count_collectives(rank: int, world: int) -> dict:
    """Whole-group collectives (all_gather, all_reduce, all_to_all_single, broadcast, barrier)
    and point-to-point batches per phase of steady-state steps of the reference MMDiT, planned
    with ``bal.plan`` and with ``use_plan`` (layout g1n2: every sequence alone; then ``auto``)."""
    import torch.distributed as dist

    counts: dict[str, int] = {}
    phase = ["start"]
    saved = {}
    for name in ("all_gather", "all_reduce", "all_to_all_single", "broadcast", "barrier", "batch_isend_irecv"):
        saved[name] = getattr(dist, name)

        def counted(*a, _name=name, **k):
            key = f"{phase[0]} {'p2p' if _name == 'batch_isend_irecv' else 'collective'}"
            counts[key] = counts.get(key, 0) + 1
            return saved[_name](*a, **k)

        setattr(dist, name, counted)
    try:
        for layout in ("g1n2", "auto"):
            torch.manual_seed(0)
            model = build_model(CFG)
            bal = SequenceBalancer(layout, WorkloadModel(d_model=CFG.dim, num_heads=CFG.num_heads), link="free")
            ds = Mixed()
            idx = [0, 1, 2] if rank == 0 else [3, 4]
            batch = PackedCollate(("tokens", "target"), example=ds[0])([ds[i] for i in idx])
            batch = {k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in batch.items()}
            model = model.float()
            planner = bal.planner()
            lens_all = [[ds.length(i) for i in ([0, 1, 2] if r == 0 else [3, 4])] for r in range(world)]
            for step in range(4):
                phase[0] = f"{layout} plan {step}"
                bal.plan(batch["seq_lens"])
                phase[0] = f"{layout} step {step}"
                out = model(
                    batch["tokens"], batch["seq_lens"], batch["txt_len"], batch["t"], batch["vec"], executor=bal
                )
                out.square().sum().backward()
            for step in range(2):
                phase[0] = f"{layout} use_plan {step}"
                bal.use_plan(planner(lens_all))
                phase[0] = f"{layout} ahead step {step}"
                out = model(
                    batch["tokens"], batch["seq_lens"], batch["txt_len"], batch["t"], batch["vec"], executor=bal
                )
                out.square().sum().backward()
        # many sequences on one rank: the same plan as its planner's
        long = [5 + i for i in range(40)] if rank == 0 else [7] * 3
        phase[0] = "long plan"
        plan = bal.plan(long)
        counts["long same"] = int(plan.digest() == bal.planner()([[5 + i for i in range(40)], [7] * 3]).digest())
        phase[0] = "long again"
        plan = bal.plan(long[::-1])
        again = [[5 + i for i in range(40)][::-1], [7] * 3]
        counts["long again same"] = int(plan.digest() == bal.planner()(again).digest())
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
    return counts
