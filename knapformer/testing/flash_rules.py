"""A CPU stand-in for flash-attn 2 that enforces its argument rules (tests only).

flash-attn is CUDA-only, so CI never runs knapformer's flash paths, and flash-attn refuses
arguments that PyTorch's SDPA accepts. :data:`fake_flash_attn` mimics flash-attn ≥ 2.7's Python
API — ``flash_attn_varlen_func``, ``flash_attn_func(return_attn_probs=True)`` and
``flash_attn_interface._flash_attn_backward``, which is a ``torch.library`` custom op whose
Python signature reads ``(*args, **kwargs)`` — and checks, like flash-attn's ``TORCH_CHECK``\\ s:

- a batch of at least one sequence (``cu_seqlens`` of ≥ 2 entries; zero-length sequences are
  fine: their output is zero);
- ``cu_seqlens`` int32, contiguous, 1-D, on q's device, starting at 0, non-decreasing, ending
  at the rows; ``max_seqlen`` ≥ every length;
- q, k, v with a last-dim stride of 1, one head dim for all three, ≤ 256; kv heads dividing
  the query heads;
- fp16/bf16 only — except that fp32 is accepted as standing for a cast to bf16, so that tests
  compare in fp32 against a float64 reference (the test "in fp32 cast").

It computes exactly (PyTorch SDPA / the tiled block math in the inputs' dtype). The backend
``flash2_rules`` (registered in :mod:`knapformer.attention.registry`, never chosen by
``auto``) runs knapformer's own flash-attn wrappers on it, ring blocks included.
"""

from __future__ import annotations

import functools
import math
import types

import torch
import torch.nn.functional as F

from knapformer.attention.sdpa import lower_right_bias

