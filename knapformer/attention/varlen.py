"""Varlen attention over packed sequences: ``q, k, v`` (N, h, D) with ``cu_seqlens``.

Backends share one signature (:class:`VarlenAttention`) and one conformance test:

- ``sdpa``: one ``scaled_dot_product_attention`` call per sequence. Exact, works everywhere,
  and measured fastest on CPU (the block-diagonal mask wastes work on masked blocks).
- ``sdpa_mask``: one SDPA call with a block-diagonal boolean mask (kept as a reference and
  for tiny batches of many sequences).
- ``flash``: flash-attn's ``flash_attn_varlen_func`` — CUDA only, imported on first use.

``auto`` picks ``flash`` for CUDA tensors when flash-attn imports, else ``sdpa``. No CUDA or
flash-attn import happens when this module is imported.

Shapes: q (N, h, D), k (N, h_kv, D), v (N, h_kv, Dv) -> (N, h, Dv). With fewer kv heads
(GQA/MQA, ``h % h_kv == 0``) query head i attends with kv head ``i // (h / h_kv)``.

Cross-attention (:func:`varlen_cross_attention`): the queries of sequence i attend to the
keys/values of context i (its text), so q and k/v have their own ``cu_seqlens``: q (N, h, D),
k (M, h_kv, D), v (M, h_kv, Dv) -> (N, h, Dv). A sequence with an empty context gets zeros
(attention over nothing adds nothing; SDPA would return NaN).
"""

from __future__ import annotations

import functools
from typing import Protocol

import torch
import torch.nn.functional as F

__all__ = [
    "VarlenAttention",
    "BACKENDS",
    "available_backends",
    "flash_available",
    "varlen_attention",
    "varlen_cross_attention",
]


class VarlenAttention(Protocol):
    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int, *, causal: bool
    ) -> torch.Tensor: ...


def _bounds(cu_seqlens: torch.Tensor) -> list[int]:
    return cu_seqlens.tolist()


def _empty_output(q, k, v):
    """(N, h, Dv) zeros still connected to q, k, v (an empty rank's backward must run)."""
    return q.new_zeros((q.shape[0], q.shape[1], v.shape[2])) + 0 * (q.sum() + k.sum() + v.sum())


def _check_gqa(q, k, v) -> bool:
    h, h_kv = q.shape[1], k.shape[1]
    if v.shape[1] != h_kv or h_kv == 0 or h % h_kv:
        raise ValueError(f"q has {h} heads, k {k.shape[1]} and v {v.shape[1]}: k and v need h_kv heads dividing h")
    return h_kv != h


def sdpa_per_sequence(q, k, v, cu_seqlens, max_len, *, causal):
    """(N, h, D) -> (N, h, Dv): one SDPA per sequence."""
    gqa = _check_gqa(q, k, v)
    cu = _bounds(cu_seqlens)
    lens = [e - s for s, e in zip(cu[:-1], cu[1:])]
    if sum(lens) != q.shape[0]:
        raise ValueError(f"cu_seqlens covers {sum(lens)} tokens but q has {q.shape[0]}")
    # torch.split, not per-sequence slicing: a slice's backward zero-fills a full-size gradient
    # and adds it up once per sequence (O(sequences × tokens) memory traffic); split's backward
    # is one concatenation.
    outs = []
    for qs, ks, vs in zip(*(torch.split(t, lens) for t in (q, k, v))) if lens else ():
        if qs.shape[0] == 0:
            continue
        qs, ks, vs = (t.transpose(0, 1).unsqueeze(0) for t in (qs, ks, vs))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, enable_gqa=gqa)[0].transpose(0, 1))
    if not outs:
        return _empty_output(q, k, v)  # keep the graph connected
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


def sdpa_block_diagonal(q, k, v, cu_seqlens, max_len, *, causal):
    """(N, h, D) -> (N, h, Dv): one SDPA call with a block-diagonal (and causal) mask."""
    gqa = _check_gqa(q, k, v)
    N = q.shape[0]
    if N == 0:
        return _empty_output(q, k, v)
    lens = torch.diff(cu_seqlens.to(torch.int64))
    seg = torch.repeat_interleave(torch.arange(lens.numel(), device=q.device), lens.to(q.device))
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


