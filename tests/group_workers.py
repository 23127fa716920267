"""Workers for the per-sequence group tests: plans whose groups overlap, change every step and
have any size the heads allow; GQA/MQA. Every rank builds the same random plans from a seed,
runs them with ``use_plan`` and compares with one-process per-sequence math."""

from __future__ import annotations

import numpy as np
import torch

from knapformer import SequenceBalancer, WorkloadModel
from knapformer.distributed import BalancerInputError
from knapformer.errors import InvalidPlanError
from knapformer.plan import plan_from_groups
from knapformer.testing import reference_attention, reference_cross_attention

MODEL = WorkloadModel(d_model=48)


def random_group_plan(world: int, seed: int, sizes: tuple[int, ...]):
    """Lengths with empty ranks, 1-token sequences and long ones; each sequence on a random
    ordered set of distinct ranks whose size is drawn from ``sizes``. A fixed part makes rank 0
    hold whole sequences alone *and* chunks of groups of size 2 (and 4 when world >= 4) with
    different partners in the same step."""
    rng = np.random.default_rng(seed)
    lens = [
        [int(rng.choice([1, 2, 5, int(rng.integers(6, 70))])) for _ in range(int(rng.integers(0, 4)))]
        for _ in range(world)
    ]
    lens[world - 1] = []  # a rank that contributes nothing
    lens[0] += [9, 33, 1, 57]
    groups, seq_group = [], []

    def group_id(members):
        members = tuple(int(m) for m in members)
        if members not in groups:
            groups.append(members)
        return groups.index(members)

    fixed = [(0,), (0, 1), (1, 0)] + ([(3, 0, 2, 1)] if world >= 4 else [])
    n = sum(map(len, lens))
    for g in range(n):
        if g >= n - 4:  # the four sequences appended to rank 0
            members = fixed[(g - (n - 4)) % len(fixed)]
        else:
            k = int(rng.choice(sizes))
            members = rng.permutation(world)[:k]
        seq_group.append(group_id(members))
    # the last rank holds nothing unless some group gives it a chunk; keep one rank idle when
    # possible by never choosing it for the fixed sequences (above) — random groups may use it
    return plan_from_groups(lens, groups, seq_group, MODEL)


def _close(a: torch.Tensor, b: torch.Tensor, what: str, tol: float) -> None:
    err = (a - b).abs().max().item() if a.numel() else 0.0
    scale = max(1.0, b.abs().max().item() if b.numel() else 1.0)
    assert err <= tol * scale, f"{what}: max error {err:.3e}"


def _mine(plan, rank):
    start = sum(sum(r) for r in plan.seq_lens[:rank])
    return slice(start, start + sum(plan.seq_lens[rank]))


def check_overlapping_groups(rank: int, world: int, heads: int, kv_heads: int, sizes, steps: int, seed: int) -> dict:
    """Round trips bit-exact (fp32, bf16, int64, bool); attention, causal and not, and the
    gradients of a qkv -> attention -> projection layer equal one process (fp64)."""
    bal = SequenceBalancer(f"g1n{world}", MODEL)
    seen = {"mixed_rank": False, "idle_rank": False}
    for step in range(steps):
        plan = random_group_plan(world, seed + step, sizes)
        plan.validate()
        bal.use_plan(plan)
        _check_step(bal, plan, rank, heads, kv_heads, seed + step, seen)
    return seen


def check_auto_balancer(
    rank: int, world: int, heads: int, steps: int, seed: int, priced: bool = True, layout: str = "auto"
) -> dict:
    """Layout ``auto`` planned inside the balancer (communication priced unless ``priced`` is
    False, which lets small groups use sizes that do not divide them): the same exactness (the
    custom-kernel path too, on plans without rings)."""
    from knapformer.plan.cost import LinkModel

    model = WorkloadModel(d_model=heads * 4, num_heads=heads)
    link = LinkModel(intra_bw=3e7, inter_bw=3e7, gpus_per_node=world, units_per_second=1e9) if priced else "free"
    bal = SequenceBalancer(layout, model, link=link)
    seen = {"mixed_rank": False, "idle_rank": False, "partition": [], "sizes": set()}
    for step in range(steps):
        rng = np.random.default_rng(seed + step)
        lens = [
            np.clip(rng.lognormal(3, 1.3, size=int(rng.integers(0, 5))), 1, 400).astype(int).tolist()
            for _ in range(world)
        ]
        lens[0] += [300 + 20 * step]  # one long sequence every step
        plan = bal.plan(lens[rank])
        seen["partition"].append(plan.is_partition)
        seen["sizes"] |= set(plan.group_sizes().tolist())
        seen.setdefault("rings", set()).update(r for r in plan.rings if r > 1)
        _check_step(bal, plan, rank, heads, heads, seed + step, seen)
    return seen


