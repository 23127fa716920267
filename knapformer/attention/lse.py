"""Fused block kernels that return the log-sum-exp: what ring attention's block math runs on.

Ring attention merges each block's output by its log-sum-exp and recomputes a block's
gradients against the queries' *final* output and log-sum-exp, so a block kernel has two
halves: ``forward(q, k, v, causal) -> (o, lse)`` and ``backward(do, q, k, v, o, lse, causal) ->
(dq, dk, dv)``. Blocks are *aligned* (both start at position 0; ``causal`` masks the diagonal
block). Shapes: q (A, h, D), k (B, h_kv, D), v (B, h_kv, Dv); o (A, h, Dv) and lse (h, A) in
the compute dtype (fp32 for fp16/bf16); gradients in the compute dtype with k/v's heads.

Kernels, by name (:data:`KERNELS`):

- ``flash_attn``: flash-attn's ``flash_attn_func(return_attn_probs=True)`` and its backward
  (CUDA, fp16/bf16, D = Dv ≤ 256; GQA without repeating kv heads);
- ``cuda_flash`` / ``cuda_efficient``: PyTorch's flash and memory-efficient SDPA kernels
  (CUDA; flash: fp16/bf16, D = Dv ≤ 256, D % 8 = 0; efficient: also fp32);
- ``cpu_flash``: PyTorch's fused CPU flash kernel (D = Dv);
- ``tiled``: the exact einsum math of :mod:`knapformer.attention.blockwise` (any device, dtype
  and head dims): the reference and the fallback.

Which one runs is the attention backend's choice (``Backend.block_kernels``, in preference
order; :func:`choose_kernel`): the first whose conditions hold for the device, dtype and head
dims *and* whose one-time probe passes — a tiny block computed by the kernel and by ``tiled``
must agree, forward and backward, before a kernel is trusted on that device and dtype (a
library version whose calling convention differs is then skipped, with its reason in
:func:`kernel_report`, instead of giving wrong gradients). The fused kernels compute in the
input dtype, so for fp16/bf16 a block's output and gradients are rounded to it before the
fp32 merge.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from knapformer.attention.blockwise import _expand, block_backward, block_forward, compute_dtype

__all__ = [
    "KERNELS",
    "LseKernel",
    "block_kernel",
    "choose_kernel",
    "flash_attn_backward",
    "flash_attn_forward",
    "kernel_conditions",
    "kernel_report",
    "parameter_names",
]

_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class LseKernel:
    """One block kernel with its log-sum-exp (see module docstring)."""

    name: str
    forward: Callable
    """(q, k, v, causal) -> (o, lse)."""
    backward: Callable
    """(do, q, k, v, o, lse, causal) -> (dq, dk, dv)."""
    conditions: Callable[[str, torch.dtype, int, int], str | None]
    """(device type, dtype, D, Dv) -> why it cannot run (None: it can, subject to the probe)."""


def _bhld(t: torch.Tensor, h: int) -> torch.Tensor:
    """(L, h_kv, D) -> (1, h, L, D), kv heads repeated for their query heads."""
    return _expand(t, h).transpose(0, 1).unsqueeze(0)


def _from_bhld(t: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    return t[0].transpose(0, 1).to(dt)


def _fold_heads(g: torch.Tensor, hk: int) -> torch.Tensor:
    """Gradients of repeated kv heads added up per kv head."""
    h = g.shape[1]
    return g if h == hk else g.unflatten(1, (hk, h // hk)).sum(2)


# -- tiled (reference) -----------------------------------------------------------------------


def _tiled_forward(q, k, v, causal):
    n, m = q.shape[0], k.shape[0]
    return block_forward(q, k, v, torch.arange(n, device=q.device), torch.arange(m, device=q.device), causal=causal)


def _tiled_backward(do, q, k, v, o, lse, causal):
    delta = (do.to(o.dtype) * o).sum(-1).transpose(0, 1)
    pq, pk = torch.arange(q.shape[0], device=q.device), torch.arange(k.shape[0], device=q.device)
    return block_backward(q, k, v, do, lse, delta, pq, pk, causal=causal, keep_precision=True)


def _any(device: str, dtype: torch.dtype, d: int, dv: int) -> str | None:
    return None


# -- PyTorch's fused CPU flash kernel --------------------------------------------------------


def _cpu_forward(q, k, v, causal):
    h = q.shape[1]
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    o, lse = op(_bhld(q, h), _bhld(k, h), _bhld(v, h), 0.0, causal)
    return _from_bhld(o, compute_dtype(q)), lse[0].to(compute_dtype(q))


def _cpu_backward(do, q, k, v, o, lse, causal):
    h, hk, dt = q.shape[1], k.shape[1], compute_dtype(q)
    bw = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    lse = lse[None].float() if q.dtype in _HALF else lse[None]
    gq, gk, gv = bw(
        _bhld(do.to(q.dtype), h), _bhld(q, h), _bhld(k, h), _bhld(v, h), _bhld(o.to(q.dtype), h), lse, 0.0, causal
    )
    return _from_bhld(gq, dt), _fold_heads(_from_bhld(gk, dt), hk), _fold_heads(_from_bhld(gv, dt), hk)


def _cpu_conditions(device: str, dtype: torch.dtype, d: int, dv: int) -> str | None:
    if device != "cpu":
        return "the fused CPU kernel runs on CPU tensors"
    if d != dv:
        return f"the fused CPU kernel needs equal q/k and v head dims (got {d} and {dv})"
    if not hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
        return "this torch has no fused CPU flash kernel"
    return None


# -- PyTorch's CUDA flash and memory-efficient kernels ---------------------------------------


def _cuda_flash_forward(q, k, v, causal):
    h = q.shape[1]
    out = torch.ops.aten._scaled_dot_product_flash_attention(_bhld(q, h), _bhld(k, h), _bhld(v, h), 0.0, causal)
    return _from_bhld(out[0], compute_dtype(q)), out[1][0].to(compute_dtype(q))


def _cuda_flash_backward(do, q, k, v, o, lse, causal):
    h, hk, dt, dev = q.shape[1], k.shape[1], compute_dtype(q), q.device
    empty = torch.empty(0, dtype=torch.int32, device=dev)
    seed = torch.empty((), dtype=torch.int64, device=dev)
    gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        _bhld(do.to(q.dtype), h),
        _bhld(q, h),
        _bhld(k, h),
        _bhld(v, h),
        _bhld(o.to(q.dtype), h),
        lse[None].float().contiguous(),
        empty,
        empty,
        q.shape[0],
        k.shape[0],
        0.0,
        causal,
        seed,
        seed,
    )
    return _from_bhld(gq, dt), _fold_heads(_from_bhld(gk, dt), hk), _fold_heads(_from_bhld(gv, dt), hk)


def _cuda_flash_conditions(device: str, dtype: torch.dtype, d: int, dv: int) -> str | None:
    if device != "cuda":
        return "PyTorch's flash kernel runs on CUDA tensors"
    if dtype not in _HALF:
        return f"PyTorch's flash kernel needs float16 or bfloat16, got {dtype}"
    if d != dv or d > 256 or d % 8:
        return f"PyTorch's flash kernel needs D = Dv ≤ 256, a multiple of 8 (got {d}, {dv})"
    return None


def _cuda_efficient_forward(q, k, v, causal):
    h = q.shape[1]
    out = torch.ops.aten._scaled_dot_product_efficient_attention(
        _bhld(q, h), _bhld(k, h), _bhld(v, h), None, True, 0.0, causal
    )
    return _from_bhld(out[0], compute_dtype(q)), out[1][0, :, : q.shape[0]].to(compute_dtype(q))


def _cuda_efficient_backward(do, q, k, v, o, lse, causal):
    h, hk, dt, dev = q.shape[1], k.shape[1], compute_dtype(q), q.device
    a = q.shape[0]
    padded = torch.full((1, h, 32 * math.ceil(a / 32)), float("inf"), dtype=torch.float32, device=dev)
    padded[0, :, :a] = lse.float()  # the kernel's log-sum-exp rows are padded to 32
    seed = torch.empty((), dtype=torch.int64, device=dev)
    gq, gk, gv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        _bhld(do.to(q.dtype), h),
        _bhld(q, h),
        _bhld(k, h),
        _bhld(v, h),
        None,
        _bhld(o.to(q.dtype), h),
        padded,
        seed,
        seed,
        0.0,
        [True, True, True, False],
        causal,
    )
    return _from_bhld(gq, dt), _fold_heads(_from_bhld(gk, dt), hk), _fold_heads(_from_bhld(gv, dt), hk)


def _cuda_efficient_conditions(device: str, dtype: torch.dtype, d: int, dv: int) -> str | None:
    if device != "cuda":
        return "PyTorch's memory-efficient kernel runs on CUDA tensors"
    if dtype not in (*_HALF, torch.float32):
        return f"PyTorch's memory-efficient kernel needs float16, bfloat16 or float32, got {dtype}"
    if d % 8 or dv % 8:
        return f"PyTorch's memory-efficient kernel needs head dims that are multiples of 8 (got {d}, {dv})"
    return None


# -- flash-attn -------------------------------------------------------------------------------


def _flash_attn():
    import flash_attn
    import flash_attn.flash_attn_interface  # noqa: F401  (the backward lives there)

    return flash_attn


def flash_attn_forward(q, k, v, causal, *, fa=None):
    """A block through ``flash_attn_func(return_attn_probs=True)`` (``fa``: a module shaped like
    ``flash_attn``, e.g. the tests' stand-in; default the installed one)."""
    fa = fa or _flash_attn()
    o, lse, _ = fa.flash_attn_func(q[None], k[None], v[None], causal=causal, return_attn_probs=True)
    return o[0].to(compute_dtype(q)), lse[0, :, : q.shape[0]].to(compute_dtype(q))


def parameter_names(fn) -> list[str]:
    """The named parameters of ``fn``: from its signature; for a ``torch.library`` custom op
    (flash-attn ≥ 2.7 wraps ``_flash_attn_backward`` in one, whose signature reads
    ``(*args, **kwargs)``) from the function it wraps, or from its schema."""

    def named(f) -> list[str]:
        try:
            params = inspect.signature(f).parameters.values()
        except (TypeError, ValueError):
            return []
        return [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]

    names = named(fn)
    if names:
        return names
    inner = getattr(fn, "_init_fn", None)
    if inner is not None and named(inner):
        return named(inner)
    schema = getattr(getattr(fn, "_opoverload", None), "_schema", None)
    return [a.name for a in schema.arguments] if schema is not None else []


def flash_attn_backward(do, q, k, v, o, lse, causal, *, fa=None):
    """A block's gradients through flash-attn's ``_flash_attn_backward``, whose argument list
    differs between releases (matched by name, :func:`parameter_names`)."""
    fa = (fa or _flash_attn()).flash_attn_interface
    bw = fa._flash_attn_backward
    dq, dk, dv = (torch.empty_like(t[None]) for t in (q, k, v))
    given = {
        "dout": do.to(q.dtype)[None].contiguous(),
        "q": q[None],
        "k": k[None],
        "v": v[None],
        "out": o.to(q.dtype)[None].contiguous(),
        "softmax_lse": lse[None].float().contiguous(),
        "dq": dq,
        "dk": dk,
        "dv": dv,
        "dropout_p": 0.0,
        "softmax_scale": 1.0 / math.sqrt(q.shape[2]),
        "causal": causal,
        "window_size": (-1, -1),
        "window_size_left": -1,
        "window_size_right": -1,
        "softcap": 0.0,
        "alibi_slopes": None,
        "deterministic": False,
        "rng_state": None,
    }
    names = parameter_names(bw)
    if not names:
        raise TypeError("flash-attn's _flash_attn_backward: its parameters cannot be read")
    bw(**{n: given[n] for n in names if n in given})
    dt = compute_dtype(q)
    return dq[0].to(dt), dk[0].to(dt), dv[0].to(dt)


def _flash_attn_conditions(device: str, dtype: torch.dtype, d: int, dv: int) -> str | None:
    if device != "cuda":
        return "flash-attn runs on CUDA tensors"
    if dtype not in _HALF:
        return f"flash-attn needs float16 or bfloat16, got {dtype}"
    if d != dv or d > 256:
        return f"flash-attn needs D = Dv ≤ 256 (got {d}, {dv})"
    return None if _flash_attn_importable() else "flash-attn is not importable"


@functools.cache
def _flash_attn_importable() -> bool:
    """Checked once: a failed import is not cached by Python and would search the path again
    on every layer's call."""
    try:
        import flash_attn  # noqa: F401
    except Exception:
        return False
    return True


KERNELS: dict[str, LseKernel] = {
    k.name: k
    for k in (
        LseKernel("flash_attn", flash_attn_forward, flash_attn_backward, _flash_attn_conditions),
        LseKernel("cuda_flash", _cuda_flash_forward, _cuda_flash_backward, _cuda_flash_conditions),
        LseKernel("cuda_efficient", _cuda_efficient_forward, _cuda_efficient_backward, _cuda_efficient_conditions),
        LseKernel("cpu_flash", _cpu_forward, _cpu_backward, _cpu_conditions),
        LseKernel("tiled", _tiled_forward, _tiled_backward, _any),
    )
}
"""Every block kernel, by name."""


def kernel_conditions(name: str, device: str, dtype: torch.dtype, d: int, dv: int) -> str | None:
    """Why kernel ``name`` cannot run on (device type, dtype, D, Dv) — None if it can, before
    its probe (pure: no tensors, no devices; what the dispatch tests check on CPU)."""
    return KERNELS[name].conditions(device, dtype, d, dv)


@functools.cache
def _probe(name: str, device: str, dtype: torch.dtype, d: int, dv: int, gqa: bool) -> str | None:
    """Run kernel ``name`` once on a small causal block against ``tiled`` (forward and
    backward); None if they agree to the dtype's rounding, else the reason."""
    if name == "tiled":
        return None
    # outside autocast and autograd: the verdict is cached for the process, so the context of
    # the first call (a bf16 autocast region, a training step) must not decide it
    with torch.autocast(device_type=device, enabled=False), torch.no_grad():
        return _compare(name, device, dtype, d, dv, gqa)


def _compare(name: str, device: str, dtype: torch.dtype, d: int, dv: int, gqa: bool) -> str | None:
    g = torch.Generator(device="cpu").manual_seed(0)
    hk = 1 if gqa else 2
    shapes = ((37, 2, d), (37, hk, d), (37, hk, dv), (37, 2, dv))
    q, k, v, do = (torch.randn(s, generator=g).to(device=device, dtype=dtype) for s in shapes)
    tol = 3e-2 if dtype in _HALF else 1e-4
    try:
        for causal in (False, True):
            o, lse = KERNELS[name].forward(q, k, v, causal)
            o_ref, lse_ref = _tiled_forward(q, k, v, causal)
            grads = KERNELS[name].backward(do, q, k, v, o_ref, lse_ref, causal)
            refs = _tiled_backward(do, q, k, v, o_ref, lse_ref, causal)
            pairs = [("o", o, o_ref), ("lse", lse, lse_ref)] + list(zip(("dq", "dk", "dv"), grads, refs))
            for what, got, want in pairs:
                if got.shape != want.shape:
                    return f"{name}: {what} has shape {tuple(got.shape)}, expected {tuple(want.shape)}"
                err = float((got.float() - want.float()).abs().max()) / max(float(want.float().abs().max()), 1.0)
                if not err <= tol:
                    return f"{name}: {what} differs from the tiled math by {err:.2e} (causal={causal})"
    except Exception as exc:  # a kernel this torch/library cannot run as called
        return f"{name}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None


def choose_kernel(
    preference: tuple[str, ...],
    device: str,
    dtype: torch.dtype,
    d: int,
    dv: int,
    *,
    gqa: bool = False,
    probe: bool = True,
) -> str:
    """The first kernel of ``preference`` that can run on (device type, dtype, D, Dv) and
    passes its probe (``probe=False``: conditions only); ``tiled`` when none does."""
    for name in preference:
        if name not in KERNELS:
            raise ValueError(f"unknown block kernel {name!r}; choose from {sorted(KERNELS)}")
        if kernel_conditions(name, device, dtype, d, dv) is None and (
            not probe or _probe(name, device, dtype, d, dv, gqa) is None
        ):
            return name
    return "tiled"


def kernel_report(
    preference: tuple[str, ...], device: str, dtype: torch.dtype, d: int, dv: int
) -> dict[str, str | None]:
    """Kernel -> None if it would run, else why not (conditions, then the probe)."""
    out = {}
    for name in preference:
        why = kernel_conditions(name, device, dtype, d, dv)
        out[name] = why if why is not None else _probe(name, device, dtype, d, dv, False)
    return out


def block_kernel(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> LseKernel:
    """The block kernel the attention backend ``backend`` (a registry name or ``auto``) runs
    ring blocks with, for tensors like q, k, v."""
    from knapformer.attention.registry import resolve_backend

    prefs = resolve_backend(backend, q).block_kernels
    return KERNELS[_chosen(prefs, q.device.type, q.dtype, q.shape[2], v.shape[2], k.shape[1] != q.shape[1])]


@functools.lru_cache(maxsize=256)
def _chosen(prefs: tuple[str, ...], device: str, dtype: torch.dtype, d: int, dv: int, gqa: bool) -> str:
    """:func:`choose_kernel`, remembered: ring attention asks once per layer and ring batch."""
    return choose_kernel(prefs, device, dtype, d, dv, gqa=gqa)
