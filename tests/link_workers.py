"""Workers for the default link model: measured on the group at construction."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

import knapformer.distributed.link_probe as probe
from knapformer import SequenceBalancer, WorkloadModel

PROBED = {"latency": 2e-3, "big": 2e-3 + 5e-4, "flops": 2e10}
"""What the injected probe reads on rank 0: seconds of a tiny and of a 256 KiB exchange per peer
class, and FLOP/s of the matmul (of the order gloo over this VM's loopback measures: ~2.7 ms
latency); rank r reads them (1 + r/10)× slower."""


def _injected(rank: int) -> None:
    """The probe's timings replaced by :data:`PROBED` (no clock read): the link model and the
    plans made with it are the same on any machine load."""
    slow = 1.0 + rank / 10

    def timed(group, send_split, recv_split, device, repeats=3):
        return slow * (PROBED["latency"] if max(send_split) <= 1 else PROBED["big"])

    probe._timed_exchange = timed
    probe._matmul_flops = lambda d, device: PROBED["flops"] / slow
    probe._MEASURED.clear()


def default_link(rank: int, world: int) -> dict:
    m = WorkloadModel(d_model=64, num_heads=4)
    real = SequenceBalancer("auto", m).planning_config.link  # the real probe: this machine's clocks
    _injected(rank)
    lens = [256] * 4 if rank == 0 else [256]  # rank 0 holds four small images, the others one
    bal = SequenceBalancer("auto", m)
    link = bal.planning_config.link
    priced = bal.plan(lens)
    free = SequenceBalancer("auto", m, link="free")
    free_plan = free.plan(lens)
    # the settings round-trip: a balancer built from planning_config plans as its source does
    # (free stays free, not "measure now"; a measured link is kept, not probed again)
    again_free = SequenceBalancer(free.planning_config)
    again_priced = SequenceBalancer(bal.planning_config)
    # bytes per value follow the tensors: a bf16 step is priced at 2 bytes from the next plan on
    before = link.bytes_per_value if link is not None else None
    x = bal.route(torch.zeros(sum(lens), 4, 16, dtype=torch.bfloat16))
    bal.attention(x, x, x)
    return {
        "real": dataclasses.asdict(real) if real is not None else None,
        "link": dataclasses.asdict(link) if link is not None else None,
        "world": dist.get_world_size(),
        "free_link": free.planning_config.link,
        "priced_sizes": sorted(set(priced.group_sizes().tolist())),
        "free_sizes": sorted(set(free_plan.group_sizes().tolist())),
        "again_free": (again_free.planning_config.link, sorted(set(again_free.plan(lens).group_sizes().tolist()))),
        "again_priced": (again_priced.planning_config.link == link, again_priced.plan(lens).seq_group.tolist()),
        "priced_groups": priced.seq_group.tolist(),
        "bytes": (before, bal.planning_config.link.bytes_per_value),
    }