def loop_kernel(args, causal: bool) -> torch.Tensor:
    """A user's kernel written from the contract alone: SDPA per segment with an explicit
    bottom-right causal mask, and a *fresh* empty tensor when the rank has no query (it uses
    neither q nor k then: the balancer must still run every backward exchange)."""
    outs = []
    for i in range(len(args.cu_seqlens_q) - 1):
        (qa, qb), (ka, kb) = args.cu_seqlens_q[i : i + 2].tolist(), args.cu_seqlens_k[i : i + 2].tolist()
        q, k, v = (t.transpose(0, 1) for t in (args.q[qa:qb], args.k[ka:kb], args.v[ka:kb]))
        rep = q.shape[0] // k.shape[0]
        k, v = k.repeat_interleave(rep, dim=0), v.repeat_interleave(rep, dim=0)
        mask = None
        if causal:
            mask = torch.ones(qb - qa, kb - ka, dtype=torch.bool).tril(diagonal=(kb - ka) - (qb - qa))
        outs.append(torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(0, 1))
    if not outs:
        return torch.zeros(0, args.q.shape[1], args.v.shape[2], dtype=args.q.dtype)
    return torch.cat(outs)


def custom_attention(bal, causal: bool, kernel: str = "reference"):
    """Attention through the custom-kernel path, the kernel being the contract's reference
    (:func:`knapformer.attention.varlen_attention_qk`, separate query and key bounds),
    :func:`loop_kernel` (``kernel="loop"``) or flash-attn's ``flash_attn_varlen_func`` on the
    rule-checking stand-in, called on exactly what ``pre_attn`` returned, empty ranks
    included (``kernel="flash_rules"``)."""
    from knapformer.attention import varlen_attention_qk
    from knapformer.testing.flash_rules import fake_flash_attn

    def attend(q, k, v):
        args = bal.pre_attn(q, k, v, causal=causal)
        if kernel == "reference":
            o = varlen_attention_qk(*args, causal=causal)
        elif kernel == "flash_rules":
            o = fake_flash_attn.flash_attn_varlen_func(*args, causal=causal)
        else:
            o = loop_kernel(args, causal)
        return bal.post_attn(o)

    return attend


EXACT = {"dtype": torch.float64, "tol": 1e-10, "grad_tol": 1e-10, "kernel": "reference", "dv_same": False}
FLASH_RULES = {"dtype": torch.float32, "tol": 2e-5, "grad_tol": 2e-4, "kernel": "flash_rules", "dv_same": True}
"""How a step is checked: in float64 against one process (the math), or through the
``flash2_rules`` backend in float32 (flash-attn's argument rules: Dv = D, fp32 standing for
the cast) against the float64 reference of the same float32 values."""


