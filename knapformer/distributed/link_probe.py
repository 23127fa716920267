"""The default link model: measured on the balancing group when a balancer is built.

Why measure instead of leaving communication free: a plan that prices exchanges at nothing
splits sequences whenever a split balances the ranks — with Flux sizes on 8 ranks it cut every
256-token image over all 8 ranks — and pays for it in exchanges the model never saw. Why not a
device preset: a preset is right only on the hardware it names; the group itself knows its
links (NVLink or PCIe, InfiniBand or Ethernet, gloo over loopback) and what a second is worth
in the cost model's units on its device.

:func:`measure_link` (collective over the group, a few milliseconds):

1. nodes: every rank's host name (ranks on one host share a node; ``gpus_per_node`` is the
   most ranks on one host);
2. per peer class (same node; other node), one tiny exchange with every peer of the class (its
   time is the latency) and one of ``PROBE_BYTES`` per peer (bandwidth: the extra bytes over
   the extra time), each the median of three timed repeats after a warm-up, on the device the
   data will use — the balancer's own point-to-point exchange (:mod:`.exchange`);
3. what a second is worth in the cost model's units: 1 for a model in seconds (a calibrated
   profile); for the paper's FLOP-like form, a matmul of the model's width timed on the device,
   its FLOP/s divided by 3 (a unit is one forward FLOP of a layer; training runs forward +
   backward, 3 forward FLOPs);
4. every number is the slowest rank's (a MAX all-reduce on the control group): every rank
   builds the identical model, so every rank plans the same.

Bytes per value start at the default dtype's size and follow the tensors: the balancer sets
them from the step's first agreed attention call (fp32 exchanges are priced at 4 bytes).
"""

from __future__ import annotations

import socket
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

from knapformer.distributed.agree import gather_ints, gather_text
from knapformer.distributed.exchange import TAGS, Peers, exchange
from knapformer.plan.cost import LinkModel
from knapformer.workload import WorkloadModel

__all__ = ["PROBE_BYTES", "measure_link"]

PROBE_BYTES = 1 << 18
"""Bytes sent to each peer by the bandwidth probe (256 KiB)."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_exchange(group, send_split: list[int], recv_split: list[int], device, repeats: int = 3) -> float:
    """Median seconds of an exchange of float32 values with these splits (after a warm-up):
    the balancer's own exchange primitive, point-to-point with the peers of the class."""
    x = torch.zeros(sum(send_split), dtype=torch.float32, device=device)
    peers = Peers.from_splits(send_split, recv_split, dist.get_rank(group))

    def once() -> float:
        _sync(device)
        t = time.perf_counter()
        exchange(x, peers, group, "link probe", tag=TAGS["probe"])
        _sync(device)
        return time.perf_counter() - t

    once()
    return statistics.median(once() for _ in range(repeats))


def _matmul_flops(d: int, device: torch.device) -> float:
    """FLOP/s of a (256, d) x (d, d) matmul on ``device`` (bf16 on CUDA, fp32 on the host;
    d capped at 512 to keep the probe short on a CPU)."""
    d = min(d, 512)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)  # the caller's random stream stays untouched
    a = torch.randn(256, d, generator=g, device=device, dtype=dtype)
    b = torch.randn(d, d, generator=g, device=device, dtype=dtype)
    a @ b  # warm-up

    def once() -> float:
        _sync(device)
        t = time.perf_counter()
        a @ b
        _sync(device)
        return time.perf_counter() - t

    return 2.0 * 256 * d * d / statistics.median(once() for _ in range(3))


_MEASURED: dict = {}
"""(world, group, device, units kind, probe width) -> the link measured for it: balancers built
on one group reuse it (every rank builds the same balancers in the same order, so every rank
hits or misses alike)."""


def measure_link(group, control, device: torch.device, cost: WorkloadModel) -> LinkModel:
    """The links of ``group`` measured on ``device`` (module docstring); ``control`` runs the
    small host-side gathers. Collective: every rank of the group calls it at the same point
    (the first time for this group, device and kind of cost model; later calls reuse it)."""
    in_seconds = str(cost.meta.get("units", "")).startswith("seconds")
    key = (id(dist.group.WORLD), id(group), str(device), in_seconds, min(cost.d_model, 512))
    if key not in _MEASURED:
        _MEASURED[key] = _measure(group, control, device, cost, in_seconds)
    return _MEASURED[key]


def _measure(group, control, device: torch.device, cost: WorkloadModel, in_seconds: bool) -> LinkModel:
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    hosts = gather_text(control, socket.gethostname())
    node = {h: i for i, h in enumerate(dict.fromkeys(hosts))}
    nodes = [node[h] for h in hosts]
    per_node = max(nodes.count(n) for n in set(nodes))
    elems = PROBE_BYTES // 4
    times = []
    for same in (True, False):
        # a class no rank has (one node: no other node; one rank per node: no node peer) is not
        # timed; that is known to every rank alike, so every rank skips the same exchanges
        exists = per_node > 1 if same else len(node) > 1
        peers = [p for p in range(size) if p != rank and (nodes[p] == nodes[rank]) == same]
        for n in (1, elems):
            split = [n if p in peers else 0 for p in range(size)]
            times.append(_timed_exchange(group, split, split, device) if exists else 0.0)
    flops = 0.0 if in_seconds else _matmul_flops(cost.d_model, device)
    # every number as the slowest rank measured it, in integer nanoseconds (and FLOP/s as the
    # slowest rank's time per 1e12 FLOPs): identical on every rank
    mine = [int(t * 1e9) for t in times] + [int(1e12 / flops * 1e9) if flops else 0]
    table = gather_ints(control, mine, [len(mine)] * size, "link probe").reshape(size, len(mine))
    worst = table.max(axis=0).astype(np.float64) / 1e9
    intra_lat, intra_big, inter_lat, inter_big = worst[:4]
    peers_intra = per_node - 1
    peers_inter = size - min(nodes.count(n) for n in set(nodes))

    def bandwidth(lat: float, big: float, peers: int) -> float:
        extra = max(big - lat, 1e-9)
        return max(peers, 1) * (PROBE_BYTES - 4) / extra

    intra_bw = bandwidth(intra_lat, intra_big, peers_intra) if per_node > 1 else None
    inter_bw = bandwidth(inter_lat, inter_big, peers_inter) if len(node) > 1 else None
    intra_bw, inter_bw = intra_bw or inter_bw or 1e12, inter_bw or intra_bw or 1e12  # one rank: nothing moves
    return LinkModel(
        intra_bw=float(intra_bw),
        inter_bw=float(inter_bw),
        intra_latency=float(intra_lat if per_node > 1 else inter_lat),
        inter_latency=float(inter_lat if len(node) > 1 else intra_lat),
        gpus_per_node=per_node,
        bytes_per_value=torch.empty((), dtype=torch.get_default_dtype()).element_size(),
        units_per_second=1.0 if in_seconds else float(1e12 / worst[4]) / 3.0,
    )