@functools.cache
def flash_available() -> bool:
    """flash-attn importable and a CUDA device present (checked once, on first use)."""
    try:
        import flash_attn  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available()


def flash_varlen(q, k, v, cu_seqlens, max_len, *, causal):
    """(N, h, D) -> (N, h, D) via flash-attn's varlen kernel (CUDA, fp16/bf16)."""
    from flash_attn import flash_attn_varlen_func

    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    return flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, causal=causal)


BACKENDS: dict[str, VarlenAttention] = {
    "sdpa": sdpa_per_sequence,
    "sdpa_mask": sdpa_block_diagonal,
    "flash": flash_varlen,
}


def available_backends(device: torch.device) -> dict[str, str | None]:
    """Backend name -> None if usable on ``device``, else the reason it is not."""
    out: dict[str, str | None] = {"sdpa": None, "sdpa_mask": None}
    if device.type != "cuda":
        out["flash"] = "flash-attn needs CUDA tensors"
    elif not flash_available():
        out["flash"] = "flash-attn is not importable"
    else:
        out["flash"] = None
    return out


def varlen_attention(q, k, v, cu_seqlens, max_len: int, *, causal: bool = False, backend: str = "auto") -> torch.Tensor:
    """Attention within each packed sequence; ``backend`` is a key of :data:`BACKENDS` or auto."""
    if backend == "auto":
        backend = "flash" if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and flash_available() else "sdpa"
    try:
        fn = BACKENDS[backend]
    except KeyError:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {sorted(BACKENDS)} or 'auto'") from None
    return fn(q, k, v, cu_seqlens, max_len, causal=causal)


def _cross_sdpa(q, k, v, cu_q: list[int], cu_k: list[int]) -> torch.Tensor:
    gqa = _check_gqa(q, k, v)
    lq = [e - s for s, e in zip(cu_q[:-1], cu_q[1:])]
    lk = [e - s for s, e in zip(cu_k[:-1], cu_k[1:])]
    outs, attended = [], False
    for qs, ks, vs in zip(torch.split(q, lq), torch.split(k, lk), torch.split(v, lk)) if lq else ():
        if qs.shape[0] == 0:
            continue
        if ks.shape[0] == 0:  # nothing to attend to: no contribution
            outs.append(qs.new_zeros((qs.shape[0], qs.shape[1], vs.shape[2])))
            continue
        qs, ks, vs = (t.transpose(0, 1).unsqueeze(0) for t in (qs, ks, vs))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=gqa)[0].transpose(0, 1))
        attended = True
    if not attended:
        # keep q, k and v in the graph: k/v may come from a collective (a routed context) whose
        # backward every rank must join, also one whose queries all have empty contexts
        return _empty_output(q, k, v) if not outs else torch.cat(outs) + 0 * (q.sum() + k.sum() + v.sum())
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


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
    contexts (same number of sequences). ``backend``: ``sdpa`` (one call per sequence), ``flash``
    (flash-attn's varlen kernel with separate q/k bounds), or ``auto``; ``sdpa_mask`` is not
    offered for cross-attention."""
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
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
    if backend == "auto":
        backend = "flash" if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and flash_available() else "sdpa"
    if backend == "sdpa":
        return _cross_sdpa(q, k, v, cu_q, cu_k)
    if backend == "flash":
        from flash_attn import flash_attn_varlen_func

        lq = [e - s for s, e in zip(cu_q[:-1], cu_q[1:])]
        lk = [e - s for s, e in zip(cu_k[:-1], cu_k[1:])]
        if any(a and not b for a, b in zip(lq, lk)):  # flash's answer for an empty context is undefined
            return _cross_sdpa(q, k, v, cu_q, cu_k)
        dev = q.device
        return flash_attn_varlen_func(
            q,
            k,
            v,
            cu_seqlens_q.to(device=dev, dtype=torch.int32),
            cu_seqlens_k.to(device=dev, dtype=torch.int32),
            max(lq, default=0),
            max(lk, default=0),
        )
    raise ValueError(f"unknown cross-attention backend {backend!r}; choose sdpa, flash or auto")
