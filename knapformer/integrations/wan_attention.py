"""Wan's packed attention: the processor for ``attn1`` (self) and ``attn2`` (cross) over packed
``[1, T, D]`` tokens, and the metadata it is handed through the block's arguments.

Self-attention computes q/k/v with the stock projections and norms, applies Wan's RoPE from
tables looked up at each routed token's grid position, and attends within each sample through
``executor.attention``; cross-attention projects each layer's keys/values from the routed text
(and I2V image) context and attends locally through ``executor.cross_attention``. Stock
behaviour when the arguments are not packed. Used by :mod:`knapformer.integrations.wan`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from knapformer.executor import RoutedContext, TokenExecutor
from knapformer.integrations.processors import PackedProcessor

__all__ = ["CrossPacked", "PackedWanAttnProcessor", "SelfPacked", "rope_tables"]


@dataclass(eq=False)
class SelfPacked:
    """What ``attn1`` needs: the executor and the routed tokens' RoPE tables (T, 1, Dh)."""

    executor: TokenExecutor
    cos: torch.Tensor
    sin: torch.Tensor


@dataclass(eq=False)
class CrossPacked:
    """What ``attn2`` needs: the routed text (and image) context of this rank's samples."""

    executor: TokenExecutor
    text: RoutedContext
    image: RoutedContext | None


def _heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(1, N, H·Dh) -> (N, H, Dh)."""
    return t[0].unflatten(-1, (heads, -1))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's rotary embedding (interleaved pairs) on (N, H, Dh) with (N, 1, Dh) tables."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * c - x2 * s
    out[..., 1::2] = x1 * s + x2 * c
    return out.type_as(x)


def _kv(attn, rows: torch.Tensor, added: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of context rows with the module's own (possibly fused) projections."""
    if added:
        if getattr(attn, "fused_projections", False):
            return attn.to_added_kv(rows).chunk(2, dim=-1)
        return attn.add_k_proj(rows), attn.add_v_proj(rows)
    if getattr(attn, "fused_projections", False):
        return attn.to_kv(rows).chunk(2, dim=-1)
    return attn.to_k(rows), attn.to_v(rows)


class PackedWanAttnProcessor(PackedProcessor):
    """Wan attention over packed ``[1, T, D]`` tokens; stock behaviour when not packed."""

    stock = "diffusers.models.transformers.transformer_wan:WanAttnProcessor"

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        if isinstance(rotary_emb, SelfPacked):
            return self._self(attn, hidden_states, rotary_emb)
        if isinstance(encoder_hidden_states, CrossPacked):
            return self._cross(attn, hidden_states, encoder_hidden_states)
        return self._stock(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)

    @staticmethod
    def _self(attn, hidden_states, packed: SelfPacked):
        if getattr(attn, "fused_projections", False):
            q, k, v = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        q, k = attn.norm_q(q), attn.norm_k(k)
        q, k, v = (_heads(t, attn.heads) for t in (q, k, v))
        q, k = _rope(q, packed.cos, packed.sin), _rope(k, packed.cos, packed.sin)
        o = packed.executor.attention(q, k, v).flatten(1, 2)[None].type_as(q)
        return attn.to_out[1](attn.to_out[0](o))

    @staticmethod
    def _cross(attn, hidden_states, packed: CrossPacked):
        q = attn.norm_q(attn.to_q(hidden_states))
        q = _heads(q, attn.heads)
        k, v = _kv(attn, packed.text.rows)
        k = attn.norm_k(k)
        k, v = k.unflatten(-1, (attn.heads, -1)), v.unflatten(-1, (attn.heads, -1))
        o = packed.executor.cross_attention(q, k, v, packed.text).type_as(q)
        if attn.add_k_proj is not None:
            if packed.image is None:
                raise ValueError("this Wan model has image cross-attention (I2V): every WanSample needs an image")
            ki, vi = _kv(attn, packed.image.rows, added=True)
            ki = attn.norm_added_k(ki)
            ki, vi = ki.unflatten(-1, (attn.heads, -1)), vi.unflatten(-1, (attn.heads, -1))
            o = o + packed.executor.cross_attention(q, ki, vi, packed.image).type_as(q)
        o = o.flatten(1, 2)[None]
        return attn.to_out[1](attn.to_out[0](o))


def rope_tables(model, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE cos/sin (T, 1, Dh) of tokens at grid positions ``pos`` from the model's buffers."""
    rope = model.rope
    # (the family checks each sample's grid at home; a host tensor is checked here without a sync)
    if pos.device.type == "cpu" and pos.numel() and int(pos.numpy().max()) >= rope.max_seq_len:
        raise ValueError(
            f"a video side of {int(pos.numpy().max()) + 1} tokens exceeds the RoPE table ({rope.max_seq_len})"
        )
    sizes = [rope.t_dim, rope.h_dim, rope.w_dim]
    cos = [c.index_select(0, pos[:, i]) for i, c in enumerate(rope.freqs_cos.split(sizes, dim=1))]
    sin = [s.index_select(0, pos[:, i]) for i, s in enumerate(rope.freqs_sin.split(sizes, dim=1))]
    return torch.cat(cos, dim=1)[:, None], torch.cat(sin, dim=1)[:, None]