__all__ = ["BACKEND", "check_tensors", "check_varlen", "fake_flash_attn"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _fail(message: str):
    raise RuntimeError(f"flash-attn 2 (stand-in): {message}")


def check_tensors(q, k, v) -> None:
    """The head, dtype and layout rules of q, k, v (any leading shape; heads second to last)."""
    for name, t in zip("qkv", (q, k, v)):
        if t.dtype not in _DTYPES:
            _fail(f"{name} must be fp16 or bf16 (fp32 accepted as a cast), got {t.dtype}")
        if t.stride(-1) != 1:
            _fail(f"{name} must have contiguous last dimension (stride {t.stride(-1)})")
    if not (q.dtype == k.dtype == v.dtype):
        _fail(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    d = q.shape[-1]
    if k.shape[-1] != d or v.shape[-1] != d:
        _fail(f"q, k, v must have one head dim, got {q.shape[-1]}, {k.shape[-1]}, {v.shape[-1]}")
    if d > 256:
        _fail(f"head dim must be <= 256, got {d}")
    if k.shape[-2] != v.shape[-2] or q.shape[-2] % k.shape[-2]:
        _fail(f"number of heads in key/value must divide number of heads in query ({q.shape[-2]}, {k.shape[-2]})")


def _check_bounds(name: str, cu, rows: int, max_len: int, device) -> list[int]:
    if not isinstance(cu, torch.Tensor):
        _fail(f"{name} must be a tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        _fail(f"{name} must have dtype int32, got {cu.dtype}")
    if not cu.is_contiguous() or cu.dim() != 1:
        _fail(f"{name} must be a contiguous 1-D tensor")
    if cu.device != device:
        _fail(f"{name} must be on q's device {device}, got {cu.device}")
    if cu.numel() < 2:
        _fail("batch size must be positive")  # flash_api.cpp: TORCH_CHECK(batch_size > 0)
    host = cu.tolist()
    if host[0] != 0 or host[-1] != rows or any(b < a for a, b in zip(host[:-1], host[1:])):
        _fail(f"{name} {host[:8]}... must rise from 0 to the {rows} rows")
    longest = max(b - a for a, b in zip(host[:-1], host[1:]))
    if longest > max_len:
        _fail(f"max_seqlen {max_len} < a sequence of {longest} ({name})")
    return host


def check_varlen(q, k, v, cu_q, cu_k, max_q: int, max_k: int) -> tuple[list[int], list[int]]:
    """Every rule of ``flash_attn_varlen_func``'s arguments; returns the host bounds."""
    check_tensors(q, k, v)
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        _fail("q, k, v must be (total, heads, head_dim)")
    bq = _check_bounds("cu_seqlens_q", cu_q, q.shape[0], max_q, q.device)
    bk = _check_bounds("cu_seqlens_k", cu_k, k.shape[0], max_k, q.device)
    if len(bq) != len(bk):
        _fail("cu_seqlens_q and cu_seqlens_k must bound the same batch")
    return bq, bk


def flash_attn_varlen_func(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None, causal=False
):
    """flash-attn's varlen call: segment i's queries over its keys, causal bottom-right aligned."""
    bq, bk = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    rep = q.shape[1] // k.shape[1]
    outs = []
    for (qa, qb), (ka, kb) in zip(zip(bq[:-1], bq[1:]), zip(bk[:-1], bk[1:])):
        nq, nk = qb - qa, kb - ka
        if nq == 0:
            continue
        if nk == 0:  # flash-attn: max_seqlen_k == 0 zero-fills the output
            outs.append(q.new_zeros((nq, q.shape[1], v.shape[2])))
            continue
        qs, ks, vs = (t.transpose(0, 1)[None] for t in (q[qa:qb], k[ka:kb], v[ka:kb]))
        mask = lower_right_bias(nq, nk) if causal and nq != nk else None
        o = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, is_causal=causal and mask is None, enable_gqa=rep > 1, scale=softmax_scale
        )
        outs.append(o[0].transpose(0, 1))
    if not outs:
        return q.new_zeros((q.shape[0], q.shape[1], v.shape[2])) + 0 * (q.sum() + k.sum() + v.sum())
    return torch.cat(outs)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, return_attn_probs=False, **_):
    """flash-attn's dense call on (batch, L, heads, D); ``return_attn_probs`` adds the
    log-sum-exp (batch, heads, L) as flash-attn returns it."""
    from knapformer.attention.blockwise import block_forward

    check_tensors(q, k, v)
    if q.shape[0] < 1 or q.shape[1] < 1 or k.shape[1] < 1:
        _fail("batch size and sequence lengths must be positive")
    outs, lses = [], []
    for b in range(q.shape[0]):
        pq, pk = torch.arange(q.shape[1]), torch.arange(k.shape[1])
        o, lse = block_forward(q[b], k[b], v[b], pq, pk, causal=causal)
        outs.append(o.to(q.dtype))
        lses.append(lse.float())
    o, lse = torch.stack(outs), torch.stack(lses)
    return (o, lse, None) if return_attn_probs else o


@torch.library.custom_op("knapformer_testing::flash_attn_backward", mutates_args=("dq", "dk", "dv"))
def _flash_attn_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    deterministic: bool,
    rng_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """flash-attn 2.7's backward (a custom op: its Python signature reads ``(*args, **kwargs)``)."""
    from knapformer.attention.blockwise import block_backward

    check_tensors(q, k, v)
    if not math.isclose(softmax_scale, 1.0 / math.sqrt(q.shape[-1])):
        _fail(f"this stand-in computes the default softmax scale only, got {softmax_scale}")
    deltas = []
    for b in range(q.shape[0]):
        delta = (dout[b].float() * out[b].float()).sum(-1).transpose(0, 1)
        pq, pk = torch.arange(q.shape[1]), torch.arange(k.shape[1])
        gq, gk, gv = block_backward(
            q[b], k[b], v[b], dout[b], softmax_lse[b], delta, pq, pk, causal=causal, keep_precision=True
        )
        dq[b].copy_(gq)
        dk[b].copy_(gk)
        dv[b].copy_(gv)
        deltas.append(delta)
    return torch.stack(deltas)


fake_flash_attn = types.SimpleNamespace(
    flash_attn_varlen_func=flash_attn_varlen_func,
    flash_attn_func=flash_attn_func,
    flash_attn_interface=types.SimpleNamespace(_flash_attn_backward=_flash_attn_backward),
)
"""The stand-in, shaped like the ``flash_attn`` package (what knapformer imports from it)."""


def _conditions(device: str, dtype: torch.dtype, d: int, dv: int) -> str | None:
    if device != "cpu":
        return "the flash-attn stand-in is for CPU tests (use flash-attn itself on a GPU)"
    if dtype not in _DTYPES:
        return f"flash-attn needs float16 or bfloat16 (the stand-in also fp32), got {dtype}"
    if d != dv or d > 256:
        return f"flash-attn needs D = Dv ≤ 256 (got {d}, {dv})"
    return None


def _backend():
    from knapformer.attention import flash, lse
    from knapformer.attention.backend import Backend

    kernel = lse.LseKernel(
        "flash2_rules",
        functools.partial(lse.flash_attn_forward, fa=fake_flash_attn),
        functools.partial(lse.flash_attn_backward, fa=fake_flash_attn),
        _conditions,
    )
    lse.KERNELS.setdefault(kernel.name, kernel)  # ring blocks through flash-attn's calls, on the stand-in
    fn = fake_flash_attn.flash_attn_varlen_func
    return Backend(
        name="flash2_rules",
        attend=functools.partial(flash.flash_varlen, fn=fn),
        cross=functools.partial(flash.flash_cross, fn=fn),
        attend_qk=functools.partial(flash.flash_qk, fn=fn),
        block_kernels=("flash2_rules",),
        unavailable=lambda q: None if q.device.type == "cpu" else "a CPU stand-in for tests",
    )


BACKEND = _backend()
"""knapformer's flash-attn paths (varlen, cross, the split form, ring blocks) on the stand-in."""
