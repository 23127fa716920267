"""Single-process references for the distributed tests: the same math, no balancing."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["reference_attention"]


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
