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


class _Counter:
    """Counts the collectives (and point-to-point batches) torch.distributed makes, per phase."""

    NAMES = ("all_gather", "all_reduce", "all_to_all_single", "broadcast", "barrier", "batch_isend_irecv")

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist, self.counts, self.phase, self.saved = dist, {}, "start", {}

    def __enter__(self):
        for name in self.NAMES:
            self.saved[name] = getattr(self.dist, name)

            def counted(*a, _name=name, **k):
                key = f"{self.phase} {'p2p' if _name == 'batch_isend_irecv' else 'collective'}"
                self.counts[key] = self.counts.get(key, 0) + 1
                return self.saved[_name](*a, **k)

            setattr(self.dist, name, counted)
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self.saved.items():
            setattr(self.dist, name, fn)


def _batches(rank: int, world: int, steps: int) -> list[dict]:
    """Per step, this rank's samples of ``Mixed`` (sizes differ between ranks and steps)."""
    ds = Mixed()
    collate = PackedCollate(("tokens", "target"), example=ds[0])
    out = []
    for k in range(steps):
        idx = [(7 * k + 3 * rank + j) % len(ds) for j in range(1 + (k + rank) % 3)]
        out.append(collate([ds[i] for i in idx]))
    return out


def plan_ahead_lengths(rank: int, world: int) -> dict:
    """Steps planned with ``plan_ahead(next lengths)`` against gather-then-plan on a second
    balancer and a copy of the model: the plans' digests, outputs and gradients; the
    collectives of each steady step; the closed loop's records (``measure``)."""
    torch.manual_seed(0)
    model = build_model(CFG).double()
    other = copy.deepcopy(model)
    cost = WorkloadModel(d_model=CFG.dim, num_heads=CFG.num_heads)
    bal = SequenceBalancer("auto", cost, link="free", measure=True)
    ref = SequenceBalancer("auto", cost, link="free", measure=True)
    records, ref_records = [], []
    bal.on_step(records.append)
    ref.on_step(ref_records.append)
    K = 7
    batches = _batches(rank, world, K)
    same = exact = moved = 0
    with _Counter() as c:
        c.phase = "first plan"
        bal.plan(batches[0]["seq_lens"])
        for k in range(K):
            c.phase = f"step {k}"
            if k + 1 < K:
                bal.plan_ahead(batches[k + 1]["seq_lens"])  # before route: it rides on route's row
            out_a, grads_a = _step(model, batches[k], bal)
            if k + 1 < K:
                plan = bal.plan(batches[k + 1]["seq_lens"])
            c.phase = f"reference {k}"
            gathered = ref.plan(batches[k]["seq_lens"])
            same += gathered.digest() == bal.current_plan.digest() if k + 1 == K else 0
            out_b, grads_b = _step(other, batches[k], ref)
            exact += torch.equal(out_a, out_b) and all(
                (a is None and b is None) or torch.equal(a, b) for a, b in zip(grads_a, grads_b)
            )
            if k + 1 < K:
                lens_all = [_batches(r, world, K)[k + 1]["seq_lens"] for r in range(world)]
                same += plan.digest() == bal.planner()(lens_all).digest()
                moved += plan.tokens_moved
        c.phase = "flush"
        bal.flush()
        ref.flush()
    return {
        "counts": c.counts,
        "steps": K,
        "same": same,
        "exact": exact,
        "moved": moved,
        "records": [(r.step, r.measured_s is not None and all(s == s for s in r.measured_s)) for r in records],
        "ref_records": [r.step for r in ref_records],
        "rendezvous": bal._checks.rendezvous_count,
        "worker process": bal._solver._proc is not None and not bal._solver.inline,
    }


