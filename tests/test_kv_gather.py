"""The custom-kernel path under ring plans, in one process: the kernel contract (separate query
and key bounds, bottom-right causal), the key segments every member lays out, the memory the
plan counts for them, and the planner's pricing of the all-gather."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from knapformer import BalancerConfig, WorkloadModel
from knapformer.attention import BACKENDS, available_backends, varlen_attention_qk
from knapformer.distributed.kv_gather import entry_keys
from knapformer.distributed.spec import build_route_spec
from knapformer.executor import LocalExecutor, VarlenArgs
from knapformer.plan import Plan, PlanProblem, plan_from_groups
from knapformer.plan.cost import LinkModel, ring_exposed
from knapformer.plan.memory import gather_extra_estimate, gather_share, gathered_memory, gathered_rows
from knapformer.plan.solvers.moldable import solve_moldable


def _explicit(q, k, v, cu_q, cu_k, causal):
    """Segment-by-segment softmax attention with the bottom-right causal mask, by hand."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    outs = []
    for i in range(len(cu_q) - 1):
        qs, ks, vs = q[cu_q[i] : cu_q[i + 1]], k[cu_k[i] : cu_k[i + 1]], v[cu_k[i] : cu_k[i + 1]]
        nq, nk = qs.shape[0], ks.shape[0]
        scores = torch.einsum("qhd,khd->hqk", qs, ks) / q.shape[2] ** 0.5
        if causal:
            allowed = torch.arange(nk)[None, :] <= torch.arange(nq)[:, None] + (nk - nq)
            scores = scores.masked_fill(~allowed, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vs))
    return torch.cat(outs)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_the_kernel_contract_is_bottom_right_causal_over_separate_bounds(causal, kv_heads, backend):
    """varlen_attention_qk (what pre_attn hands its tensors to), every backend that runs here:
    segment i's queries over its own keys, fewer queries than keys (a ring member's block over
    the sequence's keys), one query, equal lengths; the causal mask aligned to the bottom
    right; gradients too."""
    reason = available_backends(torch.device("cpu"))[backend]
    if reason:
        pytest.skip(reason)
    q_lens, k_lens = [3, 1, 5, 4], [7, 9, 5, 4]
    cu_q, cu_k = np.cumsum([0, *q_lens]).tolist(), np.cumsum([0, *k_lens]).tolist()
    g = torch.Generator().manual_seed(3)
    # flash-attn's rules (its CPU stand-in): one head dim for q, k, v and fp32 standing for the cast
    dt, dv, tol = (torch.float32, 8, 1e-5) if backend == "flash2_rules" else (torch.float64, 6, 1e-12)
    q = torch.randn(sum(q_lens), 4, 8, dtype=torch.float64, generator=g).to(dt).requires_grad_()
    k = torch.randn(sum(k_lens), kv_heads, 8, dtype=torch.float64, generator=g).to(dt).requires_grad_()
    v = torch.randn(sum(k_lens), kv_heads, dv, dtype=torch.float64, generator=g).to(dt).requires_grad_()
    args = (torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32), max(q_lens), max(k_lens))
    out = varlen_attention_qk(q, k, v, *args, causal=causal, backend=backend)
    ref = _explicit(q, k, v, cu_q, cu_k, causal)
    assert (out - ref).abs().max() < tol
    w = torch.randn(out.shape, dtype=torch.float64, generator=g).to(dt)
    got = torch.autograd.grad((out * w).sum(), (q, k, v))
    want = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, b in zip(got, want):
        assert (a - b).abs().max() < tol


def test_the_kernel_contract_rejects_bounds_that_do_not_cover_the_tensors():
    q = torch.zeros(4, 1, 2)
    with pytest.raises(ValueError, match="covers 3 queries"):
        varlen_attention_qk(q, q, q, torch.tensor([0, 3]), torch.tensor([0, 4]), 3, 4)