def _check_step(
    bal, plan, rank, heads, kv_heads, seed, seen, custom_kernel: bool = True, dv_extra: int = 2, mode=EXACT
) -> None:
    D = 4
    DV = D if mode["dv_same"] else D + dv_extra  # value head dim (Dv == D takes fused kernels where they need it)
    dt, tol, gtol = mode["dtype"], mode["tol"], mode["grad_tol"]
    step = seed
    lens = [n for r in plan.seq_lens for n in r]
    total, mine = sum(lens), _mine(plan, rank)
    g = torch.Generator().manual_seed(seed + step)
    # -- round trips, every dtype in one call
    xs = (
        torch.randn(total, 3, generator=g)[mine],
        torch.randn(total, 2, 2, generator=g).to(torch.bfloat16)[mine],
        torch.randint(-(2**62), 2**62, (total,), generator=g)[mine],
        (torch.randn(total, generator=g) > 0)[mine],
    )
    back = bal.reverse_route(*bal.route(*xs))
    for a, b in zip(back, xs):
        assert a.dtype == b.dtype and torch.equal(a, b), "reverse_route(route(x)) != x"
    # -- attention
    q, k, v = (
        torch.randn(total, h, d, generator=g, dtype=torch.float64).to(dt).double()  # values the dtype holds
        for h, d in ((heads, D), (kv_heads, D), (kv_heads, DV))
    )
    for causal in (False, True):
        ref = reference_attention(q, k, v, lens, causal=causal)[mine]
        out = bal.reverse_route(bal.attention(*bal.route(*(t[mine].to(dt) for t in (q, k, v))), causal=causal)).double()
        _close(out, ref, f"step {step} attention causal={causal}", tol)
    # -- the custom-kernel path: pre_attn -> one varlen call -> post_attn (ring plans: K/V all-gathered)
    if custom_kernel:
        for causal in (False, True):
            attend = custom_attention(bal, causal, kernel=mode["kernel"])
            out = bal.reverse_route(attend(*bal.route(*(t[mine].to(dt) for t in (q, k, v))))).double()
            ref = reference_attention(q, k, v, lens, causal=causal)[mine]
            _close(out, ref, f"step {step} pre_attn/post_attn causal={causal}", tol)
    # -- gradients through qkv projection, attention, output projection
    F = 6
    x = torch.randn(total, F, generator=g, dtype=torch.float64).to(dt)
    wq = torch.randn(F, heads * D, generator=g, dtype=torch.float64).to(dt)
    wk = torch.randn(F, kv_heads * D, generator=g, dtype=torch.float64).to(dt)
    wv = torch.randn(F, kv_heads * DV, generator=g, dtype=torch.float64).to(dt)
    wo = torch.randn(heads * DV, F, generator=g, dtype=torch.float64).to(dt)
    target = torch.randn(total, F, generator=g, dtype=torch.float64).to(dt)

    def layer(xs, ws, attend):
        n = xs.shape[0]
        qq = (xs @ ws[0]).view(n, heads, D)
        kk = (xs @ ws[1]).view(n, kv_heads, D)
        vv = (xs @ ws[2]).view(n, kv_heads, DV)
        return attend(qq, kk, vv).reshape(n, heads * DV) @ ws[3]

    ref_x = x.to(torch.float64, copy=True).requires_grad_()
    ref_w = [w.to(torch.float64, copy=True).requires_grad_() for w in (wq, wk, wv, wo)]
    out_r = layer(ref_x, ref_w, lambda a, b, c, lens=lens: reference_attention(a, b, c, lens, causal=True))
    (out_r * target.double()).sum().backward()
    paths = [("attention", lambda a, b, c: bal.attention(a, b, c, causal=True))]
    if custom_kernel:
        paths.append(("pre_attn", custom_attention(bal, True, kernel="loop" if mode is EXACT else mode["kernel"])))
    for path, attend in paths:
        bx = x[mine].clone().requires_grad_()
        bw = [w.clone().requires_grad_() for w in (wq, wk, wv, wo)]
        out_b = bal.reverse_route(layer(bal.route(bx), bw, attend))
        _close(out_b.double(), out_r.detach()[mine], f"step {step} {path} layer forward", tol)
        (out_b * target[mine]).sum().backward()
        _close(bx.grad.double(), ref_x.grad[mine], f"step {step} {path} grad x", gtol)
        for name, w, r in zip(("wq", "wk", "wv", "wo"), bw, ref_w):
            grad = w.grad.clone()
            torch.distributed.all_reduce(grad, group=bal.group)
            _close(grad.double(), r.grad, f"step {step} {path} grad {name}", gtol)
    _check_cross(bal, plan, rank, heads, kv_heads, g, mode)
    spec = bal.spec
    degrees = {e.degree for e in spec.entries}
    seen["mixed_rank"] |= 1 in degrees and len(degrees) >= 2
    seen["idle_rank"] |= spec.num_routed == 0