def plan_ahead_plans(rank: int, world: int) -> dict:
    """Steps run with ``plan_ahead(next plan)`` then ``use_plan(plan)`` (plans made by the
    planner, as a DataLoader worker would): collectives per step, exact against gather-then-plan
    on a second balancer."""
    torch.manual_seed(0)
    model = build_model(CFG).double()
    other = copy.deepcopy(model)
    cost = WorkloadModel(d_model=CFG.dim, num_heads=CFG.num_heads)
    bal = SequenceBalancer("auto", cost, link="free")
    ref = SequenceBalancer("auto", cost, link="free")
    K = 5
    batches = [_batches(r, world, K) for r in range(world)]
    planner = bal.planner()
    plans = [planner([batches[r][k]["seq_lens"] for r in range(world)]) for k in range(K)]
    exact = same = 0
    with _Counter() as c:
        c.phase = "first"
        bal.use_plan(plans[0])
        for k in range(K):
            c.phase = f"step {k}"
            if k + 1 < K:
                bal.plan_ahead(plans[k + 1])
            out_a, grads_a = _step(model, batches[rank][k], bal)
            if k + 1 < K:
                bal.use_plan(plans[k + 1])
            c.phase = f"reference {k}"
            same += ref.plan(batches[rank][k]["seq_lens"]).digest() == plans[k].digest()
            out_b, grads_b = _step(other, batches[rank][k], ref)
            exact += torch.equal(out_a, out_b) and all(
                (a is None and b is None) or torch.equal(a, b) for a, b in zip(grads_a, grads_b)
            )
    return {"counts": c.counts, "steps": K, "exact": exact, "same": same}


def plan_ahead_errors(rank: int, world: int) -> dict:
    """Bad requests on one rank: every rank raises the same error type, then a normal step runs."""
    from knapformer.errors import DivergentCallError, PlanMismatchError

    cost = WorkloadModel(d_model=16, num_heads=2)
    bal = SequenceBalancer("auto", cost, link="free")
    lens = [40, 7, 90] if rank == 0 else [5 + rank, 13]
    x = torch.arange(sum(lens), dtype=torch.float64)[:, None]

    def step(before=None, plan_lens=None):
        bal.plan(lens if plan_lens is None else plan_lens)
        if before is not None:
            before()
        y = bal.route(x, seq_lens=lens)
        return torch.equal(bal.reverse_route(y), x)

    def outcome(fn):
        try:
            fn()
        except (BalancerInputError, DivergentCallError, PlanMismatchError) as exc:
            return type(exc).__name__, str(exc)
        return "ok", ""

    out = {}
    step()
    # a bad length on rank 1: raised at the next plan, on every rank
    step(lambda: bal.plan_ahead([-1] if rank == 1 else lens))
    out["bad length"] = outcome(lambda: bal.plan(lens))
    out["bad length then"] = step()
    # a request rank 0 made alone
    step(lambda: bal.plan_ahead(lens) if rank == 0 else None)
    out["one rank"] = outcome(lambda: bal.plan(lens))
    out["one rank then"] = step()
    # plan() with other lengths than the request on rank 1: raised at the step's route (before data moves)
    step(lambda: bal.plan_ahead(lens))
    wrong = lens + [3] if rank == 1 else lens
    out["other lengths"] = outcome(lambda: (bal.plan(wrong), bal.route(torch.zeros(sum(wrong), 1), seq_lens=wrong)))
    out["other lengths then"] = step()
    # plans that differ between ranks (rank 1 hands another lengths' plan)
    planner = bal.planner()
    good = planner([[40, 7, 90]] + [[5 + r, 13] for r in range(1, world)])
    other = planner([[40, 7, 91]] + [[5 + r, 13] for r in range(1, world)])
    step(lambda: bal.plan_ahead(other if rank == 1 else good))
    out["plans differ"] = outcome(lambda: bal.use_plan(good))
    out["plans differ then"] = step()
    # a request no agreement carried (no route before the next plan) is dropped on every rank
    bal.plan(lens)
    bal.plan_ahead([1, 2, 3])
    out["not carried"] = step()

    # a request made, and the step then fails at route on one rank: the settled plan is dropped too
    def bad_route():
        bal.plan_ahead(lens)
        bal.route(x[:-1] if rank == 0 else x, seq_lens=None)

    bal.plan(lens)
    out["route fails"] = outcome(bad_route)
    out["route fails then"] = step()
    # the worker process killed: a request it had not answered is solved inline, and the next
    # request starts a new worker; the plans are gather-then-plan's
    planner = bal.planner()
    every = [[40, 7, 90]] + [[5 + r, 13] for r in range(1, world)]
    plans = []
    for _ in range(3):
        step(lambda: bal.plan_ahead(lens))
        if bal._solver._proc is not None:
            bal._solver._proc.kill()
        plans.append(bal.plan(lens).digest() == planner(every).digest())
        y = bal.route(x, seq_lens=lens)
        plans.append(torch.equal(bal.reverse_route(y), x))
    out["worker killed"] = plans
    # a request longer than the agreement's rows hold: every rank gathers it once more
    long = list(range(5, 45)) if rank == 0 else lens
    step(lambda: bal.plan_ahead(long))
    plan = bal.plan(long)
    every = [list(range(5, 45))] + [[5 + r, 13] for r in range(1, world)]
    xl = torch.arange(sum(long), dtype=torch.float64)[:, None]
    out["long request"] = [plan.digest() == planner(every).digest(), torch.equal(bal.reverse_route(bal.route(xl)), xl)]
    return out


