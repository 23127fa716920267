"""Conformance: every available varlen attention backend equals the per-sequence reference."""

import pytest
import torch

from knapformer.attention import BACKENDS, available_backends, varlen_attention
from knapformer.testing import reference_attention

LENS = [1, 7, 0, 33, 2, 64]  # an empty sequence too


@pytest.mark.parametrize("name", sorted(BACKENDS))
@pytest.mark.parametrize("causal", [False, True])
def test_backend_matches_reference(name, causal):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    reason = available_backends(device)[name]
    if reason:
        pytest.skip(reason)
    # flash-attn: bf16; its CPU stand-in (flash2_rules, flash-attn's argument rules): fp32 as the cast
    dtype = {"flash": torch.bfloat16, "flash2_rules": torch.float32}.get(name, torch.float64)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(LENS), 4, 16, generator=g, dtype=torch.float64) for _ in range(3))
    q, k, v = (t.to(device, dtype).requires_grad_() for t in (q, k, v))
    cu = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32, device=device)
    out = varlen_attention(q, k, v, cu, max(LENS), causal=causal, backend=name)
    ref = reference_attention(q, k, v, LENS, causal=causal)
    tol = {torch.bfloat16: 2e-2, torch.float32: 2e-6}.get(dtype, 1e-10)
    assert (out - ref).abs().max().item() < tol
    w = torch.randn(out.shape, generator=g, dtype=torch.float64).to(device, dtype)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    grads_ref = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for got, want in zip(grads, grads_ref):
        assert (got - want).abs().max().item() < tol * 10


def test_empty_input_keeps_the_graph():
    q = torch.zeros(0, 2, 4, requires_grad=True)
    cu = torch.zeros(1, dtype=torch.int32)
    out = varlen_attention(q, q, q, cu, 0)
    assert out.shape == (0, 2, 4) and out.requires_grad


def test_unknown_backend():
    q = torch.zeros(1, 1, 2)
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        varlen_attention(q, q, q, torch.tensor([0, 1]), 1, backend="nope")


def test_cu_seqlens_must_cover_every_token():
    q = torch.zeros(5, 1, 2)
    with pytest.raises(ValueError, match="covers 4 tokens but q has 5"):
        varlen_attention(q, q, q, torch.tensor([0, 1, 4]), 3, backend="sdpa")


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_cross_attention_matches_reference(kv_heads):
    """Queries of sequence i attend only to context i (q lengths != kv lengths), GQA/MQA, a
    sequence with no queries and one with an empty context (zeros); gradients too."""
    from knapformer.attention import varlen_cross_attention
    from knapformer.testing import reference_cross_attention

    g = torch.Generator().manual_seed(0)
    q_lens, kv_lens = [5, 0, 3, 7], [4, 6, 0, 9]
    q = torch.randn(sum(q_lens), 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(sum(kv_lens), kv_heads, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(sum(kv_lens), kv_heads, 6, generator=g, dtype=torch.float64, requires_grad=True)

    def cu(lens):
        return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)

    out = varlen_cross_attention(q, k, v, cu(q_lens), cu(kv_lens), backend="sdpa")
    ref = reference_cross_attention(q, k, v, q_lens, kv_lens)
    assert torch.allclose(out, ref, atol=1e-12)
    assert torch.equal(out[5:8], torch.zeros(3, 4, 6, dtype=torch.float64))  # empty context -> zeros
    w = torch.randn_like(out)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    assert all(torch.allclose(a, b, atol=1e-12) for a, b in zip(grads, ref_grads))


def test_cross_attention_bad_bounds():
    from knapformer.attention import varlen_cross_attention

    q, k = torch.randn(4, 2, 8), torch.randn(3, 2, 8)
    with pytest.raises(ValueError, match="same number of sequences"):
        varlen_cross_attention(q, k, k, torch.tensor([0, 4]), torch.tensor([0, 1, 3]))
    with pytest.raises(ValueError, match="covers 3 queries"):
        varlen_cross_attention(q, k, k, torch.tensor([0, 3]), torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        varlen_cross_attention(q, k, k, torch.tensor([0, 4]), torch.tensor([0, 3]), backend="nope")


def test_a_backend_without_cross_attention_uses_sdpas():
    """``sdpa_mask`` has no cross-attention kernel of its own: it gets SDPA's per-sequence form
    (so a balancer configured with it still runs Wan's cross-attention)."""
    from knapformer.attention import get_backend, varlen_cross_attention

    assert get_backend("sdpa_mask").cross is None
    q, k = torch.randn(4, 2, 8, dtype=torch.float64), torch.randn(3, 2, 8, dtype=torch.float64)
    cu_q, cu_k = torch.tensor([0, 1, 4]), torch.tensor([0, 2, 3])
    want = varlen_cross_attention(q, k, k, cu_q, cu_k, backend="sdpa")
    assert torch.equal(varlen_cross_attention(q, k, k, cu_q, cu_k, backend="sdpa_mask"), want)


def test_cross_attention_keeps_empty_contexts_in_the_graph():
    """Every query's context empty: the output is zeros but k/v still get (zero) gradients, so a
    rank whose k/v came from a collective joins its backward."""
    from knapformer.attention import varlen_cross_attention

    q = torch.randn(3, 2, 4, requires_grad=True)
    k = torch.randn(0, 2, 4, requires_grad=True)
    out = varlen_cross_attention(q, k, k, torch.tensor([0, 3]), torch.tensor([0, 0]))
    out.sum().backward()
    assert k.grad is not None and torch.equal(out, torch.zeros(3, 2, 4))