def test_varlen_args_unpack_in_flash_order_and_name_the_single_bound_only_when_shared():
    ex = LocalExecutor([3, 2])
    q = torch.randn(5, 2, 4)
    args = ex.pre_attn(q, q, q, causal=True)
    assert isinstance(args, VarlenArgs) and len(args) == 7
    q2, k2, v2, cu_q, cu_k, mq, mk = args
    assert cu_q is cu_k and cu_q.tolist() == [0, 3, 5] and mq == mk == 3
    assert args.cu_seqlens is cu_q and args.max_len == 3
    split = args._replace(cu_seqlens_k=torch.tensor([0, 4, 6], dtype=torch.int32))
    with pytest.raises(ValueError, match="different segments"):
        _ = split.cu_seqlens


MODEL = WorkloadModel(d_model=48, num_heads=6, num_kv_heads=3)


def _ring_plan(seed: int, world: int = 4, causal: bool = False) -> Plan:
    """Random lengths on ``world`` ranks; a long sequence on all ranks as a ring of 2 × 2 or
    4 × 1, others whole, on pairs (rings of 2 × 1) or on three ranks (a pure ring of 3)."""
    rng = np.random.default_rng(seed)
    lens = [[int(x) for x in rng.integers(1, 60, size=int(rng.integers(0, 3)))] for _ in range(world)]
    lens[0] += [int(rng.integers(1, 400))]
    n = sum(map(len, lens))
    groups = [tuple(range(world)), (1, 3), (2, 0, 1)] + [(r,) for r in range(world)]
    rings = [int(rng.choice([2, 4])), 2, 3] + [1] * world
    seq_group = [int(rng.integers(0, len(groups))) for _ in range(n)]
    seq_group[len(lens[0]) - 1] = 0
    return plan_from_groups(lens, groups, seq_group, MODEL, ring=rings)


@settings(max_examples=60)
@given(seed=st.integers(0, 10_000), causal=st.booleans())
@example(seed=0, causal=True)
def test_counted_key_rows_are_the_rows_every_member_lays_out(seed, causal):
    """What the plan counts for the pre_attn path (memory.gathered_rows: from the chunk table)
    equals, for every member of every ring entry, the key rows beyond its block that the
    executor lays out (kv_gather.entry_keys: from the route spec); every query row of the
    block is in exactly one segment and sees only keys of its own sequence."""
    plan = _ring_plan(seed, causal=causal)
    groups, subs, rows = gathered_rows(plan, causal)
    counted: dict = {}
    for g, s, x in zip(groups.tolist(), subs.tolist(), rows.tolist()):  # per sequence: summed per entry
        counted[(g, s)] = counted.get((g, s), 0) + x
    laid_out = {}
    for rank in range(plan.num_ranks):
        spec = build_route_spec(plan, rank)
        for e in spec.entries:
            if e.ring == 1:
                continue
            lay = entry_keys(e, causal)
            block = sum(e.blocks[e.ring_pos])
            assert sum(lay.q_lens) == block and len(lay.k_lens) == len(lay.q_lens)
            assert all(nk >= nq >= 1 for nq, nk in zip(lay.q_lens, lay.k_lens))
            assert lay.key_rows.size == sum(lay.k_lens)
            if block:
                laid_out.setdefault((e.group, e.ring_pos), set()).add(lay.key_rows.size - block)
    assert {key: {v} for key, v in counted.items() if v or key in laid_out} == laid_out


@settings(max_examples=200)
@given(L=st.integers(1, 200_000), r=st.integers(2, 64), causal=st.booleans())
@example(L=1, r=2, causal=True)
@example(L=7, r=4, causal=True)
def test_the_planners_gather_estimate_never_undercounts(L, r, causal):
    """The planner's per-member estimate of gathered key rows (placement under the cap) is at
    least the exact count of the zigzag cut for every sub-group."""
    plan = plan_from_groups([[L]] + [[]] * (r - 1), [tuple(range(r))], [0], WorkloadModel(d_model=8), ring=[r])
    _, subs, rows = gathered_rows(plan, causal)
    bound = float(gather_extra_estimate(L, r, causal))
    assert rows.size == 0 or rows.max() <= bound, (rows.tolist(), bound)


