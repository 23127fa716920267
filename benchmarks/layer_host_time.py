"""Per-layer host time of one rank's attention call against the size of the plan's group.

    python benchmarks/layer_host_time.py [--gpus 64 512 4096] [--calls 200] [--out runs/bench/layer_host_time.json]

What one ``SequenceBalancer.attention`` (and ``pre_attn`` + ``post_attn``) call costs the host
in a steady-state step — the schedule check, the plan checks, the Ulysses layout's packing
and gathers, the exchange bookkeeping — against the size of the plan. The call runs in one
process: its exchanges post nothing (received rows are zeros, the header handshake sees
matching peers) and its attention kernel is a no-op returning zeros, so what is timed is the
host work around them, on the rank's routed tensors (tokens × 24 heads × head dim 1). Median
over ``--calls`` warm calls. Cases:

- ``overlapping``: the same work on every rank whatever the size — one 256-token sequence
  alone, a chunk of a 2,048-token sequence on its bag of 8, a chunk of a 1,024-token sequence
  on a group of 4 shifted by 2 (so the groups overlap and chain every rank into one
  synchronised set); rank 8's call. Per-call work must not grow with the group: issue 56 asks
  for flat within 20% from 64 to 4,096 ranks.
- ``realistic``: a realistic step planned by ``auto`` (the realistic mix tokenised for Flux,
  dealt 65,536 tokens per rank, Flux's cost model, ``h100`` links): the rank in the most
  multi-rank groups and a rank that runs its sequences alone (their routed tokens differ
  between sizes, and the copies scale with them).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from _common import print_table, write_json  # noqa: E402

H, D = 24, 1


def fake_balancer(plan, rank: int, model):
    """A balancer of one rank of ``plan`` in a scheduled step, without process groups."""
    import knapformer.distributed.checks as checks
    from knapformer.config import BalancerConfig
    from knapformer.distributed.balancer import SequenceBalancer
    from knapformer.distributed.closed_loop import ClosedLoop
    from knapformer.distributed.spec import build_route_spec

    S = plan.num_ranks
    bal = object.__new__(SequenceBalancer)
    bal.config = BalancerConfig(layout=f"g1n{S}", cost=model, link="free").resolved(S)
    bal.group, bal.group_rank = None, rank
    bal._plan, bal._spec = plan, build_route_spec(plan, rank)
    bal._loop = ClosedLoop(bal.config)
    bal._loop.planning = dataclasses.replace(bal._loop.planning, link=None)  # "free", as the balancer resolves it
    bal._call = bal._expected = bal._played = None
    bal._data_device = torch.device("cpu")
    bal._kv_gather = False
    bal._checks = checks.StepChecks(None, None, rank)
    bal._checks.player = bal._play
    return bal


def overlapping_plan(S: int, model):
    """The ``overlapping`` case (module docstring): every rank the same work, overlapping
    groups of 8 and 4 chaining all ranks."""
    from knapformer.plan import plan_from_groups

    bags = [tuple(range(b, b + 8)) for b in range(0, S, 8)]
    shifted = [tuple((b + 2 + i) % S for i in range(4)) for b in range(0, S, 4)]
    alone = [(r,) for r in range(S)]
    groups = bags + shifted + alone
    lens, seq_group = [], []
    for r in range(S):
        mine = [256]
        seq_group.append(len(bags) + len(shifted) + r)
        if r % 8 == 0:
            mine.append(2048)
            seq_group.append(r // 8)
        if r % 4 == 2:
            mine.append(1024)
            seq_group.append(len(bags) + (r - 2) // 4)
        lens.append(mine)
    return plan_from_groups(lens, groups, seq_group, model)


def steady(bal, calls) -> None:
    """Put the balancer in a scheduled segment whose next calls are ``calls`` (LayerCalls)."""
    c = bal._checks
    c._kind, c._schedule, c._record, c._at, c.index = ("bench",), (None, *calls), [None], 1, 1


def time_calls(bal, q, path: str, n: int) -> float:
    from knapformer.distributed.checks import LayerCall

    if path == "attention":
        calls = (LayerCall.of("attention", (q, q, q), False),)
    else:
        calls = (LayerCall.of("pre_attn", (q, q, q), False), LayerCall("post_attn"))
    times = []
    for i in range(n + 10):
        steady(bal, calls)
        t0 = time.perf_counter()
        if path == "attention":
            bal.attention(q, q, q)
        else:
            args = bal.pre_attn(q, q, q, causal=False)
            bal.post_attn(torch.zeros_like(args.q))
        if i >= 10:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", type=int, nargs="+", default=[64, 512, 4096])
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--out", default="runs/bench/layer_host_time.json")
    args = p.parse_args()

    from realistic_mix import steps_of

    import knapformer.distributed.balancer as balancer_module
    import knapformer.distributed.checks as checks
    import knapformer.distributed.exchange as exchange
    from knapformer.cluster import ModelShape, hardware
    from knapformer.integrations.registry import model_config
    from knapformer.plan import plan_sequences

    torch.set_num_threads(1)

    def no_post(x, out, peers, group, phase, tag):  # nothing posted: received rows stay zero
        s, r, n = peers.local
        out.zero_()
        if n:
            out.narrow(0, r, n).copy_(x.narrow(0, s, n))
        return exchange._DONE

    exchange._post = no_post
    checks.handshake = lambda peers, header, rank, group, phase: {p: tuple(header) for p in peers if p != rank}
    balancer_module.varlen_attention = lambda q, k, v, cu, mx, causal=False, backend="auto": q.new_zeros(
        (q.shape[0], q.shape[1], v.shape[2])
    )
    hw = hardware("h100")
    shape = ModelShape.from_config(model_config("diffusers-flux-dev"))
    cost = shape.workload()
    link = hw.link(shape, units_per_second=hw.flop_units_per_second)
    rows = []

    def measure(case: str, S: int, plan, rank: int, label: str) -> None:
        bal = fake_balancer(plan, rank, cost)
        q = torch.zeros(bal._spec.num_routed, H, D)
        multi = sum(1 for e in bal._spec.entries if e.degree > 1)
        for path in ("attention", "pre_attn"):
            rows.append(
                {
                    "case": case,
                    "gpus": S,
                    "rank": f"{rank} ({label})",
                    "groups": len(set(plan.seq_group.tolist())),
                    "rank_groups": multi,
                    "routed": bal._spec.num_routed,
                    "path": path,
                    "host_ms": 1e3 * time_calls(bal, q, path, args.calls),
                }
            )

    for S in args.gpus:
        measure("overlapping", S, overlapping_plan(S, cost), 8, "groups of 8 and 4")
    for S in args.gpus:
        (lens,), _ = steps_of("realistic", "diffusers-flux-dev", S, 1)
        plan = plan_sequences(lens, "auto", cost, link=link)
        multi = [0] * S
        for g in set(plan.seq_group.tolist()):
            if len(plan.groups[g]) > 1:
                for m in plan.groups[g]:
                    multi[m] += 1
        measure("realistic", S, plan, max(range(S), key=lambda r: (multi[r], -r)), "in groups")
        alone = next((r for r in range(S) if multi[r] == 0), None)
        if alone is not None:
            measure("realistic", S, plan, alone, "alone")
    cols = [
        ("case", "s"),
        ("gpus", "d"),
        ("rank", "s"),
        ("groups", "d"),
        ("rank_groups", "d"),
        ("routed", "d"),
        ("path", "s"),
        ("host_ms", ".3f"),
    ]
    print_table(rows, cols)
    write_json(args.out, rows, args=vars(args))


if __name__ == "__main__":
    main()
