"""Workers for the failure-behaviour tests: bad input on one rank of a running job.

Each case runs on every rank; the rank(s) named in the case misbehave. Every rank must raise
the same error type with a message naming the problem (or succeed exactly) — no hang, no
abort — and the balancer must keep working afterwards. ``run_cases`` returns, per case, the
error type and message this rank saw.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from knapformer import SequenceBalancer, WorkloadModel
from knapformer.distributed import BalancerConfigError, BalancerInputError, PlanMismatchError

MODEL = WorkloadModel(d_model=32)
H, D = 4, 8


def _outcome(fn) -> tuple[str, str]:
    try:
        fn()
    except (ValueError, TypeError, RuntimeError) as exc:
        return type(exc).__name__, str(exc)
    return "ok", ""


def _lens(rank: int) -> list[int]:
    return [40, 7, 90] if rank == 0 else [5 + rank, 13]


def _qkv(n: int, extra: int = 0):
    g = torch.Generator().manual_seed(n)
    return [torch.randn(n + extra, H, D, generator=g, dtype=torch.float64) for _ in range(3)]


def _still_works(bal: SequenceBalancer, rank: int) -> None:
    """After an error every rank is still in step: a full step round-trips exactly."""
    bal.plan(_lens(rank))
    x = torch.arange(sum(_lens(rank)), dtype=torch.float32)[:, None]
    y = bal.route(x)
    q, k, v = _qkv(y.shape[0])
    bal.attention(q, k, v)
    assert torch.equal(bal.reverse_route(y), x)


def case_layouts_differ_same_size(rank, world):
    layout = f"g{world}n1" if rank == 0 else f"g1n{world}"
    return _outcome(lambda: SequenceBalancer(layout, MODEL))


def case_group_sizes_differ(rank, world):
    layout = f"g{world}n1" if rank != world - 1 else f"g{world // 2}n1"
    return _outcome(lambda: SequenceBalancer(layout, MODEL))


def case_cap_differs(rank, world):
    return _outcome(lambda: SequenceBalancer(f"g1n{world}", MODEL, max_tokens_per_rank=1000 + (rank == 1)))


def case_bad_setting_on_one_rank(rank, world):
    return _outcome(lambda: SequenceBalancer(f"g1n{world}", MODEL, rank_speed=["fast"] * world if rank == 1 else None))


def case_route_dtype_differs(rank, world, bal):
    bal.plan(_lens(rank))
    x = torch.zeros(sum(_lens(rank)), 3, dtype=torch.bfloat16 if rank == 1 else torch.float32)
    return _outcome(lambda: bal.route(x))


def case_route_trailing_shape_differs(rank, world, bal):
    bal.plan(_lens(rank))
    x = torch.zeros(sum(_lens(rank)), 3 + (rank == world - 1))
    return _outcome(lambda: bal.route(x))


def case_pre_attn_row_too_long(rank, world, bal):
    """Layer 1 is fine; layer 2 has one row too many on rank 0: every rank raises at that
    layer's pre_attn, before its exchange."""
    bal.plan(_lens(rank))
    y = bal.route(torch.zeros(sum(_lens(rank)), 2))
    R = y.shape[0]

    def step():
        bal.attention(*_qkv(R))
        bal.attention(*_qkv(R, extra=1 if rank == 0 else 0))
        bal.reverse_route(y)

    return _outcome(step)


def case_first_layer_row_too_long(rank, world, bal):
    bal.plan(_lens(rank))
    y = bal.route(torch.zeros(sum(_lens(rank)), 2))
    return _outcome(lambda: bal.attention(*_qkv(y.shape[0], extra=1 if rank == world - 1 else 0)))


def case_heads_differ(rank, world, bal):
    """A rank whose q has other heads than the step agreed (a different model config)."""
    bal.plan(_lens(rank))
    y = bal.route(torch.zeros(sum(_lens(rank)), 2))
    R = y.shape[0]

    def step():
        bal.attention(*_qkv(R))
        q = torch.zeros(R, 2 * H if rank == 1 else H, D, dtype=torch.float64)
        bal.attention(q, q, q)
        bal.reverse_route(y)

    return _outcome(step)


def case_post_attn_extra_row(rank, world, bal):
    bal.plan(_lens(rank))
    y = bal.route(torch.zeros(sum(_lens(rank)), 2))

    def step():
        q2 = bal.pre_attn(*_qkv(y.shape[0])).q
        o = torch.cat([q2, q2[:1]]) if rank == 0 else q2
        bal.post_attn(o)
        bal.reverse_route(y)

    return _outcome(step)


