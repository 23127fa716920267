"""Building blocks shared by the reference models (no torch.distributed here).

Legend: T tokens on this rank, H heads, Dh head dim, D model width, S sequences.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["RMSNorm", "SwiGLU", "apply_rope", "timestep_embedding", "modulate", "split_streams", "merge_streams"]


class RMSNorm(nn.Module):
    """RMS norm over the last dim with a learned scale."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class SwiGLU(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def apply_rope(x_THD: torch.Tensor, pos_T: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """1-D rotary embedding from integer positions (computed on the fly: no float tables
    travel with the tokens). Rotates pairs (even, odd) of the head dim."""
    T, H, Dh = x_THD.shape
    half = Dh // 2
    freqs = base ** (-torch.arange(half, device=x_THD.device, dtype=torch.float32) / half)
    angle = pos_T.to(torch.float32)[:, None] * freqs[None, :]  # (T, Dh/2)
    cos, sin = angle.cos()[:, None, :].to(x_THD.dtype), angle.sin()[:, None, :].to(x_THD.dtype)
    x1, x2 = x_THD[..., 0::2], x_THD[..., 1::2]
    out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return out.reshape(T, H, Dh)


def timestep_embedding(t_S: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal embedding of (S,) timesteps in [0, 1] -> (S, dim)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, device=t_S.device, dtype=torch.float32) / half)
    args = 1000.0 * t_S.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def modulate(x_TD: torch.Tensor, shift_TD: torch.Tensor, scale_TD: torch.Tensor) -> torch.Tensor:
    return x_TD * (1 + scale_TD) + shift_TD


def split_streams(is_text_T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Index tensors of text tokens, image tokens, and the inverse of their concatenation."""
    idx_txt = torch.nonzero(is_text_T, as_tuple=False).flatten()
    idx_img = torch.nonzero(~is_text_T, as_tuple=False).flatten()
    order = torch.cat([idx_txt, idx_img])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return idx_txt, idx_img, inverse


def merge_streams(txt: torch.Tensor, img: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """Inverse of splitting by stream: text rows and image rows back to token order."""
    return torch.cat([txt, img], dim=0).index_select(0, inverse)
