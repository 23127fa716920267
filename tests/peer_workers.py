"""Workers for the lost-peer tests: one rank of a running job dies (SIGKILL) or hangs at a chosen
phase of a step; the others must leave the exchange they wait in with a clear error within the
balancer's ``collective_timeout_s``. Each rank is a real process; the test watches them exit."""

from __future__ import annotations

import datetime
import os
import signal
import time
import traceback

import torch
import torch.distributed as dist

PHASES = ("plan", "route", "pre_attn", "ring round 1", "reverse_route")
"""Where the victim stops: the plan's gathers, the route, a layer's Ulysses exchange, the first
ring round, the reverse route."""


def _step(bal, plan, rank: int, use_plan: bool) -> None:
    from knapformer.plan import plan_from_groups  # noqa: F401  (the plan is built by the caller)

    if use_plan:
        bal.use_plan(plan)
    else:
        bal.plan(list(plan.seq_lens[rank]))
        bal.use_plan(plan)
    x = torch.randn(sum(plan.seq_lens[rank]), 2, 4, dtype=torch.float64, requires_grad=True)
    y = bal.route(x)
    o = bal.attention(y, y, y)
    bal.reverse_route(o).sum().backward()


def worker(rank: int, world: int, port: int, victim: int, phase: str, mode: str, timeout_s: float, out) -> None:
    """Run steps of a ring plan (4 ranks: a ring of 2 Ulysses pairs); in the second the victim
    dies (``mode="kill"``) or hangs (``"hang"``) at ``phase``. A survivor reports (rank, error
    type, message, seconds from the step's start to the error) and then raises it, as a training
    script would. A survivor that moves no data with the victim in the rest of that step
    finishes it and meets the victim's absence at the next step's ``plan``: two steps run."""
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),  # the job's own, far above the balancer's bound
    )
    import knapformer.distributed.lifetime as lifetime
    from knapformer import SequenceBalancer, WorkloadModel
    from knapformer.plan import plan_from_groups

    model = WorkloadModel(d_model=8)
    lens = [[64, 3]] + [[5]] * (world - 1)
    groups = [tuple(range(world))] + [(r,) for r in range(world)]
    ring = 2 if world % 2 == 0 else world  # two Ulysses sub-groups (pre_attn moves data) when it can
    plan = plan_from_groups(lens, groups, [0, 1] + list(range(2, world + 1)), model, ring=[ring] + [1] * world)
    bal = SequenceBalancer(f"g1n{world}", model, collective_timeout_s=timeout_s)
    _step(bal, plan, rank, use_plan=True)  # a whole step first: everything is connected
    real = lifetime.collective
    armed = {"on": False}

    def stop_at(fn, tensors=(), ph="exchange", group=None):
        if armed["on"] and rank == victim and ph == phase:
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(10 * timeout_s)  # hang: alive, never joining
        return real(fn, tensors, ph, group)

    lifetime.collective = stop_at
    dist.barrier()
    armed["on"] = True
    t0 = time.monotonic()
    try:
        _step(bal, plan, rank, use_plan=phase != "plan")
        _step(bal, plan, rank, use_plan=False)  # a survivor that did not meet the victim meets it here
    except Exception as exc:
        out.put((rank, type(exc).__name__, str(exc), time.monotonic() - t0, traceback.format_exc()[-1500:]))
        raise
    out.put((rank, "none", "the step finished", time.monotonic() - t0, ""))