def _check_cross(bal, plan, rank, heads, kv_heads, g, mode=EXACT) -> None:
    """Cross-attention over per-sequence contexts (some empty) routed once with route_context:
    each rank receives exactly its sequences' contexts; outputs and gradients (of the routed
    tokens, the contexts and the projections) equal one process."""
    D, F, Fc = 4, 5, 3
    DV = D if mode["dv_same"] else 2
    dt, tol, gtol = mode["dtype"], mode["tol"], mode["grad_tol"]
    lens = [n for r in plan.seq_lens for n in r]
    ctx_lens = [int(v) for v in torch.randint(0, 6, (len(lens),), generator=g)]
    if ctx_lens:
        ctx_lens[0] = 0  # a sequence with no context
    total, mine = sum(lens), _mine(plan, rank)
    first, count = int(plan.index.first[rank]), len(plan.seq_lens[rank])
    c_start = sum(ctx_lens[:first])
    c_mine = slice(c_start, c_start + sum(ctx_lens[first : first + count]))
    x = torch.randn(total, F, generator=g, dtype=torch.float64).to(dt)
    ctx = torch.randn(sum(ctx_lens), Fc, generator=g, dtype=torch.float64).to(dt)
    wq = torch.randn(F, heads * D, generator=g, dtype=torch.float64).to(dt)
    wk = torch.randn(Fc, kv_heads * D, generator=g, dtype=torch.float64).to(dt)
    wv = torch.randn(Fc, kv_heads * DV, generator=g, dtype=torch.float64).to(dt)
    target = torch.randn(total, heads, DV, generator=g, dtype=torch.float64).to(dt)

    def project(xs, cs, ws):
        return (xs @ ws[0]).view(-1, heads, D), (cs @ ws[1]).view(-1, kv_heads, D), (cs @ ws[2]).view(-1, kv_heads, DV)

    rx, rc = (t.to(torch.float64, copy=True).requires_grad_() for t in (x, ctx))
    rw = [w.to(torch.float64, copy=True).requires_grad_() for w in (wq, wk, wv)]
    ref = reference_cross_attention(*project(rx, rc, rw), lens, ctx_lens)
    (ref * target.double()).sum().backward()
    bx, bc = x[mine].clone().requires_grad_(), ctx[c_mine].clone().requires_grad_()
    bw = [w.clone().requires_grad_() for w in (wq, wk, wv)]
    routed = bal.route_context(bc, ctx_lens[first : first + count])
    seq_id, _ = bal.routed_positions()
    held = sorted(set(seq_id.tolist()))
    assert routed.seq_ids.tolist() == held, "route_context: not exactly the sequences of my routed tokens"
    expect = torch.cat([ctx[sum(ctx_lens[:s]) : sum(ctx_lens[: s + 1])] for s in held]) if held else ctx[:0]
    assert torch.equal(routed.rows.detach(), expect), "route_context: wrong context rows"
    q, k, v = project(bal.route(bx), routed.rows, bw)
    out = bal.reverse_route(bal.cross_attention(q, k, v, routed))
    _close(out.double(), ref.detach()[mine], "cross-attention forward", tol)
    (out * target[mine]).sum().backward()
    _close(bx.grad.double(), rx.grad[mine], "cross-attention grad x", gtol)
    _close(bc.grad.double(), rc.grad[c_mine], "cross-attention grad context", gtol)
    for name, w, r in zip(("wq", "wk", "wv"), bw, rw):
        grad = w.grad.clone()
        torch.distributed.all_reduce(grad, group=bal.group)
        _close(grad.double(), r.grad, f"cross-attention grad {name}", gtol)


