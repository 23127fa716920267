"""Workers for "who waits for whom": a rank held inside its attention must not hold up a rank it
moves no data with, and every exchange involves only the peers the plan gives a rank.

Five ranks, two synchronised sets and a rank alone: group (0, 1) runs a sequence of rank 0
Ulysses-style while rank 1 also runs sequences alone; group (2, 3) likewise for ranks 2 and
3; rank 4 runs its one sequence alone and keeps its tokens home. After warm-up
steps of the same kind (steady state: no rendezvous after ``route``), rank 0 blocks inside
its attention kernel until rank 2 has finished its forward *and* backward, which rank 2
announces in the process group's store. Any coupling between the sets — an exchange or a
rendezvous that rank 2 must share with rank 0 — deadlocks the step, and rank 0's wait on the
store then fails after its timeout: the verdict does not depend on timing."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

H, D = 4, 8
WAIT_S = 60.0
"""How long rank 0 waits for rank 2's announcement (a deadlock fails here)."""


WORLD = 5


def plan_for():
    from knapformer import WorkloadModel
    from knapformer.plan import plan_from_groups

    model = WorkloadModel(d_model=H * D, num_heads=H)
    lens = [[48], [9, 7], [40], [11], [13]]
    groups = [(0, 1), (1,), (2, 3), (3,), (4,)]
    seq_group = [0, 1, 1, 2, 3, 4]
    return model, plan_from_groups(lens, groups, seq_group, model)


def expected_peers(plan, rank: int) -> dict[str, set[int]]:
    """What the plan gives ``rank`` to exchange with: route partners, and the members of its
    multi-rank groups."""
    from knapformer.plan.seqindex import DST, SRC

    ch = plan.chunks
    route = {int(d) for d in ch[ch[:, SRC] == rank, DST]} | {int(s) for s in ch[ch[:, DST] == rank, SRC]}
    layer = {m for g in set(plan.seq_group.tolist()) for m in plan.groups[g] if rank in plan.groups[g]}
    return {"route": route - {rank}, "layer": layer - {rank}}


class PeerLog:
    """Every point-to-point op this process posts: (phase, peer's global rank)."""

    def __init__(self) -> None:
        import knapformer.distributed.exchange as ex

        self.ops: list[tuple[str, int]] = []
        self.phase = "start"
        real = dist.batch_isend_irecv

        def logged(ops):
            self.ops += [(self.phase, int(op.peer)) for op in ops]
            return real(ops)

        ex.dist.batch_isend_irecv = logged  # the module's own reference (the same torch.distributed)


def run(rank: int, world: int) -> dict:
    """Both attention paths, one after the other: {path: what this rank saw}."""
    log = PeerLog()
    return {path: _run_path(rank, world, path, log) for path in ("attention", "pre_attn")}


def _run_path(rank: int, world: int, path: str, log: PeerLog) -> dict:
    import knapformer.distributed.balancer as balancer_module
    from knapformer import SequenceBalancer
    from knapformer.attention import varlen_attention_qk

    model, plan = plan_for()
    store = dist.distributed_c10d._get_default_store()
    key = f"rank 2 done ({path})"
    bal = SequenceBalancer(f"g1n{world}", model, link="free")
    hold = {"on": False}
    real_varlen = balancer_module.varlen_attention

    def held_varlen(*args, **kwargs):  # the `attention` path's kernel
        if hold["on"] and rank == 0:
            store.wait([key], datetime.timedelta(seconds=WAIT_S))
        return real_varlen(*args, **kwargs)

    balancer_module.varlen_attention = held_varlen

    def kernel(args):  # the `pre_attn` path's kernel: the user's own
        if hold["on"] and rank == 0:
            store.wait([key], datetime.timedelta(seconds=WAIT_S))
        return varlen_attention_qk(*args)

    def step(seed: int):
        bal.use_plan(plan)
        g = torch.Generator().manual_seed(seed * 10 + rank)
        x = torch.randn(sum(plan.seq_lens[rank]), H, D, generator=g, dtype=torch.float64, requires_grad=True)
        log.phase = "route"
        h = bal.route(x)
        log.phase = "layer"
        for _ in range(2):
            o = bal.attention(h, h, h) if path == "attention" else bal.post_attn(kernel(bal.pre_attn(h, h, h)))
            h = h + o
        log.phase = "route"
        y = bal.reverse_route(h)
        log.phase = "backward"
        y.square().sum().backward()
        log.phase = "after"
        return y.detach(), x.grad

    for s in range(2):  # warm-up: the kind's first step agrees at every call; then steady
        step(s)
    log.ops.clear()
    hold["on"] = True
    y, grad = step(7)
    hold["on"] = False
    if rank == 2:
        store.set(key, "1")  # forward and backward finished while rank 0 is held
    again = step(7)  # the job goes on, exactly
    balancer_module.varlen_attention = real_varlen
    return {
        "ops": list(log.ops),
        "expected": expected_peers(plan, rank),
        "same": torch.equal(y, again[0]) and torch.equal(grad, again[1]),
    }