LINK = LinkModel(intra_bw=4.5e11, inter_bw=5e10, gpus_per_node=4, units_per_second=3e14)


@settings(max_examples=40)
@given(
    lens=st.lists(st.lists(st.integers(1, 30_000), max_size=3), min_size=8, max_size=8),
    cap=st.integers(2_000, 40_000),
    causal=st.booleans(),
)
@example(lens=[[30_000, 30_000], [], [], [], [], [], [], []], cap=9_000, causal=False)
def test_plans_for_the_pre_attn_path_keep_the_memory_cap(lens, cap, causal):
    """Every plan auto makes for the pre_attn path under max_tokens_per_rank holds, on every
    rank, its routed tokens plus its gathered keys and values (as tokens) within the cap — or
    no plan is returned at all (a clear ValueError)."""
    model = WorkloadModel(d_model=768, num_heads=6, num_kv_heads=3, causal=causal)
    problem = PlanProblem(seq_lens=lens, layout="auto", model=model, link=LINK, max_tokens_per_rank=cap, kv_gather=True)
    try:
        plan = solve_moldable(problem)
    except ValueError:
        return
    plan.validate()
    held = gathered_memory(plan, 6, 3, causal)
    assert held.max() <= cap
    assert (plan.memory_per_rank() == held).all()


def test_the_gather_share_counts_a_row_as_its_kv_heads_of_a_tokens_qkv():
    """6 q / 3 kv heads: u = 3 keeps 1 kv head (2 of 12 head-rows of q, k, v); u = 2 does not
    divide 3 and gets one replicated head; no head count: 2/(3u)."""
    assert float(gather_share(3, 6, 3)) == pytest.approx(2 / 12)
    assert float(gather_share(2, 6, 3)) == pytest.approx(2 / 12)
    assert float(gather_share(1, 6, 3)) == pytest.approx(6 / 12)
    assert float(gather_share(4, None)) == pytest.approx(2 / 12)


def test_the_all_gather_is_priced_exposed_and_the_ring_hidden():
    """Ring rounds hide their K/V behind the block attention; the all-gather of the pre_attn
    path cannot (one exchange before the kernel, one for the gradients after)."""
    link = LinkModel(intra_bw=1e9, inter_bw=1e9, intra_latency=0.0, inter_latency=0.0)
    sent = np.array([1e9])  # 2 s per exchange at 2 bytes a value
    ring = ring_exposed(sent, np.zeros(1), 4, np.array([100.0]), link)
    gather = ring_exposed(sent, np.zeros(1), 4, np.array([100.0]), link, gather=True)
    assert float(ring[0]) == 0.0 and float(gather[0]) == pytest.approx(2 * 2.0)


def test_a_plan_made_for_the_pre_attn_path_says_so_and_survives_json():
    big = WorkloadModel(d_model=768, num_heads=6, num_kv_heads=3)
    lens = [[60_000], [10], [10], [10], [], [], [], []]
    problem = PlanProblem(seq_lens=lens, layout="auto", model=big, link=LINK, kv_gather=True)
    plan = solve_moldable(problem)
    assert plan.kv_gather and any(r > 1 for r in plan.rings)
    back = Plan.from_json(plan.to_json())
    assert back.kv_gather and back.digest() == plan.digest()
    assert (back.memory_per_rank() == plan.memory_per_rank()).all()
    assert (plan.memory_per_rank() > plan.tokens_per_rank()).any()
    ring = solve_moldable(PlanProblem(seq_lens=lens, layout="auto", model=big, link=LINK))
    assert not ring.kv_gather and (ring.memory_per_rank() == ring.tokens_per_rank()).all()


def test_attn_path_is_validated():
    with pytest.raises(ValueError, match="attn_path must be one of"):
        BalancerConfig(layout="auto", cost=MODEL, attn_path="ring")
