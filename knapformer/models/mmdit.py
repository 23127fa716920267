"""Reference Flux-style MMDiT: double-stream blocks, then single-stream blocks, AdaLN from a
per-sequence conditioning vector, RoPE from positions.

A sample is one packed sequence: its text tokens first, then its image/video tokens. Inputs
per rank: token features ``x`` (T, in_dim) (text and latent patches share ``in_dim`` in this
reference), per-sequence text lengths, timesteps and pooled vectors.

Integration points (the same code runs with ``SequenceBalancer`` or ``LocalExecutor``):

1. per-sequence conditioning ``c`` is computed where the sequence lives, then
   ``executor.gather_sequences`` makes every rank's table available (once per step,
   differentiable) — per-token lookups use the routed sequence id;
2. tokens are routed right after the input projections;
3. every block calls ``executor.attention`` (Ulysses inside multi-rank bags);
4. the output is routed back before the loss.

Text/image membership and positions after routing come from ``routed_positions`` and the
gathered text lengths, so no float table or flag travels with the tokens. A rank whose routed
tokens are all text or all image still runs every stream's layers (on empty inputs), so every
parameter gets a gradient on every rank.

Legend: T local tokens, R routed tokens, S sequences (group), D width, H heads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from knapformer.attention.bounds import host_values, index_to
from knapformer.executor import LocalExecutor, TokenExecutor, local_positions, present_sequences
from knapformer.model_configs import MMDiTConfig
from knapformer.models.layers import RMSNorm, apply_rope, merge_streams, modulate, split_streams, timestep_embedding

__all__ = ["MMDiTConfig", "MMDiT", "TokenMeta", "token_meta"]


@dataclass
class TokenMeta:
    """Per routed token bookkeeping, built once per forward."""

    seq_id: torch.Tensor  # (R,) each token's row of the blocks' conditioning table (group sequence id, or its slot)
    pos: torch.Tensor  # (R,) position within the sequence
    idx_txt: torch.Tensor  # rows of text tokens
    idx_img: torch.Tensor  # rows of image tokens
    inverse: torch.Tensor  # cat(txt, img) -> token order


def _linear_by_stream(x: torch.Tensor, meta: TokenMeta, f_txt: nn.Module, f_img: nn.Module) -> torch.Tensor:
    """Apply the text weights to text rows and the image weights to image rows."""
    return merge_streams(f_txt(x.index_select(0, meta.idx_txt)), f_img(x.index_select(0, meta.idx_img)), meta.inverse)


class _Stream(nn.Module):
    """One stream's weights of a double block: modulation, norms, qkv, qk-norm, proj, MLP."""

    def __init__(self, D: int, H: int, hidden: int) -> None:
        super().__init__()
        self.mod = nn.Linear(D, 6 * D)
        self.norm1 = nn.LayerNorm(D, elementwise_affine=False, eps=1e-6)
        self.norm2 = nn.LayerNorm(D, elementwise_affine=False, eps=1e-6)
        self.qkv = nn.Linear(D, 3 * D)
        self.q_norm, self.k_norm = RMSNorm(D // H), RMSNorm(D // H)
        self.proj = nn.Linear(D, D)
        self.mlp = nn.Sequential(nn.Linear(D, hidden), nn.GELU(approximate="tanh"), nn.Linear(hidden, D))


class DoubleBlock(nn.Module):
    """Separate text/image weights; one joint attention over each sequence's tokens."""

    def __init__(self, cfg: MMDiTConfig) -> None:
        super().__init__()
        self.H = cfg.num_heads
        hidden = int(cfg.mlp_ratio * cfg.dim)
        self.txt = _Stream(cfg.dim, cfg.num_heads, hidden)
        self.img = _Stream(cfg.dim, cfg.num_heads, hidden)

    def forward(self, x: torch.Tensor, c_SD: torch.Tensor, meta: TokenMeta, ex: TokenExecutor) -> torch.Tensor:
        R, D = x.shape
        H = self.H
        # per-sequence modulation, looked up per token by stream: (R, 6D)
        seq = meta.seq_id
        mod_t = self.txt.mod(F.silu(c_SD)).index_select(0, seq.index_select(0, meta.idx_txt))
        mod_i = self.img.mod(F.silu(c_SD)).index_select(0, seq.index_select(0, meta.idx_img))
        mod = merge_streams(mod_t, mod_i, meta.inverse)
        sh1, sc1, g1, sh2, sc2, g2 = mod.chunk(6, dim=-1)
        h = modulate(self.txt.norm1(x), sh1, sc1)  # LayerNorm without affine: same for both streams
        qkv = _linear_by_stream(h, meta, self.txt.qkv, self.img.qkv).view(R, 3, H, D // H)
        q, k, v = qkv.unbind(1)
        q = apply_rope(_linear_by_stream(q, meta, self.txt.q_norm, self.img.q_norm), meta.pos)
        k = apply_rope(_linear_by_stream(k, meta, self.txt.k_norm, self.img.k_norm), meta.pos)
        o = ex.attention(q, k, v).reshape(R, D)
        x = x + g1 * _linear_by_stream(o, meta, self.txt.proj, self.img.proj)
        h = modulate(self.txt.norm2(x), sh2, sc2)
        return x + g2 * _linear_by_stream(h, meta, self.txt.mlp, self.img.mlp)


class SingleBlock(nn.Module):
    """Shared weights; fused qkv+MLP input, attention and MLP in parallel."""

    def __init__(self, cfg: MMDiTConfig) -> None:
        super().__init__()
        D = cfg.dim
        self.H, self.hidden = cfg.num_heads, int(cfg.mlp_ratio * D)
        self.mod = nn.Linear(D, 3 * D)
        self.norm = nn.LayerNorm(D, elementwise_affine=False, eps=1e-6)
        self.lin1 = nn.Linear(D, 3 * D + self.hidden)
        self.q_norm, self.k_norm = RMSNorm(D // self.H), RMSNorm(D // self.H)
        self.lin2 = nn.Linear(D + self.hidden, D)

    def forward(self, x: torch.Tensor, c_SD: torch.Tensor, meta: TokenMeta, ex: TokenExecutor) -> torch.Tensor:
        R, D = x.shape
        H = self.H
        shift, scale, gate = self.mod(F.silu(c_SD)).index_select(0, meta.seq_id).chunk(3, dim=-1)
        qkv, mlp = self.lin1(modulate(self.norm(x), shift, scale)).split([3 * D, self.hidden], dim=-1)
        q, k, v = qkv.reshape(R, 3, H, D // H).unbind(1)
        q, k = apply_rope(self.q_norm(q), meta.pos), apply_rope(self.k_norm(k), meta.pos)
        o = ex.attention(q, k, v).reshape(R, D)
        return x + gate * self.lin2(torch.cat([o, F.gelu(mlp, approximate="tanh")], dim=-1))


class MMDiT(nn.Module):
    """Packed variable-length Flux-style DiT: (T, in_dim) tokens -> (T, out_dim)."""

    def __init__(self, cfg: MMDiTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        D = cfg.dim
        self.txt_in = nn.Linear(cfg.in_dim, D)
        self.img_in = nn.Linear(cfg.in_dim, D)
        self.time_in = nn.Sequential(nn.Linear(256, D), nn.SiLU(), nn.Linear(D, D))
        self.vec_in = nn.Sequential(nn.Linear(cfg.vec_dim, D), nn.SiLU(), nn.Linear(D, D))
        self.double_blocks = nn.ModuleList(DoubleBlock(cfg) for _ in range(cfg.num_double))
        self.single_blocks = nn.ModuleList(SingleBlock(cfg) for _ in range(cfg.num_single))
        self.norm_out = nn.LayerNorm(D, elementwise_affine=False, eps=1e-6)
        self.mod_out = nn.Linear(D, 2 * D)
        self.proj_out = nn.Linear(D, cfg.out_dim)

    @property
    def blocks(self) -> list[nn.Module]:
        return [*self.double_blocks, *self.single_blocks]

    def forward(
        self,
        x_TI: torch.Tensor,
        seq_lens: Sequence[int],
        txt_lens: torch.Tensor,
        t_S: torch.Tensor,
        vec_SV: torch.Tensor,
        executor: TokenExecutor | None = None,
    ) -> torch.Tensor:
        """``seq_lens``/``txt_lens`` (int64)/``t_S``/``vec_SV`` describe this rank's sequences."""
        ex = executor if executor is not None else LocalExecutor(seq_lens)
        # 1. conditioning per local sequence, then every rank's table (once per step)
        c_local = self.time_in(timestep_embedding(t_S, 256).to(x_TI.dtype)) + self.vec_in(vec_SV)
        if torch.compiler.is_compiling():  # (in the graph: device tables, as the blocks see them)
            c_SD, txt_all = ex.gather_sequences(c_local, txt_lens.to(torch.int64))
            seq_l, pos_l = local_positions(seq_lens, x_TI.device)
            meta_l = token_meta(seq_l, pos_l, txt_lens.to(x_TI.device))
            h = ex.route(_linear_by_stream(x_TI, meta_l, self.txt_in, self.img_in), seq_lens=seq_lens)
            seq_id, pos = ex.routed_positions(h)
            meta = token_meta(seq_id, pos, txt_all)
        else:  # the stream tables from host numbers (text lengths on the host), uploaded once: no sync
            # (no sync when given on the host, as PackedCollate gives it)
            txt_host = (txt_lens if txt_lens.device.type == "cpu" else txt_lens.cpu()).to(torch.int64)
            seq_l, pos_l = local_positions(seq_lens)
            meta_l = _host_meta(seq_l, pos_l, txt_host, x_TI.device)
            # route first: its agreement is the step's one whole-group rendezvous (the gathers
            # after it are checked with their peers only)
            h = ex.route(_linear_by_stream(x_TI, meta_l, self.txt_in, self.img_in), seq_lens=seq_lens)
            (c_SD,) = ex.gather_sequences(c_local)
            (txt_all,) = ex.gather_sequences(txt_host, names=("text lengths",))
            seq_id, pos = ex.routed_positions(None)
            meta = _host_meta(seq_id, pos, txt_all, h.device)
        # modulation runs on the samples present here only (its cost follows them, not the
        # group's sample count): the blocks index conditioning rows by each token's slot
        present, slot = present_sequences(ex, h)
        c_SD, meta = c_SD.index_select(0, present), dataclasses.replace(meta, seq_id=slot)
        # 3. blocks
        for block in self.blocks:
            h = block(h, c_SD, meta, ex)
        # 4. output modulation (shift, scale), projection, route back
        shift, scale = self.mod_out(F.silu(c_SD)).index_select(0, meta.seq_id).chunk(2, dim=-1)
        return ex.reverse_route(self.proj_out(modulate(self.norm_out(h), shift, scale)))


def _host_meta(seq_id: torch.Tensor, pos: torch.Tensor, txt_lens: torch.Tensor, device) -> TokenMeta:
    """:func:`token_meta` from host tensors, built with numpy and uploaded once (no device sync)."""
    seq, p, txt = (host_values(t) for t in (seq_id, pos, txt_lens))
    is_text = p < txt[seq]
    idx_txt, idx_img = np.flatnonzero(is_text), np.flatnonzero(~is_text)
    order = np.concatenate([idx_txt, idx_img])
    inverse = np.empty_like(order)
    inverse[order] = np.arange(order.size)
    up = [index_to(a, device) for a in (seq, p, idx_txt, idx_img, inverse)]
    return TokenMeta(seq_id=up[0], pos=up[1], idx_txt=up[2], idx_img=up[3], inverse=up[4])


def token_meta(seq_id: torch.Tensor, pos: torch.Tensor, txt_lens: torch.Tensor) -> TokenMeta:
    """Per-token stream membership from sequence ids, positions and per-sequence text lengths."""
    is_text = pos < txt_lens.index_select(0, seq_id)
    idx_txt, idx_img, inverse = split_streams(is_text)
    return TokenMeta(seq_id=seq_id, pos=pos, idx_txt=idx_txt, idx_img=idx_img, inverse=inverse)