def flux_counts(rank: int, world: int) -> dict:
    """The issue's case: stock Flux through the documented API, layout ``g1n{world}`` (every
    sample stays on its rank: nothing to move). Whole-group collectives of each steady step —
    plan + packed forward + backward — planned inline, with ``plan_ahead(lengths)`` and with
    ``plan_ahead(plan)`` + ``use_plan``; and the outputs of the three equal."""
    from knapformer.integrations.diffusers import flux_seq_lens, flux_workload, packed_flux_forward
    from tests.flux_workers import make_sample, tiny_flux

    model = tiny_flux()
    bal = SequenceBalancer(f"g1n{world}", flux_workload(model))
    K = 4
    steps = [
        [make_sample(2 + (k + rank) % 3, 3, 2 + rank, 100 * k + 10 * rank + j) for j in range(1 + rank % 2)]
        for k in range(K)
    ]
    lens = [flux_seq_lens(model, s) for s in steps]
    every = [[None] * world for _ in range(K)]
    for k in range(K):  # every rank's lengths (the samples are a function of rank and step)
        for r in range(world):
            every[k][r] = flux_seq_lens(
                model, [make_sample(2 + (k + r) % 3, 3, 2 + r, 100 * k + 10 * r + j) for j in range(1 + r % 2)]
            )
    planner = bal.planner()
    outs = {}
    with _Counter() as c:
        for mode in ("inline", "ahead lengths", "ahead plan"):
            c.phase = f"{mode} first"
            bal.plan(lens[0]) if mode != "ahead plan" else bal.use_plan(planner(every[0]))
            plans = [planner(every[k]) for k in range(K)]
            res = []
            for k in range(K):
                c.phase = f"{mode} step {k}"
                if k and mode == "inline":
                    bal.plan(lens[k])
                if k + 1 < K and mode == "ahead lengths":
                    bal.plan_ahead(lens[k + 1])
                if k + 1 < K and mode == "ahead plan":
                    bal.plan_ahead(plans[k + 1])
                out = packed_flux_forward(model, steps[k], bal)
                out.flat.square().sum().backward()
                res.append(out.flat.detach())
                model.zero_grad(set_to_none=True)
                if k + 1 < K and mode == "ahead lengths":
                    bal.plan(lens[k + 1])
                if k + 1 < K and mode == "ahead plan":
                    bal.use_plan(plans[k + 1])
            outs[mode] = res
    same = all(torch.equal(a, b) for m in ("ahead lengths", "ahead plan") for a, b in zip(outs["inline"], outs[m]))
    return {"counts": c.counts, "same": same}
