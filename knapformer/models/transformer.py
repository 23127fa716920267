"""Reference Transformer: pre-RMSNorm blocks, QK-norm, SwiGLU MLP, 1-D RoPE, optional causal.

Single-device code with an optional executor handle (``SequenceBalancer`` or
``LocalExecutor``): tokens are routed after the input projection, every block calls
``executor.attention``, and the output is routed back before the head, so the loss sees the
caller's token order. Without balancing, pass ``LocalExecutor(seq_lens)``.

Legend: T local tokens, R routed tokens, H heads, Dh head dim, D width.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn

from knapformer.executor import LocalExecutor, TokenExecutor
from knapformer.model_configs import TransformerConfig
from knapformer.models.layers import RMSNorm, SwiGLU, apply_rope

__all__ = ["TransformerConfig", "Transformer"]


class Block(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        D, H = cfg.dim, cfg.num_heads
        self.norm1, self.norm2 = RMSNorm(D), RMSNorm(D)
        self.qkv = nn.Linear(D, D + 2 * cfg.kv_heads * (D // H), bias=False)  # q, then k and v (GQA)
        self.q_norm, self.k_norm = RMSNorm(D // H), RMSNorm(D // H)
        self.proj = nn.Linear(D, D, bias=False)
        self.mlp = SwiGLU(D, int(cfg.mlp_ratio * D))

    def forward(self, x_RD: torch.Tensor, pos_R: torch.Tensor, ex: TokenExecutor) -> torch.Tensor:
        R, D = x_RD.shape
        H = self.cfg.num_heads
        Dh, Hkv = D // H, self.cfg.kv_heads
        q, k, v = self.qkv(self.norm1(x_RD)).view(R, H + 2 * Hkv, Dh).split([H, Hkv, Hkv], dim=1)
        q, k = apply_rope(self.q_norm(q), pos_R), apply_rope(self.k_norm(k), pos_R)
        o = ex.attention(q, k, v, causal=self.cfg.causal)
        x_RD = x_RD + self.proj(o.reshape(R, D))
        return x_RD + self.mlp(self.norm2(x_RD))


class Transformer(nn.Module):
    """Token features (T, in_dim) of packed sequences -> (T, out_dim)."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.inp = nn.Linear(cfg.in_dim, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.dim)
        self.out = nn.Linear(cfg.dim, cfg.out_dim)

    def forward(
        self, x_TI: torch.Tensor, seq_lens: Sequence[int], executor: TokenExecutor | None = None
    ) -> torch.Tensor:
        ex = executor if executor is not None else LocalExecutor(seq_lens)
        h = ex.route(self.inp(x_TI), seq_lens=seq_lens)  # route after the input projection
        _, pos = ex.routed_positions(h)
        for block in self.blocks:
            h = block(h, pos, ex)
        return ex.reverse_route(self.out(self.norm(h)))  # back to the caller's order
