"""Workers for the regression tests of defects held-out checks found (see ``test_defects.py``).

Each case runs on every rank and returns what this rank saw; the tests compare ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist

from knapformer import SequenceBalancer, WorkloadModel
from knapformer.distributed import BalancerConfigError, BalancerInputError
from knapformer.plan import plan_from_groups
from knapformer.testing import reference_attention

MODEL = WorkloadModel(d_model=16)
H, D = 4, 8


def _outcome(fn) -> tuple[str, str]:
    try:
        fn()
    except (ValueError, TypeError, RuntimeError) as exc:
        return type(exc).__name__, str(exc)
    return "ok", ""


def _qkv(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, H, D, generator=g, dtype=torch.float64) for _ in range(3)]


def _exact_with(bal: SequenceBalancer, plan, rank: int) -> float:
    """use_plan, route q/k/v, attention, reverse: the max error against one-process attention."""
    lens = [n for r in plan.seq_lens for n in r]
    q, k, v = _qkv(sum(lens), seed=1)
    start = sum(sum(r) for r in plan.seq_lens[:rank])
    mine = slice(start, start + sum(plan.seq_lens[rank]))
    bal.use_plan(plan)
    out = bal.reverse_route(bal.attention(*bal.route(q[mine], k[mine], v[mine])))
    ref = reference_attention(q, k, v, lens)[mine]
    return (out - ref).abs().max().item() if out.numel() else 0.0


def duplicated_groups(rank: int, world: int) -> dict:
    """A plan listing the same group twice (one-rank and multi-rank) runs exactly."""
    bal = SequenceBalancer(f"g1n{world}", MODEL)
    out = {}
    lens = [[5, 7], [3]] + [[2]] * (world - 2)
    rest = list(range(3, 3 + world - 2))
    out["one-rank twice"] = _exact_with(
        bal, plan_from_groups(lens, [(0,), (1,), (0,), *[(r,) for r in range(2, world)]], [0, 2, 1, *rest], MODEL), rank
    )
    lens = [[9, 4, 6], [5]] + [[2]] * (world - 2)
    groups = [(0, 1), (1, 0), (0, 1), *[(r,) for r in range(2, world)]]
    out["two-rank twice"] = _exact_with(bal, plan_from_groups(lens, groups, [0, 2, 1, 0, *rest], MODEL), rank)
    return out


POST_LAYOUTS = ("g1n{w}", "g{w}n1", "auto")


def post_attn_wrong_rows(rank: int, world: int) -> dict:
    """One rank hands post_attn one row too many or too few (also a rank with no sequences):
    every rank raises the same error naming that rank, and the balancer keeps working."""
    out = {}
    for spec in POST_LAYOUTS:
        bal = SequenceBalancer(spec.format(w=world), WorkloadModel(d_model=32, num_heads=H))
        for culprit in (0, world - 1):  # the last rank brings no sequences
            for extra in (1, -1):
                lens = [] if rank == world - 1 else [40, 3, 17 + rank]
                bal.plan(lens)
                y = bal.route(torch.zeros(sum(lens), 1, dtype=torch.float64))
                q2 = bal.pre_attn(*_qkv(y.shape[0], seed=rank)).q
                o = q2.new_zeros(q2.shape[0] + extra, *q2.shape[1:]) if rank == culprit and extra > 0 else q2
                if rank == culprit and extra < 0:
                    o = q2[: max(q2.shape[0] - 1, 0)] if q2.shape[0] else q2.new_zeros(0, q2.shape[1] + 1, q2.shape[2])
                out[f"{spec} rank {culprit} {extra:+d}"] = _outcome(lambda o=o, bal=bal: bal.post_attn(o))
                q, k, v = _qkv(y.shape[0], seed=rank)
                bal.reverse_route(bal.attention(q, k, v))  # still in step
    return out


def group_not_a_member(rank: int, world: int) -> tuple[str, str]:
    """Rank 0 passes a group of which it is not a member."""
    others = dist.new_group(list(range(1, world)))
    return _outcome(lambda: SequenceBalancer(f"g1n{world - 1}", MODEL, group=others))


def groups_differ(rank: int, world: int) -> tuple[str, str]:
    """Rank 0 passes the group of ranks 0 and 1, rank 1 (and every other rank) a group of itself
    alone: rank 0's group is not the group its member rank 1 passed."""
    pair = dist.new_group([0, 1])
    alone = [dist.new_group([r]) for r in range(1, world)]  # every rank creates every group
    mine = pair if rank == 0 else alone[rank - 1]
    return _outcome(lambda: SequenceBalancer("auto", MODEL, group=mine))


__all__ = [
    "BalancerConfigError",
    "BalancerInputError",
    "duplicated_groups",
    "group_not_a_member",
    "groups_differ",
    "post_attn_wrong_rows",
]


def min_tokens_route(rank: int, world: int) -> dict:
    """``Packing.route(..., min_tokens=1)`` under a plan that leaves rank 1 without a token
    (g1n2, rank 1 has no sample) raises the same error on every rank before any exchange, and
    the next step (every rank holding tokens) routes; without ``min_tokens`` it routes."""
    from knapformer.integrations.packing import Packing

    bal = SequenceBalancer("g1n2", MODEL)
    mine = [[5, 3], []][rank]
    pk = Packing([(n,) for n in mine], {"x": (0,)}, "cpu")
    h = torch.randn(sum(mine), 4, dtype=torch.float64)
    out = {}
    bal.plan(mine)
    out["strict"] = _outcome(lambda: pk.route(bal, h, min_tokens=1))
    bal.plan(mine)
    out["default"] = _outcome(lambda: pk.route(bal, h))
    both = [[5, 3], [4]][rank]
    pk2 = Packing([(n,) for n in both], {"x": (0,)}, "cpu")
    bal.plan(both)
    out["all_hold"] = _outcome(lambda: pk2.route(bal, torch.randn(sum(both), 4, dtype=torch.float64), min_tokens=1))
    return out


def rng_untouched(rank: int, world: int) -> dict:
    """Whether building a balancer (its links measured: the default), planning and one balanced
    attention leave torch's global random stream where it was: a training loop's noise and
    timesteps must not depend on whether knapformer runs (Automodel's stock-vs-knapformer test)."""
    from knapformer import BalancerConfig

    out = {}
    before = torch.get_rng_state()
    bal = SequenceBalancer(BalancerConfig(layout="auto", cost=MODEL))
    out["construct"] = torch.equal(before, torch.get_rng_state())
    lens = [24, 8] if rank == 0 else [4]
    bal.plan(lens)
    q, k, v = _qkv(sum(lens), rank)
    bal.attention(q, k, v)
    out["step"] = torch.equal(before, torch.get_rng_state())
    return out
