"""Varlen attention over packed sequences: ``q, k, v`` (N, h, D) with ``cu_seqlens``.

The entry points every executor calls; the backend is a name from
:mod:`knapformer.attention.registry` (``auto``: the usable backend of highest priority —
flash-attn on CUDA fp16/bf16 when it imports, else ``sdpa``). Shapes as in
:mod:`knapformer.attention.backend`.
"""

from __future__ import annotations

import torch

from knapformer.attention.backend import empty_output
from knapformer.attention.bounds import host_bounds
from knapformer.attention.registry import resolve_backend
from knapformer.attention.sdpa import sdpa_cross, sdpa_qk

__all__ = ["varlen_attention", "varlen_attention_qk", "varlen_cross_attention"]


def varlen_attention(q, k, v, cu_seqlens, max_len: int, *, causal: bool = False, backend: str = "auto") -> torch.Tensor:
    """Attention within each packed sequence with the backend named ``backend`` (or ``auto``).
    No tokens (a rank with nothing to compute): zeros joined to q, k, v's graphs, without a
    kernel call (flash-attn refuses a batch of zero sequences)."""
    if q.shape[0] == 0:
        return empty_output(q, k, v)
    return resolve_backend(backend, q).attend(q, k, v, cu_seqlens, max_len, causal=causal)


def varlen_cross_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Queries of packed sequence i attend to packed context i: q (N, h, D), k (M, h_kv, D),
    v (M, h_kv, Dv) -> (N, h, Dv); ``cu_seqlens_q`` bounds q's sequences, ``cu_seqlens_k`` the
    contexts (same number of sequences). A backend without a cross-attention kernel uses
    ``sdpa``'s (one SDPA per sequence); a sequence with an empty context gets zeros."""
    cu_q, cu_k = host_bounds(cu_seqlens_q), host_bounds(cu_seqlens_k)
    if len(cu_q) != len(cu_k) or not cu_q or cu_q[0] != 0 or cu_k[0] != 0:
        raise ValueError(
            f"cu_seqlens_q ({len(cu_q)} bounds) and cu_seqlens_k ({len(cu_k)}) must both start at 0 "
            "and bound the same number of sequences"
        )
    if cu_q[-1] != q.shape[0] or cu_k[-1] != k.shape[0] or k.shape[0] != v.shape[0]:
        raise ValueError(
            f"cu_seqlens_q covers {cu_q[-1]} queries (q has {q.shape[0]}), cu_seqlens_k {cu_k[-1]} keys "
            f"(k has {k.shape[0]}, v {v.shape[0]})"
        )
    if q.shape[0] == 0:
        return empty_output(q, k, v)
    cross = resolve_backend(backend, q).cross or sdpa_cross
    return cross(q, k, v, cu_q, cu_k)


def varlen_attention_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    *,
    causal: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """The contract of a kernel ``SequenceBalancer.pre_attn`` hands its tensors to, in
    flash-attn's argument order (``varlen_attention_qk(*bal.pre_attn(q, k, v, causal=c),
    causal=c)``): q (N, h, D), k (M, h_kv, D), v (M, h_kv, Dv) -> (N, h, Dv); segment i's
    queries ``q[cu_q[i]:cu_q[i+1]]`` attend to its keys ``k[cu_k[i]:cu_k[i+1]]`` (query head j
    with kv head j // (h / h_kv)); ``causal`` masks aligned to the bottom right: query t of a
    segment of n_q queries over n_k ≥ n_q keys sees keys 0 … n_k − n_q + t (flash-attn ≥ 2.1's
    convention; the ordinary causal mask when n_q = n_k). The max lengths are accepted for
    signature compatibility and not needed here."""
    cu_q, cu_k = host_bounds(cu_seqlens_q), host_bounds(cu_seqlens_k)
    if len(cu_q) != len(cu_k) or not cu_q or cu_q[0] != 0 or cu_k[0] != 0:
        raise ValueError(
            f"cu_seqlens_q ({len(cu_q)} bounds) and cu_seqlens_k ({len(cu_k)}) must both start at 0 "
            "and bound the same number of segments"
        )
    if cu_q[-1] != q.shape[0] or cu_k[-1] != k.shape[0] or k.shape[0] != v.shape[0]:
        raise ValueError(
            f"cu_seqlens_q covers {cu_q[-1]} queries (q has {q.shape[0]}), cu_seqlens_k {cu_k[-1]} keys "
            f"(k has {k.shape[0]}, v {v.shape[0]})"
        )
    if q.shape[0] == 0:  # an empty rank (cu_seqlens [0, 0]): no kernel call
        return empty_output(q, k, v)
    attend = resolve_backend(backend, q).attend_qk or sdpa_qk
    return attend(q, k, v, cu_q, cu_k, causal=causal)