def case_post_attn_short_row(rank, world, bal):
    bal.plan(_lens(rank))
    y = bal.route(torch.zeros(sum(_lens(rank)), 2))

    def step():
        q2 = bal.pre_attn(*_qkv(y.shape[0])).q
        bal.post_attn(q2[:-1] if rank == world - 1 else q2)
        bal.reverse_route(y)

    return _outcome(step)


def case_use_plan_dropped_row(rank, world, bal):
    plan = _good_plan(bal, rank)
    broken = dataclasses.replace(plan, chunks=plan.chunks[1:])
    return _outcome(lambda: bal.use_plan(broken))


def case_use_plan_dropped_row_on_one_rank(rank, world, bal):
    plan = _good_plan(bal, rank)
    mine = dataclasses.replace(plan, chunks=plan.chunks[1:]) if rank == 1 else plan
    return _outcome(lambda: bal.use_plan(mine))


def case_use_plan_differs(rank, world, bal):
    """Two valid plans of the same lengths, rank 0 holding the other one: PlanMismatchError."""
    from knapformer.plan import PlanProblem, build_plan

    problem = PlanProblem(seq_lens=[_lens(r) for r in range(world)], layout=f"g1n{world}", model=MODEL)
    home = problem.bag_of_rank[problem.src_rank]
    seq_bag = np.zeros_like(home) if rank == 0 else home  # everything on rank 0 / everything at home
    return _outcome(lambda: bal.use_plan(build_plan(problem, seq_bag, solver="hand")))


def case_planner_differs_debug_off(rank, world, bal):
    """Every rank plans from the same gathered lengths, but rank 0's planner differs (e.g. float
    sums on another CPU type): the first exchange after planning raises PlanMismatchError."""
    import knapformer.plan.planner as B  # (the solve every balancer runs: Planner.__call__)
    from knapformer.plan import build_plan

    real = B.get_solver
    B.get_solver = lambda name: lambda p, **kw: build_plan(p, np.zeros(p.num_seqs, dtype=np.int64), solver=name)
    if rank != 0:
        B.get_solver = real
    single = SequenceBalancer(f"g1n{world}", MODEL)  # rank 0 puts everything on rank 0, the others do not
    try:
        single.plan(_lens(rank))
    finally:
        B.get_solver = real
    return _outcome(lambda: single.route(torch.zeros(sum(_lens(rank)), 2)))


def case_huge_length_on_one_rank(rank, world, bal):
    return _outcome(lambda: bal.plan([2**63] if rank == 0 else [3]))


def case_bool_length_on_one_rank(rank, world, bal):
    return _outcome(lambda: bal.plan([True, 2] if rank == world - 1 else [3]))


def case_route_wrong_plan_layout(rank, world, bal):
    """Tensors laid out for other sequence lengths with the same token count."""
    bal.plan([4, 6] if rank == 0 else [5])
    return _outcome(lambda: bal.route(torch.zeros(10 if rank == 0 else 5, 2), seq_lens=[6, 4] if rank == 0 else [5]))


def _context(rank, rows_per_seq: int = 3, dtype=torch.float64):
    lens = [rows_per_seq] * len(_lens(rank))
    return torch.randn(sum(lens), 5, dtype=dtype), lens


def case_context_lengths_wrong_on_one_rank(rank, world, bal):
    """route_context with one length too few on rank 1."""
    bal.plan(_lens(rank))
    ctx, lens = _context(rank)
    return _outcome(lambda: bal.route_context(ctx, lens[:-1] if rank == 1 else lens))


def case_context_dtype_differs(rank, world, bal):
    bal.plan(_lens(rank))
    ctx, lens = _context(rank, dtype=torch.float32 if rank == 0 else torch.float64)
    return _outcome(lambda: bal.route_context(ctx, lens))


