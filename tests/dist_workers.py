"""Worker functions for the multi-rank tests (module level so spawned ranks can import them).

Each worker builds the same global data on every rank from a seed, runs the balanced
computation on its own share, and compares with the single-process computation of the same
math. Failures raise inside the rank; ``run_distributed`` re-raises them in the test.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from knapformer import SequenceBalancer, WorkloadModel
from knapformer.distributed import BalancerInputError
from knapformer.testing import reference_attention

HEADS, HEAD_DIM, FEAT = 4, 8, 16


def random_lens(seed: int, world: int) -> list[list[int]]:
    """Lengths with empty ranks, 1-token sequences and long ones."""
    rng = np.random.default_rng(seed)
    lens = []
    for r in range(world):
        n = int(rng.integers(0, 4)) if r != 1 else 0  # rank 1 always empty
        lens.append([int(rng.choice([1, 2, 3, int(rng.integers(4, 90))])) for _ in range(n)])
    # rank 0 is overloaded with interleaved long and short sequences (incl. a 1-token one), so
    # the plan sends them to several ranks in an order that differs from the local order
    lens[0] = lens[0] + [1, 200, 5, 60, 3, 90, 7, 150]
    return lens


def local_slice(lens: list[list[int]], rank: int) -> slice:
    start = sum(sum(r) for r in lens[:rank])
    return slice(start, start + sum(lens[rank]))


def _close(a: torch.Tensor, b: torch.Tensor, what: str, tol: float = 1e-5) -> None:
    err = (a - b).abs().max().item() if a.numel() else 0.0
    assert err <= tol * max(1.0, b.abs().max().item() if b.numel() else 1.0), f"{what}: max error {err:.3e}"


def check_exactness(rank: int, world: int, layout: str, seed: int) -> dict:
    """Round trips for every dtype, routed positions, attention (causal or not) and gradients."""
    lens = random_lens(seed, world)
    torch.manual_seed(seed)
    total = sum(map(sum, lens))
    mine = local_slice(lens, rank)
    bal = SequenceBalancer(layout, WorkloadModel(d_model=HEADS * HEAD_DIM), debug=True)
    group_rank, S = bal.group_rank, bal.layout.group_size
    replica = rank // S
    # each replica balances its own lengths: the layout's group is the replica
    lens_g = random_lens(seed + replica, S)
    lens = lens_g
    total = sum(map(sum, lens))
    mine = local_slice(lens, group_rank)
    plan = bal.plan(lens[group_rank])
    assert plan.seq_lens == tuple(tuple(r) for r in lens)

    # -- round trips, one call with several dtypes, dtypes kept
    gen = torch.Generator().manual_seed(seed)
    x32 = torch.randn(total, FEAT, generator=gen)[mine]
    xbf = torch.randn(total, 3, 2, generator=gen).to(torch.bfloat16)[mine]
    xi = torch.randint(-(2**62), 2**62, (total, 2), generator=gen)[mine]
    xb = (torch.randn(total, generator=gen) > 0)[mine]
    y32, ybf, yi, yb = bal.route(x32, xbf, xi, xb)
    assert (y32.dtype, ybf.dtype, yi.dtype, yb.dtype) == (torch.float32, torch.bfloat16, torch.int64, torch.bool)
    back = bal.reverse_route(y32, ybf, yi, yb)
    for a, b in zip(back, (x32, xbf, xi, xb)):
        assert a.dtype == b.dtype and torch.equal(a, b), "reverse_route(route(x)) != x"
    assert torch.equal(bal.reverse_route(bal.route(xbf)), xbf)

    # -- routed tokens are the planned (sequence, position) tokens
    seq_id, pos = bal.routed_positions()
    offsets = torch.tensor([0] + list(np.cumsum([v for r in lens for v in r]))[:-1], dtype=torch.int64)
    full = torch.arange(total, dtype=torch.int64)
    routed = bal.route(full[mine])  # every rank routes (an idle rank too: it is a collective)
    if seq_id.numel():
        expected = full[offsets[seq_id] + pos]
        assert torch.equal(routed, expected), "routed token order differs from routed_positions"

    # -- attention equals per-sequence attention, causal and not
    flat_lens = [v for r in lens for v in r]
    q, k, v = (torch.randn(total, HEADS, HEAD_DIM, generator=gen, dtype=torch.float64) for _ in range(3))
    for causal in (False, True):
        ref = reference_attention(q, k, v, flat_lens, causal=causal)[mine]
        rq, rk, rv = bal.route(q[mine], k[mine], v[mine])
        out = bal.reverse_route(bal.attention(rq, rk, rv, causal=causal))
        _close(out, ref, f"attention causal={causal}", 1e-10)

    # -- gradients of tokens -> qkv -> balanced attention -> proj -> reverse -> loss
    w_qkv = torch.randn(FEAT, 3 * HEADS * HEAD_DIM, generator=gen, dtype=torch.float64) / FEAT**0.5
    w_o = torch.randn(HEADS * HEAD_DIM, FEAT, generator=gen, dtype=torch.float64) / 8
    x = torch.randn(total, FEAT, generator=gen, dtype=torch.float64)
    target = torch.randn(total, FEAT, generator=gen, dtype=torch.float64)

    def forward(xs, wq, wo, attend):
        qkv = (xs @ wq).view(xs.shape[0], 3, HEADS, HEAD_DIM)
        o = attend(qkv[:, 0], qkv[:, 1], qkv[:, 2])
        return o.reshape(xs.shape[0], HEADS * HEAD_DIM) @ wo  # also 0 rows (an idle rank)

    # reference: every sequence of the group in one process
    xr, wqr, wor = (t.clone().requires_grad_() for t in (x, w_qkv, w_o))
    out_r = forward(xr, wqr, wor, lambda a, b, c: reference_attention(a, b, c, flat_lens, causal=True))
    (out_r * target).sum().backward()
    # balanced
    xl, wq, wo = x[mine].clone().requires_grad_(), w_qkv.clone().requires_grad_(), w_o.clone().requires_grad_()
    y = bal.route(xl)
    out_b = bal.reverse_route(forward(y, wq, wo, lambda a, b, c: bal.attention(a, b, c, causal=True)))
    _close(out_b, out_r.detach()[mine], "balanced forward")
    (out_b * target[mine]).sum().backward()
    _close(xl.grad, xr.grad[mine], "grad wrt local tokens", 1e-10)
    for g, ref_g, name in ((wq.grad, wqr.grad, "w_qkv"), (wo.grad, wor.grad, "w_o")):
        dist.all_reduce(g, group=bal.group)
        _close(g, ref_g, f"grad {name} (summed over ranks)", 1e-10)
    return {"tokens_moved": plan.tokens_moved, "routed": int(y.shape[0])}


def _expect(fn, exc_type, text: str) -> str:
    try:
        fn()
    except exc_type as exc:
        assert text in str(exc), f"expected {text!r} in {exc!r}"
        return str(exc)
    raise AssertionError(f"expected {exc_type.__name__} containing {text!r}")


def check_robustness(rank: int, world: int) -> list[str]:
    """Each local problem raises a clear error on every rank (no hang)."""
    model = WorkloadModel(d_model=16)
    msgs = []
    bal = SequenceBalancer(f"g1n{world}", model)
    msgs.append(_expect(lambda: bal.route(torch.zeros(3, 2)), RuntimeError, "call plan(local_seq_lens) before"))
    # bad lengths on rank 0 only
    lens = [5, -1] if rank == 0 else [4]
    msgs.append(_expect(lambda: bal.plan(lens), BalancerInputError, "bad local_seq_lens on rank(s) [0]"))
    bal.plan([5, 3] if rank == 0 else [])
    # x of the wrong length on the last rank only
    n = 8 if rank == 0 else 0
    if rank == world - 1:
        n += 1
    msgs.append(_expect(lambda: bal.route(torch.zeros(n, 2)), BalancerInputError, "SequenceBalancer.route"))
    # the balancer still works afterwards (no desynchronised collectives)
    x = torch.arange(8 if rank == 0 else 0, dtype=torch.float32)[:, None]
    assert torch.equal(bal.reverse_route(bal.route(x)), x)
    # heads not divisible by a bag size: raised on every rank from the plan alone
    bal2 = SequenceBalancer(f"g{world}n1", model)
    bal2.plan([3] if rank == 0 else [])
    q = torch.zeros(bal2.spec.num_routed, 3, 4)
    msgs.append(
        _expect(
            lambda: bal2.attention(q, q, q),
            ValueError,
            f"group {tuple(range(world))} of {world} ranks cannot split 3 attention heads evenly",
        )
    )
    # layout that does not tile the world
    msgs.append(
        _expect(lambda: SequenceBalancer(f"g1n{world + 1}", model), ValueError, "is not divisible by the group size")
    )
    # all ranks empty
    bal.plan([])
    z = torch.zeros(0, 4)
    assert bal.reverse_route(bal.route(z)).shape == (0, 4)
    return msgs


def relabel_plan(plan, perm):
    """The same plan with rank r renamed perm[r]: bags become non-contiguous and unordered."""
    import dataclasses

    S = plan.num_ranks
    inv = np.argsort(perm)
    seq_lens = tuple(plan.seq_lens[inv[r]] for r in range(S))
    first_old = np.concatenate([[0], np.cumsum([len(r) for r in plan.seq_lens])])
    first_new = np.concatenate([[0], np.cumsum([len(r) for r in seq_lens])])
    seq_bag = np.empty_like(plan.seq_group)
    for r in range(S):
        n = len(plan.seq_lens[r])
        seq_bag[first_new[perm[r]] : first_new[perm[r]] + n] = plan.seq_group[first_old[r] : first_old[r] + n]
    ch = plan.chunks.copy()
    ch[:, 0], ch[:, 4] = np.asarray(perm)[ch[:, 0]], np.asarray(perm)[ch[:, 4]]
    ch = ch[np.lexsort((ch[:, 2], ch[:, 1], ch[:, 0]))]
    bags = tuple(tuple(int(perm[r]) for r in b) for b in plan.groups)
    return dataclasses.replace(plan, seq_lens=seq_lens, seq_group=seq_bag, chunks=ch, groups=bags)


def check_arbitrary_groups(rank: int, world: int, seed: int) -> dict:
    """Plans whose bags are non-contiguous, unordered and change every step run on the same
    communicator and still equal one-process attention and round-trip bit-exactly."""
    from knapformer.plan import plan_sequences

    lens0 = random_lens(seed, world)
    bal = SequenceBalancer(f"g1n{world}", WorkloadModel(d_model=HEADS * HEAD_DIM), debug=True)
    base = plan_sequences(lens0, "g2n2", WorkloadModel(d_model=HEADS * HEAD_DIM))
    out = {}
    for step, perm in enumerate(([2, 0, 3, 1], [1, 3, 0, 2], [3, 2, 1, 0])):
        plan = relabel_plan(base, perm)
        plan.validate()
        bal.use_plan(plan)
        lens = [list(r) for r in plan.seq_lens]
        total = sum(map(sum, lens))
        mine = local_slice(lens, rank)
        gen = torch.Generator().manual_seed(seed + step)
        x = torch.randn(total, FEAT, generator=gen)[mine]
        assert torch.equal(bal.reverse_route(bal.route(x)), x)
        q, k, v = (torch.randn(total, HEADS, HEAD_DIM, generator=gen, dtype=torch.float64) for _ in range(3))
        ref = reference_attention(q, k, v, [n for r in lens for n in r])[mine]
        o = bal.reverse_route(bal.attention(*bal.route(q[mine], k[mine], v[mine])))
        _close(o, ref, f"attention with bags {plan.groups}", 1e-10)
        out[step] = plan.groups
    return out


def check_pinning(rank: int, world: int) -> dict:
    """pin_to_core: every thread of the rank ends on one core, a different one per rank."""
    import os

    from knapformer.testing import pin_to_core

    core = pin_to_core(rank, world)
    threads = {tid: os.sched_getaffinity(int(tid)) for tid in os.listdir("/proc/self/task")}
    return {"core": core, "threads": [sorted(a) for a in threads.values()]}
