"""``flash``: flash-attn's varlen kernels (CUDA, fp16/bf16), imported on first use.

``auto`` prefers it whenever it can run; nothing is imported when knapformer is. flash-attn 2
refuses a batch of zero sequences (``cu_seqlens`` of one entry): a rank with nothing to
compute never calls it (:func:`knapformer.attention.varlen_attention` and the cross and split
forms return zeros joined to the graph). Bounds reach it as the device tensors the plan
uploaded once (:mod:`knapformer.attention.bounds`): no host-to-device copy per call.
"""

from __future__ import annotations

import functools

import torch

from knapformer.attention.backend import Backend, empty_output

__all__ = ["BACKEND", "flash_available", "flash_cross", "flash_qk", "flash_varlen"]


@functools.cache
def flash_available() -> bool:
    """flash-attn importable and a CUDA device present (checked once, on first use)."""
    try:
        import flash_attn  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available()


def _unavailable(q: torch.Tensor) -> str | None:
    if q.device.type != "cuda":
        return "flash-attn needs CUDA tensors"
    if not flash_available():
        return "flash-attn is not importable"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"flash-attn needs float16 or bfloat16, got {q.dtype}"
    return None


def device_bounds(cu, device: torch.device) -> torch.Tensor:
    """``cu`` (a tensor, or :class:`~knapformer.attention.bounds.Bounds` carrying one) as the
    int32 contiguous tensor on ``device`` flash-attn takes; copied only when it is not one."""
    t = getattr(cu, "tensor", cu)
    if isinstance(t, torch.Tensor) and t.device == device and t.dtype == torch.int32 and t.is_contiguous():
        return t
    if isinstance(t, torch.Tensor):
        return t.to(device=device, dtype=torch.int32).contiguous()
    return torch.tensor(list(cu), dtype=torch.int32, device=device)


def flash_varlen(q, k, v, cu_seqlens, max_len, *, causal):
    """(N, h, D) -> (N, h, D) via flash-attn's varlen kernel."""
    from flash_attn import flash_attn_varlen_func

    if q.shape[0] == 0 or cu_seqlens.numel() < 2:
        return empty_output(q, k, v)
    cu = device_bounds(cu_seqlens, q.device)
    return flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, causal=causal)


def flash_cross(q, k, v, cu_q: list[int], cu_k: list[int]) -> torch.Tensor:
    """Separate q/k bounds in one varlen call; an empty context goes through SDPA's form
    (flash's answer for it is undefined)."""
    from flash_attn import flash_attn_varlen_func

    from knapformer.attention.sdpa import sdpa_cross

    lq = [e - s for s, e in zip(cu_q[:-1], cu_q[1:])]
    lk = [e - s for s, e in zip(cu_k[:-1], cu_k[1:])]
    if q.shape[0] == 0 or not lq:
        return empty_output(q, k, v)
    if any(a and not b for a, b in zip(lq, lk)):
        return sdpa_cross(q, k, v, cu_q, cu_k)
    dev = q.device
    return flash_attn_varlen_func(
        q, k, v, device_bounds(cu_q, dev), device_bounds(cu_k, dev), max(lq, default=0), max(lk, default=0)
    )


def flash_qk(q, k, v, cu_q: list[int], cu_k: list[int], *, causal: bool) -> torch.Tensor:
    """Separate q/k bounds in one varlen call; causal is bottom-right aligned in flash-attn
    (since 2.1), as ``pre_attn``'s contract asks."""
    from flash_attn import flash_attn_varlen_func

    lq = [e - s for s, e in zip(cu_q[:-1], cu_q[1:])]
    lk = [e - s for s, e in zip(cu_k[:-1], cu_k[1:])]
    if q.shape[0] == 0 or not lq:
        return empty_output(q, k, v)
    dev = q.device
    return flash_attn_varlen_func(
        q,
        k,
        v,
        device_bounds(cu_q, dev),
        device_bounds(cu_k, dev),
        max(lq, default=0),
        max(lk, default=0),
        causal=causal,
    )


BACKEND = Backend(
    name="flash",
    attend=flash_varlen,
    cross=flash_cross,
    attend_qk=flash_qk,
    unavailable=_unavailable,
    auto_priority=10,
    block_kernels=("flash_attn", "cuda_flash", "cuda_efficient", "tiled"),
)
