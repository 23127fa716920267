"""Single-process references for the distributed tests: the same math, no balancing."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["reference_attention", "reference_cross_attention"]


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: list[int], *, causal: bool = False
) -> torch.Tensor:
    """(N, h, D) packed sequences -> attention within each sequence, one SDPA per sequence.
    k/v may have fewer heads (GQA): each kv head is repeated for its h/h_kv query heads."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    outs, start = [], 0
    for n in seq_lens:
        sl = slice(start, start + n)
        o = F.scaled_dot_product_attention(
            q[sl].transpose(0, 1), k[sl].transpose(0, 1), v[sl].transpose(0, 1), is_causal=causal
        )
        outs.append(o.transpose(0, 1))
        start += n
    return torch.cat(outs) if outs else q.new_zeros((q.shape[0], q.shape[1], v.shape[2]))


def reference_cross_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_lens: list[int], kv_lens: list[int]
) -> torch.Tensor:
    """Queries of packed sequence i (q_lens) attend to context i (kv_lens rows of k/v), with an
    explicit softmax (independent of SDPA); an empty context contributes zeros."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    outs, qs, ks = [], 0, 0
    for n, m in zip(q_lens, kv_lens):
        qi, ki, vi = q[qs : qs + n], k[ks : ks + m], v[ks : ks + m]
        if m == 0:
            outs.append(q.new_zeros((n, q.shape[1], v.shape[2])))
        else:
            scores = torch.einsum("qhd,khd->hqk", qi, ki) / q.shape[2] ** 0.5
            outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vi))
        qs, ks = qs + n, ks + m
    return torch.cat(outs) if outs else q.new_zeros((q.shape[0], q.shape[1], v.shape[2]))
