"""``sdpa_mask``: one SDPA call with a block-diagonal (and causal) boolean mask.

Kept as a reference and for tiny batches of many sequences; never chosen by ``auto`` (the
mask's masked blocks cost as much as the useful ones). Cross-attention falls back to ``sdpa``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from knapformer.attention.backend import Backend, check_gqa, empty_output
from knapformer.attention.bounds import host_bounds

__all__ = ["BACKEND", "sdpa_block_diagonal"]


def sdpa_block_diagonal(q, k, v, cu_seqlens, max_len, *, causal):
    """(N, h, D) -> (N, h, Dv): one SDPA call with a block-diagonal (and causal) mask."""
    gqa = check_gqa(q, k, v)
    N = q.shape[0]
    if N == 0:
        return empty_output(q, k, v)
    cu = host_bounds(cu_seqlens)
    lens = [e - s for s, e in zip(cu[:-1], cu[1:])]
    if sum(lens) != N:
        raise ValueError(f"cu_seqlens covers {sum(lens)} tokens but q has {N}")
    counts = torch.diff(cu_seqlens.long())
    seg = torch.repeat_interleave(torch.arange(len(lens), device=q.device), counts, output_size=N)
    mask = seg[:, None] == seg[None, :]
    if causal:
        mask &= torch.ones(N, N, dtype=torch.bool, device=q.device).tril()
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        enable_gqa=gqa,
    )
    return out[0].transpose(0, 1)


BACKEND = Backend(name="sdpa_mask", attend=sdpa_block_diagonal)
