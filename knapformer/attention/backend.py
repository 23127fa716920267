"""What a varlen attention backend is, and the checks every backend shares.

Shapes: q (N, h, D), k (N, h_kv, D), v (N, h_kv, Dv) -> (N, h, Dv), sequences bounded by an
int32 ``cu_seqlens`` (n + 1,). With fewer kv heads (GQA/MQA, ``h % h_kv == 0``) query head i
attends with kv head ``i // (h / h_kv)``. Cross-attention and the split form (``attend_qk``) bound the
queries and the keys separately (``cu_q``, ``cu_k``: the same number of segments).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = ["Backend", "CrossAttention", "VarlenAttention", "check_gqa", "empty_output"]


class VarlenAttention(Protocol):
    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int, *, causal: bool
    ) -> torch.Tensor: ...


class CrossAttention(Protocol):
    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: list[int], cu_k: list[int]
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class Backend:
    """One attention backend (registered by name in :mod:`knapformer.attention.registry`)."""

    name: str
    attend: VarlenAttention
    """Self-attention within each packed sequence (causal or not)."""
    cross: CrossAttention | None = None
    """Queries of sequence i over context i (bounds as lists); None = SDPA's per-sequence form."""
    attend_qk: Callable | None = None
    """``(q, k, v, cu_q, cu_k, *, causal)`` (bounds as lists): segment i's queries over segment
    i's keys, causal aligned to the bottom right — what ``pre_attn`` hands a custom kernel
    (:func:`knapformer.attention.varlen_attention_qk`); None = SDPA's per-segment form."""
    unavailable: Callable[[torch.Tensor], str | None] = lambda q: None
    """Why the backend cannot run on tensors like ``q`` (None: it can)."""
    auto_priority: int | None = None
    """``auto`` picks the usable backend with the highest priority; None = never by ``auto``."""
    block_kernels: tuple[str, ...] = ("cuda_flash", "cuda_efficient", "cpu_flash", "tiled")
    """Ring attention's block kernels (:mod:`knapformer.attention.lse`) in preference order:
    the first that can run (and passes its probe) computes every block."""


def check_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Validate the head counts; True when k/v have fewer heads than q (GQA/MQA)."""
    h, h_kv = q.shape[1], k.shape[1]
    if v.shape[1] != h_kv or h_kv == 0 or h % h_kv:
        raise ValueError(f"q has {h} heads, k {k.shape[1]} and v {v.shape[1]}: k and v need h_kv heads dividing h")
    return h_kv != h


def empty_output(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """(N, h, Dv) zeros still connected to q, k, v (an empty rank's backward must run)."""
    return q.new_zeros((q.shape[0], q.shape[1], v.shape[2])) + 0 * (q.sum() + k.sum() + v.sum())