def case_cross_attention_bad_kv_rows(rank, world, bal):
    """Rank 0's keys/values have a row more than its routed context: zeros there, and the
    error is raised on every rank at the next agreement point (reverse_route)."""
    bal.plan(_lens(rank))

    def step():
        x = torch.zeros(sum(_lens(rank)), 1, dtype=torch.float64)
        y = bal.route(x)
        ctx, lens = _context(rank)
        routed = bal.route_context(ctx, lens)
        m = routed.rows.shape[0] + (rank == 0)
        q = torch.randn(y.shape[0], H, D, dtype=torch.float64)
        k = torch.randn(m, H, D, dtype=torch.float64)
        bal.cross_attention(q, k, k, routed)
        bal.reverse_route(y)

    return _outcome(step)


def _good_plan(bal, rank):
    bal.plan(_lens(rank))
    return bal.current_plan


CONSTRUCTION = [case_layouts_differ_same_size, case_group_sizes_differ, case_cap_differs, case_bad_setting_on_one_rank]
RUNNING = [
    case_route_dtype_differs,
    case_route_trailing_shape_differs,
    case_pre_attn_row_too_long,
    case_first_layer_row_too_long,
    case_heads_differ,
    case_post_attn_extra_row,
    case_post_attn_short_row,
    case_use_plan_dropped_row,
    case_use_plan_dropped_row_on_one_rank,
    case_use_plan_differs,
    case_planner_differs_debug_off,
    case_huge_length_on_one_rank,
    case_bool_length_on_one_rank,
    case_route_wrong_plan_layout,
    case_context_lengths_wrong_on_one_rank,
    case_context_dtype_differs,
    case_cross_attention_bad_kv_rows,
]


def run_cases(rank: int, world: int) -> dict[str, tuple[str, str]]:
    out = {}
    for case in CONSTRUCTION:
        out[case.__name__] = case(rank, world)
    bal = SequenceBalancer(f"g1n{world // 2}+g2n{world // 4}" if world >= 4 else f"g{world}n1", MODEL)
    for case in RUNNING:
        out[case.__name__] = case(rank, world, bal)
        _still_works(bal, rank)
    return out


EXPECTED = {
    "case_layouts_differ_same_size": (BalancerConfigError, "'layout' differs on rank(s)"),
    "case_group_sizes_differ": (BalancerConfigError, "'layout' differs on rank(s)"),
    "case_cap_differs": (BalancerConfigError, "'max_tokens_per_rank' differs on rank(s) [1]"),
    "case_bad_setting_on_one_rank": (BalancerConfigError, "invalid settings on rank(s) [1]"),
    "case_route_dtype_differs": (BalancerInputError, "argument 0: float32 (·, 3) on rank"),
    "case_route_trailing_shape_differs": (BalancerInputError, "ranks disagree before data moves: argument 0: float32"),
    "case_pre_attn_row_too_long": (BalancerInputError, "SequenceBalancer.attention: bad input on rank(s) [0]"),
    "case_first_layer_row_too_long": (BalancerInputError, "SequenceBalancer.attention: bad input on rank(s)"),
    "case_heads_differ": (BalancerInputError, "float64 (·, 8, 8) on rank 1; k:"),
    "case_post_attn_extra_row": (BalancerInputError, "SequenceBalancer.post_attn: bad input on rank(s) [0]"),
    "case_post_attn_short_row": (BalancerInputError, "SequenceBalancer.post_attn: bad input on rank(s)"),
    "case_use_plan_dropped_row": (BalancerInputError, "SequenceBalancer.use_plan: bad input on rank(s)"),
    "case_use_plan_dropped_row_on_one_rank": (BalancerInputError, "bad input on rank(s) [1]"),
    "case_use_plan_differs": (PlanMismatchError, "plan differs on rank(s)"),
    "case_planner_differs_debug_off": (PlanMismatchError, "plan differs on rank(s)"),
    "case_huge_length_on_one_rank": (BalancerInputError, "bad local_seq_lens on rank(s) [0]"),
    "case_bool_length_on_one_rank": (BalancerInputError, "bad local_seq_lens on rank(s)"),
    "case_route_wrong_plan_layout": (BalancerInputError, "bad input on rank(s) [0]"),
    "case_context_lengths_wrong_on_one_rank": (
        BalancerInputError,
        "SequenceBalancer.route_context: bad input on rank(s) [1]",
    ),
    "case_context_dtype_differs": (BalancerInputError, "argument 0 (context): float32 (·, 5) on rank 0"),
    "case_cross_attention_bad_kv_rows": (
        BalancerInputError,
        "SequenceBalancer.reverse_route: bad input on rank(s) [0]",
    ),
}
"""Case -> (error type every rank raises, text every rank's message contains)."""
