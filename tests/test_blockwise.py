"""Block attention with log-sum-exp (what ring attention merges) equals whole-sequence attention:
outputs merged over blocks in any order and the block backward's gradients, fp64, causal or not,
GQA/MQA, zigzag blocks, 1-token blocks."""

import pytest
import torch

from knapformer.attention import blockwise as B
from knapformer.attention.lse import KERNELS
from knapformer.testing import reference_attention


def _blocks(L: int, pieces: list[list[tuple[int, int]]]):
    """Per block: the token positions of its pieces."""
    return [torch.cat([torch.arange(a, b) for a, b in block]) for block in pieces]


CASES = {
    "contiguous 3": (10, [[(0, 4)], [(4, 7)], [(7, 10)]]),
    "zigzag 2": (12, [[(0, 3), (9, 12)], [(3, 9)]]),
    "one-token blocks": (3, [[(0, 1)], [(1, 2)], [(2, 3)]]),
    "uneven 2": (7, [[(0, 1)], [(1, 7)]]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)])
def test_blocks_merged_and_their_backward_equal_whole_attention(case, causal, heads, monkeypatch):
    monkeypatch.setattr(B, "TILE", 2)  # several query tiles per block
    L, pieces = CASES[case]
    h, h_kv = heads
    g = torch.Generator().manual_seed(0)
    q = torch.randn(L, h, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(L, h_kv, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(L, h_kv, 6, generator=g, dtype=torch.float64, requires_grad=True)
    ref = reference_attention(q, k, v, [L], causal=causal)
    do = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    dq_ref, dk_ref, dv_ref = torch.autograd.grad(ref, (q, k, v), do)
    pos = _blocks(L, pieces)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for qp in pos:
        o = torch.zeros(len(qp), h, 6, dtype=torch.float64)
        lse = torch.full((h, len(qp)), float("-inf"), dtype=torch.float64)
        for kp in reversed(pos):  # any order
            ob, lb = B.block_forward(q.detach()[qp], k.detach()[kp], v.detach()[kp], qp, kp, causal=causal)
            o, lse = B.merge(o, lse, ob, lb)
        assert torch.allclose(o, ref.detach()[qp], atol=1e-12, rtol=0)
        delta = (do[qp] * o).sum(-1).transpose(0, 1)
        for kp in pos:
            a, b, c = B.block_backward(
                q.detach()[qp], k.detach()[kp], v.detach()[kp], do[qp], lse, delta, qp, kp, causal=causal
            )
            dq[qp] += a
            dk[kp] += b
            dv[kp] += c
    for got, want in ((dq, dq_ref), (dk, dk_ref), (dv, dv_ref)):
        assert torch.allclose(got, want, atol=1e-12, rtol=0)


@pytest.mark.parametrize("kernel", ["cpu_flash", "tiled"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_cpu_block_kernels_equal_the_general_block_math(kernel, heads, causal):
    """Blocks whose positions start at 0 (what ring attention pairs: the diagonal causally,
    other blocks whole): PyTorch's fused CPU kernel and the tiled kernel give the general
    positions-masked math's output, lse and gradients, fp64."""
    h, h_kv = heads
    g = torch.Generator().manual_seed(1)
    n = m = 9 if causal else 7
    q = torch.randn(n, h, 8, generator=g, dtype=torch.float64)
    k = torch.randn(m, h_kv, 8, generator=g, dtype=torch.float64)
    v = torch.randn(m, h_kv, 8, generator=g, dtype=torch.float64)
    pq, pk = torch.arange(n), torch.arange(m)
    K = KERNELS[kernel]
    o, lse = K.forward(q, k, v, causal)
    o_ref, lse_ref = B.block_forward(q, k, v, pq, pk, causal=causal)
    assert torch.allclose(o, o_ref, atol=1e-12) and torch.allclose(lse, lse_ref, atol=1e-12)
    do = torch.randn(o.shape, generator=g, dtype=torch.float64)
    delta = (do * o).sum(-1).transpose(0, 1)
    got = K.backward(do, q, k, v, o, lse, causal)
    want = B.block_backward(q, k, v, do, lse, delta, pq, pk, causal=causal)
    for a, b in zip(got, want):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-12)


def test_fused_cpu_blocks_in_bf16_stay_close():
    """bf16 blocks: outputs and lse in fp32, within bf16 rounding of the fp64 result."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(16, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
    o, lse = KERNELS["cpu_flash"].forward(q.bfloat16(), k.bfloat16(), v.bfloat16(), False)
    o_ref, lse_ref = KERNELS["tiled"].forward(q, k, v, False)
    assert o.dtype == lse.dtype == torch.float32
    assert (o.double() - o_ref).abs().max() < 3e-2 and (lse.double() - lse_ref).abs().max() < 3e-2
