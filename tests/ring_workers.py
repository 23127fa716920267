"""Workers for the ring-attention tests: plans whose groups run as rings of Ulysses sub-groups
(k = u·r ranks, any k), next to Ulysses-only and one-rank groups on the same ranks. Every rank
builds the same random plans from a seed and compares with one-process per-sequence math."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from knapformer import BalancerInputError, SequenceBalancer, WorkloadModel
from knapformer.errors import InvalidPlanError
from knapformer.plan import plan_from_groups
from knapformer.plan.plan import chunk_table
from knapformer.testing.reference import reference_attention
from tests import group_workers as G

MODEL = WorkloadModel(d_model=48)


def legal_rings(k: int, h: int, h_kv: int) -> list[int]:
    """Every r dividing k whose u = k/r splits h query and h_kv kv heads."""
    out = []
    for r in range(1, k + 1):
        u = k // r
        if k % r == 0 and h % u == 0 and (h_kv % u == 0 or u % h_kv == 0):
            out.append(r)
    return out


def random_ring_plan(world: int, seed: int, sizes, h: int, h_kv: int, force_ring: bool = True):
    """Lengths with empty ranks, 1-token, (k−1)-token and odd ones; each sequence on a random
    ordered group of a size from ``sizes`` run as a random legal ring (r > 1 when some r > 1 is
    legal and ``force_ring``), so ring, Ulysses-only and one-rank groups share ranks. The last
    sequence of rank 0 is long and on every rank as the largest legal ring."""
    rng = np.random.default_rng(seed)
    kmax = max(sizes)
    pool = [1, 2, kmax - 1, kmax + 1, 7, int(rng.integers(8, 60))]
    lens = [[int(rng.choice(pool)) or 1 for _ in range(int(rng.integers(0, 4)))] for _ in range(world)]
    lens[world - 1] = lens[world - 1][:1]
    lens[0] += [97]
    groups, rings, seq_group = [], [], []

    def group_id(members, r):
        key = (tuple(int(m) for m in members), int(r))
        if key not in list(zip(groups, rings)):
            groups.append(key[0])
            rings.append(key[1])
        return list(zip(groups, rings)).index(key)

    n = sum(map(len, lens))
    for g in range(n):
        if g == len(lens[0]) - 1:  # the long one: all ranks, the largest ring
            members = tuple(int(m) for m in rng.permutation(world))
            r = max(legal_rings(world, h, h_kv))
        else:
            k = int(rng.choice(sizes))
            members = tuple(int(m) for m in rng.permutation(world)[:k])
            legal = legal_rings(k, h, h_kv)
            ring_ones = [x for x in legal if x > 1]
            r = int(rng.choice(ring_ones if (force_ring and ring_ones and rng.random() < 0.7) else legal))
        seq_group.append(group_id(members, r))
    return plan_from_groups(lens, groups, seq_group, MODEL, ring=rings)


def check_ring_plans(rank: int, world: int, configs, steps: int, seed: int) -> dict:
    """For each (h, h_kv, sizes): ``steps`` random ring plans; round trips, attention (causal
    and not), layer gradients and cross-attention equal one process (fp64, 1e-10), with value
    heads wider than the query heads (tiled block math) and as wide (PyTorch's fused CPU
    kernel); the custom-kernel path (pre_attn, K/V all-gathered over the ring) too."""
    bal = SequenceBalancer(f"g1n{world}", MODEL)
    seen = {"ring_rounds": set(), "u": set(), "mixed": False, "empty_block": False}
    for c, (h, h_kv, sizes) in enumerate(configs):
        for step in range(steps):
            plan = random_ring_plan(world, seed + 100 * c + step, sizes, h, h_kv)
            plan.validate()
            bal.use_plan(plan)
            seen_step = {"mixed_rank": False, "idle_rank": False}
            dv_extra = 2 * (step % 2)  # even steps: Dv == D (PyTorch's fused CPU kernel); odd: tiled math
            G._check_step(bal, plan, rank, h, h_kv, seed + step, seen_step, custom_kernel=True, dv_extra=dv_extra)
            spec = bal.spec
            seen["ring_rounds"].add(spec.ring_rounds)
            rings = [e for e in spec.entries if e.ring > 1]
            seen["u"] |= {e.u for e in rings}
            seen["mixed"] |= bool(rings) and any(e.ring == 1 for e in spec.entries)
            seen["empty_block"] |= any(0 in e.blocks[e.ring_pos] for e in rings)
    seen["ring_rounds"] = sorted(seen["ring_rounds"])
    seen["u"] = sorted(seen["u"])
    return seen


def check_bad_ring_plans(rank: int, world: int) -> list[str]:
    """A ring the heads cannot serve, and a ring that does not divide its group, raise the same
    clear error on every rank before any data moves."""
    bal = SequenceBalancer(f"g1n{world}", MODEL)
    lens = [[40]] + [[]] * (world - 1)
    msgs = []
    members = tuple(range(world))
    # 4 ranks as 2 × 2 with 3 heads: 2 does not split 3 heads
    plan = plan_from_groups(lens, [members], [0], MODEL, ring=[world // 2])
    bal.use_plan(plan)
    y = bal.route(torch.zeros(40 if rank == 0 else 0, 3, 2))
    try:
        bal.attention(y, y, y)
    except InvalidPlanError as exc:
        msgs.append(str(exc))
    else:
        raise AssertionError("a ring whose sub-groups cannot split the heads ran")
    assert f"as a ring of {world // 2} × 2 cannot split 3 attention heads 2 ways" in msgs[-1], msgs[-1]
    # GQA: 4 q / 3 kv heads is not a valid head configuration at all; 6 q / 3 kv on u = 2 is not shareable
    y6, y3 = torch.zeros(y.shape[0], 6, 2), torch.zeros(y.shape[0], 3, 2)
    try:
        bal.attention(y6, y3, y3)
    except InvalidPlanError as exc:
        msgs.append(str(exc))
    else:
        raise AssertionError("a ring whose sub-groups cannot share the kv heads ran")
    assert "cannot share 3 kv heads (h=6) 2 ways" in msgs[-1], msgs[-1]
    # a ring that does not divide the group
    try:
        bal.use_plan(plan_from_groups(lens, [members], [0], MODEL, ring=[world + 1]))
    except (InvalidPlanError, ValueError) as exc:
        msgs.append(str(exc))
    else:
        raise AssertionError("a ring that does not divide its group was accepted")
    assert "must be an int >= 1 dividing" in msgs[-1], msgs[-1]
    # the balancer still works after the errors: the same plan with a legal ring
    bal.use_plan(plan_from_groups(lens, [members], [0], MODEL, ring=[world]))
    q = bal.route(torch.randn(40 if rank == 0 else 0, 3, 2, dtype=torch.float64))
    bal.attention(q, q, q)
    # a later layer with another head dim on rank 1 only: every rank raises before the ring moves
    bad = q[:, :, :1] if rank == 1 else q
    try:
        bal.attention(bad, bad, bad)
    except BalancerInputError as exc:
        msgs.append(str(exc))
    else:
        raise AssertionError("a later layer's bad q/k/v on one rank ran a ring exchange")
    assert "on rank 1" in msgs[-1], msgs[-1]
    bal.plan(lens[rank])  # and the next step runs
    q = bal.route(torch.randn(40 if rank == 0 else 0, 3, 2, dtype=torch.float64))
    bal.attention(q, q, q)
    return msgs


def check_contiguous_ring_plan(rank: int, world: int) -> dict:
    """A ring plan whose chunks are contiguous blocks (what earlier releases cut; the planner
    now cuts zigzag) still validates and runs exactly, causal and not; the zigzag plan of the
    same sequences holds two chunks per member."""
    lens = [[61, 5]] + [[3]] * (world - 1)
    groups = [tuple(range(world))] + [(r,) for r in range(world)]
    seq_group = [0, 1] + list(range(2, world + 1))
    zig = plan_from_groups(lens, groups, seq_group, MODEL, ring=[world // 2] + [1] * world)
    flat = replace(zig, chunks=chunk_table(zig.index, zig.groups, zig.seq_group))
    flat.validate()
    bal = SequenceBalancer(f"g1n{world}", MODEL)
    g = torch.Generator().manual_seed(5)
    n = sum(map(sum, lens))
    q, k, v = (torch.randn(n, 2, 3, dtype=torch.float64, generator=g) for _ in range(3))
    all_lens = [x for r in lens for x in r]
    start = sum(sum(r) for r in lens[:rank])
    mine = slice(start, start + sum(lens[rank]))
    for plan in (zig, flat):
        bal.use_plan(plan)
        for causal in (False, True):
            ref = reference_attention(q, k, v, all_lens, causal=causal)[mine]
            out = bal.reverse_route(bal.attention(*bal.route(q[mine], k[mine], v[mine]), causal=causal))
            err = float((out - ref).abs().max()) if out.numel() else 0.0
            assert err < 1e-10, (plan is flat, causal, err)
    per_member = np.bincount(zig.chunks[zig.chunk_gid == 0][:, 4], minlength=world)
    return {"zigzag_chunks_per_member": per_member.tolist()}


def check_ring_plans_and_bad_ones(rank: int, world: int, configs, steps: int, seed: int):
    """:func:`check_ring_plans`, :func:`check_bad_ring_plans` and :func:`check_contiguous_ring_plan`
    in the same processes."""
    return (
        check_ring_plans(rank, world, configs, steps, seed),
        check_bad_ring_plans(rank, world),
        check_contiguous_ring_plan(rank, world),
    )


def check_attn_paths(rank: int, world: int) -> list[str]:
    """A ring plan run through the other call than ``attn_path`` names raises the same error on
    every rank (and the balancer goes on); gathered K/V over ``max_tokens_per_rank`` raise at
    pre_attn under ``auto``, and a plan made for the pre_attn path refuses them up front."""
    from knapformer.attention import varlen_attention_qk

    lens = [[60, 5]] + [[3]] * (world - 1)
    groups = [tuple(range(world))] + [(r,) for r in range(world)]
    seq_group = [0, 1] + list(range(2, world + 1))
    plan = plan_from_groups(lens, groups, seq_group, MODEL, ring=[world] + [1] * world)
    g = torch.Generator().manual_seed(1)
    n = sum(map(sum, lens))
    q = torch.randn(n, 2, 3, dtype=torch.float64, generator=g)
    start = sum(sum(r) for r in lens[:rank])
    mine = q[start : start + sum(lens[rank])]
    ref = reference_attention(q, q, q, [x for r in lens for x in r])[start : start + sum(lens[rank])]
    msgs = []

    def run(bal, call):
        y = bal.route(mine)
        if call == "attention":
            return bal.reverse_route(bal.attention(y, y, y))
        return bal.reverse_route(bal.post_attn(varlen_attention_qk(*bal.pre_attn(y, y, y))))

    for path, wrong, right in (("attention", "pre_attn", "attention"), ("pre_attn", "attention", "pre_attn")):
        bal = SequenceBalancer(f"g1n{world}", MODEL, attn_path=path)
        bal.use_plan(plan)
        try:
            run(bal, wrong)
        except InvalidPlanError as exc:
            msgs.append(str(exc))
        else:
            raise AssertionError(f"attn_path={path!r} ran a ring plan through {wrong}")
        assert f"made for attn_path={path!r}" in msgs[-1] and f"attn_path={wrong!r}" in msgs[-1], msgs[-1]
        bal.use_plan(plan)  # the next step runs on the right call
        out = run(bal, right)
        assert (out - ref).abs().max() < 1e-10
    # the memory cap: 60 + 5 + 3·(world − 1) tokens; the ring of all ranks holds ~60/world each
    cap = int(plan.tokens_per_rank().max()) + 1
    capped = plan_from_groups(lens, groups, seq_group, MODEL, ring=[world] + [1] * world, max_tokens_per_rank=cap)
    bal = SequenceBalancer(f"g1n{world}", MODEL)
    bal.use_plan(capped)
    try:
        run(bal, "pre_attn")
    except InvalidPlanError as exc:
        msgs.append(str(exc))
    else:
        raise AssertionError("pre_attn gathered K/V beyond max_tokens_per_rank")
    assert "token-equivalents > max_tokens_per_rank" in msgs[-1], msgs[-1]
    try:
        plan_from_groups(
            lens, groups, seq_group, MODEL, ring=[world] + [1] * world, max_tokens_per_rank=cap, kv_gather=True
        )
    except ValueError as exc:
        msgs.append(str(exc))
    else:
        raise AssertionError("a plan for the pre_attn path broke the memory cap")
    assert "gathered K/V included" in msgs[-1], msgs[-1]
    bal.use_plan(plan)  # without the cap the same step runs
    assert (run(bal, "pre_attn") - ref).abs().max() < 1e-10
    # one 1-token sequence on a ring of every rank: all but one member hold no query, and a
    # kernel that then returns a fresh empty tensor (using neither q nor k) still lets every
    # rank run the backward exchanges
    one = plan_from_groups([[1]] + [[]] * (world - 1), [tuple(range(world))], [0], MODEL, ring=[world])
    bal.use_plan(one)
    x = torch.randn(1 if rank == 0 else 0, 2, 3, dtype=torch.float64, requires_grad=True)
    y = bal.route(x)
    out = bal.reverse_route(bal.post_attn(G.loop_kernel(bal.pre_attn(y, y, y, causal=True), True)))
    out.sum().backward()
    assert x.grad is not None and torch.equal(out.detach(), x.detach())  # one token attends to itself
    return msgs