def check_bad_group_plans(rank: int, world: int) -> list[str]:
    """Plans the executor cannot run raise the same clear error on every rank."""
    import dataclasses

    bal = SequenceBalancer(f"g1n{world}", MODEL)
    lens = [[10, 4]] + [[6]] * (world - 1)
    n = sum(map(len, lens))
    msgs = []

    def expect(fn, text, kind=BalancerInputError):
        try:
            fn()
        except kind as exc:
            assert text in str(exc), (text, str(exc))
            msgs.append(str(exc))
            return
        raise AssertionError(f"expected an error containing {text!r}")

    good = plan_from_groups(lens, [(0, 1), (1,)], [0] + [1] * (n - 1), MODEL)
    repeated = dataclasses.replace(good, groups=((0, 0),) + good.groups[1:])
    expect(lambda: bal.use_plan(repeated), "repeats a rank")
    ch = good.chunks.copy()
    ch[0, 4] = world - 1 if world > 2 else 1  # the first chunk of sequence (0,0) on a non-member...
    if world == 2:
        ch[0, 4], ch[1, 4] = 1, 0  # ... or its chunks out of group order
        expect(lambda: bal.use_plan(dataclasses.replace(good, chunks=ch)), "not in group order")
    else:
        expect(lambda: bal.use_plan(dataclasses.replace(good, chunks=ch)), "not a member of its group")
    # degree 3 with 4 heads; a group of 2 sharing 3 kv heads
    three = plan_from_groups([[30]] + [[]] * (world - 1), [tuple(range(min(3, world)))], [0], MODEL)
    bal.use_plan(three)
    y = bal.route(torch.zeros(30 if rank == 0 else 0, 1))
    if world >= 3:
        q = torch.zeros(y.shape[0], 4, 2)
        expect(
            lambda: bal.attention(q, q, q),
            "group (0, 1, 2) of 3 ranks cannot split 4 attention heads",
            InvalidPlanError,
        )
    two = plan_from_groups([[30]] + [[]] * (world - 1), [(0, 1)], [0], MODEL)
    bal.use_plan(two)
    # another route signature: another kind of step (one that routes (·, 1) ran without attention)
    y = bal.route(torch.zeros(30 if rank == 0 else 0, 2))
    q, kv = torch.zeros(y.shape[0], 6, 2), torch.zeros(y.shape[0], 3, 2)
    expect(lambda: bal.attention(q, kv, kv), "group (0, 1) of 2 ranks cannot share 3 kv heads (h=6)", InvalidPlanError)
    return msgs


def check_auto_custom_kernel(rank: int, world: int, configs, steps: int, seed: int) -> list[dict]:
    """A model that runs its own kernel (pre_attn -> one varlen call -> post_attn) under
    ``SequenceBalancer("auto", ...)`` with the default ``attn_path="auto"``, per (h, h_kv,
    causal, priced) of ``configs``: long-tailed lengths, the plans rings where the heads do not split;
    the layer's output and gradients equal one process (fp64) every step; ``priced``: a link
    model prices the exchanges (short sequences then stay whole beside the rings). Returns per
    config the rings and sizes seen and whether each step's plan priced the all-gather."""
    from knapformer.plan.cost import LinkModel

    out = []
    for c, (heads, kv_heads, causal, priced) in enumerate(configs):
        model = WorkloadModel(d_model=heads * 4, num_heads=heads, num_kv_heads=kv_heads, causal=causal)
        # 8-byte (fp64) values from the first step on: the balancer prices the dtype it exchanges
        link = "free"
        if priced:
            link = LinkModel(intra_bw=1.2e8, inter_bw=1.2e8, gpus_per_node=world, units_per_second=1e9)
        bal = SequenceBalancer("auto", model, link=link)
        seen = {"rings": set(), "kv_gather": [], "sizes": set()}
        for step in range(steps):
            rng = np.random.default_rng(seed + 97 * c + step)
            lens = [
                np.clip(rng.lognormal(2.5, 1.4, size=int(rng.integers(0, 5))), 1, 300).astype(int).tolist()
                for _ in range(world)
            ]
            lens[step % world] += [200 + 37 * step]  # a long one, on another rank each step
            plan = bal.plan(lens[rank])
            seen["rings"] |= {r for r in plan.rings if r > 1}
            seen["sizes"] |= set(plan.group_sizes().tolist())
            seen["kv_gather"].append(plan.kv_gather)
            _custom_layer_step(bal, plan, rank, heads, kv_heads, causal, seed + 7 * step + c)
        seen["rings"], seen["sizes"] = sorted(seen["rings"]), sorted(seen["sizes"])
        out.append(seen)
    return out


def _custom_layer_step(bal, plan, rank, heads, kv_heads, causal, seed) -> None:
    """qkv projection -> pre_attn/kernel/post_attn -> output projection: forward and every
    gradient against one process."""
    D, DV, F = 4, 6, 5
    lens = [n for r in plan.seq_lens for n in r]
    total, mine = sum(lens), _mine(plan, rank)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(total, F, generator=g, dtype=torch.float64)
    ws = [
        torch.randn(F, heads * D, generator=g, dtype=torch.float64),
        torch.randn(F, kv_heads * D, generator=g, dtype=torch.float64),
        torch.randn(F, kv_heads * DV, generator=g, dtype=torch.float64),
        torch.randn(heads * DV, F, generator=g, dtype=torch.float64),
    ]
    target = torch.randn(total, F, generator=g, dtype=torch.float64)

    def layer(xs, w, attend):
        n = xs.shape[0]
        q, k, v = (xs @ w[0]).view(n, heads, D), (xs @ w[1]).view(n, kv_heads, D), (xs @ w[2]).view(n, kv_heads, DV)
        return attend(q, k, v).reshape(n, heads * DV) @ w[3]

    rx, rw = x.clone().requires_grad_(), [w.clone().requires_grad_() for w in ws]
    ref = layer(rx, rw, lambda a, b, c: reference_attention(a, b, c, lens, causal=causal))
    (ref * target).sum().backward()
    bx, bw = x[mine].clone().requires_grad_(), [w.clone().requires_grad_() for w in ws]
    out = bal.reverse_route(layer(bal.route(bx), bw, custom_attention(bal, causal)))
    _close(out, ref.detach()[mine], f"pre_attn h{heads}/kv{kv_heads} causal={causal} forward", 1e-10)
    (out * target[mine]).sum().backward()
    _close(bx.grad, rx.grad[mine], "pre_attn grad x", 1e-10)
    for name, w, r in zip(("wq", "wk", "wv", "wo"), bw, rw):
        grad = w.grad.clone()
        torch.distributed.all_reduce(grad, group=bal.group)
        _close(grad, r.grad, f"pre_attn h{heads}/kv{kv_heads} causal={causal} grad {name}", 1e-10)


def check_flash_rules(rank: int, world: int, seed: int) -> dict:
    """The group, GQA/MQA, ring and empty-rank suites through the ``flash2_rules`` backend
    (flash-attn's argument rules, fp32 standing for the cast): overlapping random group
    plans, random ring plans, and ``auto`` plans with empty ranks; custom kernels are called
    as flash-attn on exactly what ``pre_attn`` returns."""
    from tests import ring_workers as R

    seen = {"mixed_rank": False, "idle_rank": False, "rings": 0}
    bal = SequenceBalancer(f"g1n{world}", MODEL, attn_backend="flash2_rules")
    for step, (heads, kv_heads) in enumerate(((4, 4), (4, 2), (4, 1))):
        plan = random_group_plan(world, seed + step, (1, 2, world))
        bal.use_plan(plan)
        _check_step(bal, plan, rank, heads, kv_heads, seed + step, seen, mode=FLASH_RULES)
    for step, (h, h_kv, sizes) in enumerate(((2, 1, (world,)), (4, 2, (2, world)))):
        plan = R.random_ring_plan(world, seed + 10 + step, sizes, h, h_kv)
        bal.use_plan(plan)
        _check_step(bal, plan, rank, h, h_kv, seed + 10 + step, seen, mode=FLASH_RULES)
        seen["rings"] += bal.spec.ring_rounds > 1
    lens = [[20, 9], [7], *[[3] for _ in range(2, world)]][:world]  # every sequence on rank 0: the others idle
    idle = plan_from_groups(lens, [(0,)], [0] * sum(map(len, lens)), MODEL)
    bal.use_plan(idle)
    _check_step(bal, idle, rank, 4, 2, seed + 30, seen, mode=FLASH_RULES)
    model = WorkloadModel(d_model=16, num_heads=4)
    auto = SequenceBalancer("auto", model, attn_backend="flash2_rules")
    for step in range(2):
        lens = [[300 + step, 7], [], *[[5 + r] for r in range(2, world)]][:world]  # rank 1 holds nothing
        plan = auto.plan(lens[rank])
        _check_step(auto, plan, rank, 4, 2, seed + 20 + step, seen, mode=FLASH_RULES)
    return seen
